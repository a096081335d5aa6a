"""Rotary position embeddings: the frequencies (with transformers' RoPE scalings: linear, llama3, longrope,
YaRN), their sin/cos tables, and the two ways of pairing a head's dimensions: interleaved (GPT-J's
rotate-every-two) and halves (Llama's and Phi-3's rotate-half), each over the first `rotary_dim` dimensions of a
head (a partial rotary factor).

longrope (Phi-3's long-context models) has two sets of frequencies: the short factors' for a sequence no longer
than `original_max_position_embeddings`, the long factors' for a longer one, picked by the whole sequence's
length as transformers picks them (its longest position + 1); both tables are scaled by the attention factor.
A KV cache filled with the short set is stale once the sequence grows past that length
(`AttentionLayout.regime_change`): generation recomputes its cache there, as transformers' `generate` does."""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

# GPT-J's frequencies: transformers' default RoPE with base 10000.
DEFAULT_ROPE: tuple[tuple[str, Any], ...] = (("rope_theta", 10000.0), ("rope_type", "default"))


def inv_frequencies(rotary_dim: int, rope: tuple[tuple[str, Any], ...], long: bool = False) -> torch.Tensor:
    """fp32 (rotary_dim/2,) inverse frequencies as transformers' modeling_rope_utils computes them; `long`:
    longrope's set for sequences past original_max_position_embeddings."""
    params = dict(rope)
    base, kind = params["rope_theta"], params.get("rope_type", "default")
    powers = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    if kind == "longrope":  # each frequency slowed by its own factor
        factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * powers)
    inv_freq = 1.0 / powers
    if kind == "yarn":
        return _yarn_frequencies(rotary_dim, params, inv_freq, 1.0 / (params["factor"] * powers))
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_context = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)  # long waves: slowed
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        return torch.where(medium, smoothed, scaled)
    # "default", and "dynamic": transformers grows the base only for sequences longer than
    # max_position_embeddings, which no sequence here is (the context check refuses them).
    return inv_freq


def _yarn_frequencies(rotary_dim: int, params: dict[str, Any], fast: torch.Tensor,
                      slow: torch.Tensor) -> torch.Tensor:
    """YaRN's frequencies (transformers' `_compute_yarn_parameters`): the fast ones, making more than beta_fast
    turns over the original context, kept; the slow ones, fewer than beta_slow turns, interpolated (divided by
    factor); a linear ramp between, over the dimensions where those turn counts fall."""
    base, original = params["rope_theta"], params["original_max_position_embeddings"]

    def dimension(turns: float) -> float:  # the dimension whose frequency makes `turns` turns over the original
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(params.get("beta_fast") or 32), dimension(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return slow * (1 - kept) + fast * kept


def _long_after(rope: tuple[tuple[str, Any], ...]) -> int | None:
    """The sequence length past which longrope's long set is used (original_max_position_embeddings); None:
    one set."""
    params = dict(rope)
    return params["original_max_position_embeddings"] if params.get("rope_type") == "longrope" else None


def attention_factor(rope: tuple[tuple[str, Any], ...], n_positions: int) -> float:
    """longrope's and YaRN's scale of sin and cos (transformers' `_compute_longrope_parameters`,
    `_compute_yarn_parameters`): the given attention_factor, else for longrope sqrt(1 + ln(factor) / ln(original))
    where the context was extended by factor (by default max_position_embeddings /
    original_max_position_embeddings), for YaRN 0.1 ln(factor) + 1 (or the ratio of two such with mscale and
    mscale_all_dim); 1 for the other scalings."""
    params = dict(rope)
    if params.get("rope_type") not in ("longrope", "yarn"):
        return 1.0
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    if params["rope_type"] == "yarn":
        def mscale(factor: float, scale: float = 1.0) -> float:
            return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

        factor, scale, scale_all = params["factor"], params.get("mscale"), params.get("mscale_all_dim")
        return mscale(factor, scale) / mscale(factor, scale_all) if scale and scale_all else mscale(factor)
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = n_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _is_long(rope: tuple[tuple[str, Any], ...], length: int) -> bool:
    change = _long_after(rope)
    return change is not None and length > change


@functools.lru_cache(maxsize=16)
def sincos_table(n_positions: int, rotary_dim: int, device: torch.device,
                 rope: tuple[tuple[str, Any], ...] = DEFAULT_ROPE,
                 long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (n_positions, rotary_dim/2) sin and cos of position x frequency, times longrope's attention factor;
    `long`: longrope's long set."""
    angles = torch.arange(n_positions, dtype=torch.int64).float()[:, None] * inv_frequencies(rotary_dim, rope, long)
    scale = attention_factor(rope, n_positions)
    return (torch.sin(angles) * scale).to(device), (torch.cos(angles) * scale).to(device)


def apply_rotary(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2*sin.shape[-1] dims of x (B, T, H, D) pairwise: (x0, x1) -> (x0 c - x1 s, x1 c + x0 s).

    sin/cos: (T, R/2) or (B, T, R/2), already in x's dtype.
    """
    rotary_dim = 2 * sin.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    sin, cos = sin.unsqueeze(-2), cos.unsqueeze(-2)  # broadcast over heads: (..., T, 1, R/2)
    even, odd = x_rot[..., 0::2], x_rot[..., 1::2]  # (B, T, H, R/2) each
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)  # (B, T, H, R)
    return torch.cat((rotated, x_pass), dim=-1)


def apply_rotary_halves(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Rotate dimension i with dimension i + R/2 of the first R = 2*sin.shape[-1] dims of x (B, T, H, D):
    (x1, x2) -> (x1 c - x2 s, x2 c + x1 s); the other D - R pass unchanged.

    sin/cos: (T, R/2) or (B, T, R/2), already in x's dtype.
    """
    sin, cos = sin.unsqueeze(-2), cos.unsqueeze(-2)  # broadcast over heads
    rotary_dim = 2 * sin.shape[-1]
    x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated if rotary_dim == x.shape[-1] else torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def positions_sincos(
    n_positions: int, rotary_dim: int, start: int, length: int, dtype: torch.dtype, device: torch.device,
    rope: tuple[tuple[str, Any], ...] = DEFAULT_ROPE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sin/cos (length, rotary_dim/2) for positions start..start+length-1 of a sequence of start+length
    positions, cast to the compute dtype."""
    if start < 0 or start + length > n_positions:
        raise ValueError(
            f"positions {start}..{start + length - 1} exceed the model's context n_positions={n_positions}; "
            "use shorter sequences"
        )
    sin, cos = sincos_table(n_positions, rotary_dim, torch.device(device), rope, _is_long(rope, start + length))
    return sin[start:start + length].to(dtype), cos[start:start + length].to(dtype)


def rows_sincos(n_positions: int, rotary_dim: int, positions: torch.Tensor, dtype: torch.dtype,
                rope: tuple[tuple[str, Any], ...] = DEFAULT_ROPE) -> tuple[torch.Tensor, torch.Tensor]:
    """sin/cos (B, T, rotary_dim/2) of each row's own positions (B, T) (packed examples restart at 0), cast to
    the compute dtype. The positions are checked against n_positions where the batch enters the trainer."""
    sin, cos = sincos_table(n_positions, rotary_dim, positions.device, rope)
    change = _long_after(rope)
    if change is None:
        return sin[positions].to(dtype), cos[positions].to(dtype)
    # transformers picks longrope's set by the batch's longest position, on the device (no host sync)
    long_sin, long_cos = sincos_table(n_positions, rotary_dim, positions.device, rope, True)
    long = positions.max() + 1 > change
    return (torch.where(long, long_sin[positions], sin[positions]).to(dtype),
            torch.where(long, long_cos[positions], cos[positions]).to(dtype))


def sequence_sincos(n_positions: int, rotary_dim: int, start: int, length: int, dtype: torch.dtype,
                    device: torch.device, positions: torch.Tensor | None = None,
                    rope: tuple[tuple[str, Any], ...] = DEFAULT_ROPE) -> tuple[torch.Tensor, torch.Tensor]:
    """The sin/cos a block rotates a sequence with: of packed rows' own `positions` (B, T) where given
    (`rows_sincos`), else of positions start..start+length-1 (`positions_sincos`)."""
    if positions is None:
        return positions_sincos(n_positions, rotary_dim, start, length, dtype, device, rope)
    return rows_sincos(n_positions, rotary_dim, positions, dtype, rope)
