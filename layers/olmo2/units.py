"""OLMo 2's streamed units (embedding, decoder block, final norm + head) and its resident model, whose state_dict
is key for key transformers' Olmo2ForCausalLM. Its MLP is Llama's SwiGLU; the rest reads as OLMo 2's math
(layers/olmo2/config.py)."""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from layers.block import KVCache, RMSNorm, attend, full_attention_only
from layers.llama.units import Llama, LlamaEmbedding, LlamaHead, LlamaMLP
from layers.model import FamilyUnits
from layers.olmo2.config import Olmo2Config
from layers.rotary import apply_rotary_halves, sequence_sincos


class Olmo2RMSNorm(RMSNorm):
    """x / sqrt(mean(x^2) + eps) * weight, the weight too multiplied in fp32 before the cast back (HF's
    Olmo2RMSNorm; Llama's casts back before the weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class Olmo2Attention(nn.Module):
    """Grouped-query attention whose q and k are RMS-normalised over their whole projections (every head
    together) before the split into heads, then rotated (rotate-half RoPE) in fp32."""

    def __init__(self, cfg: Olmo2Config) -> None:
        super().__init__()
        self.cfg = cfg
        d, q, kv = cfg.hidden_size, cfg.attention_width, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, q, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, kv, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, kv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, d, bias=cfg.attention_bias)
        self.q_norm = Olmo2RMSNorm(q, cfg.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(kv, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` (B, T): packed rows' positions, restarting at 0 in each example; None: 0..T-1 from
        start_pos."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(B, T, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_norm(self.k_proj(x)).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        # fp32 tables: the rotation is computed in fp32 and rounded once to the compute dtype
        sin, cos = sequence_sincos(cfg.max_position_embeddings, cfg.head_dim, start_pos, T, torch.float32, x.device,
                                   positions, cfg.rope_parameters)
        q, k = apply_rotary_halves(q, sin, cos).to(x.dtype), apply_rotary_halves(k, sin, cos).to(x.dtype)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), start_pos, cache, positions)
        return self.o_proj(out)


class Olmo2Block(nn.Module):
    """Norms after the sublayers: h = h + norm(attn(h)); h = h + norm(mlp(h))."""

    def __init__(self, cfg: Olmo2Config, layer_type: str = "full_attention") -> None:
        super().__init__()
        full_attention_only(cfg, layer_type)
        self.self_attn = Olmo2Attention(cfg)
        self.mlp = LlamaMLP(cfg)  # SwiGLU, without biases (the config refuses mlp_bias)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(h, start_pos, cache, positions))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Olmo2Head(LlamaHead):
    """Llama's head with OLMo 2's final norm."""

    norm_type: ClassVar[type[nn.Module]] = Olmo2RMSNorm


UNITS = FamilyUnits(embed=LlamaEmbedding, block=Olmo2Block, head=Olmo2Head, model=Llama)
