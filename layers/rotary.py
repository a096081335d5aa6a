"""Rotary position embeddings: the frequencies (with transformers' RoPE scalings), their sin/cos tables, and
the two ways of pairing a head's dimensions: interleaved (GPT-J's rotate-every-two, partial) and halves
(Llama's rotate-half)."""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

# GPT-J's frequencies: transformers' default RoPE with base 10000.
DEFAULT_ROPE: tuple[tuple[str, Any], ...] = (("rope_theta", 10000.0), ("rope_type", "default"))


def inv_frequencies(rotary_dim: int, rope: tuple[tuple[str, Any], ...]) -> torch.Tensor:
    """fp32 (rotary_dim/2,) inverse frequencies as transformers' modeling_rope_utils computes them."""
    params = dict(rope)
    base, kind = params["rope_theta"], params.get("rope_type", "default")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
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


@functools.lru_cache(maxsize=16)
def sincos_table(n_positions: int, rotary_dim: int, device: torch.device,
                 rope: tuple[tuple[str, Any], ...] = DEFAULT_ROPE) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (n_positions, rotary_dim/2) sin and cos of position x frequency."""
    angles = torch.arange(n_positions, dtype=torch.int64).float()[:, None] * inv_frequencies(rotary_dim, rope)
    return torch.sin(angles).to(device), torch.cos(angles).to(device)


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
    """Rotate dimension i with dimension i + D/2 of x (B, T, H, D): (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).

    sin/cos: (T, D/2) or (B, T, D/2), already in x's dtype.
    """
    sin, cos = sin.unsqueeze(-2), cos.unsqueeze(-2)  # broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def positions_sincos(
    n_positions: int, rotary_dim: int, start: int, length: int, dtype: torch.dtype, device: torch.device,
    rope: tuple[tuple[str, Any], ...] = DEFAULT_ROPE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sin/cos (length, rotary_dim/2) for positions start..start+length-1, cast to the compute dtype."""
    if start < 0 or start + length > n_positions:
        raise ValueError(
            f"positions {start}..{start + length - 1} exceed the model's context n_positions={n_positions}; "
            "use shorter sequences"
        )
    sin, cos = sincos_table(n_positions, rotary_dim, torch.device(device), rope)
    return sin[start:start + length].to(dtype), cos[start:start + length].to(dtype)


def rows_sincos(n_positions: int, rotary_dim: int, positions: torch.Tensor, dtype: torch.dtype,
                rope: tuple[tuple[str, Any], ...] = DEFAULT_ROPE) -> tuple[torch.Tensor, torch.Tensor]:
    """sin/cos (B, T, rotary_dim/2) of each row's own positions (B, T) (packed examples restart at 0), cast to
    the compute dtype. The positions are checked against n_positions where the batch enters the trainer."""
    sin, cos = sincos_table(n_positions, rotary_dim, positions.device, rope)
    return sin[positions].to(dtype), cos[positions].to(dtype)
