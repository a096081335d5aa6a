"""Partial rotary position embedding, interleaved (GPT-J's rotate-every-two)."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def sincos_table(n_positions: int, rotary_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (n_positions, rotary_dim/2) sin and cos, as HF's create_sinusoidal_positions computes them."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64) / rotary_dim))
    angles = torch.arange(n_positions, dtype=torch.int64).float()[:, None] * inv_freq
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


def positions_sincos(
    n_positions: int, rotary_dim: int, start: int, length: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """sin/cos (length, rotary_dim/2) for positions start..start+length-1, cast to the compute dtype."""
    if start < 0 or start + length > n_positions:
        raise ValueError(
            f"positions {start}..{start + length - 1} exceed the model's context n_positions={n_positions}; "
            "use shorter sequences"
        )
    sin, cos = sincos_table(n_positions, rotary_dim, torch.device(device))
    return sin[start:start + length].to(dtype), cos[start:start + length].to(dtype)


def rows_sincos(n_positions: int, rotary_dim: int, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """sin/cos (B, T, rotary_dim/2) of each row's own positions (B, T) (packed examples restart at 0), cast to
    the compute dtype. The positions are checked against n_positions where the batch enters the trainer."""
    sin, cos = sincos_table(n_positions, rotary_dim, positions.device)
    return sin[positions].to(dtype), cos[positions].to(dtype)
