"""Gemma 3's streamed units (scaled embedding, decoder block of either layer type, final norm + head) and its
resident model, whose state_dict is key for key transformers' Gemma3ForCausalLM."""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from layers.block import KVCache, OffsetRMSNorm, attend
from layers.gemma3.config import Gemma3TextConfig
from layers.llama.units import Llama, LlamaEmbedding, LlamaHead
from layers.model import FamilyUnits
from layers.rotary import apply_rotary_halves, sequence_sincos


def scaled_embedding(table: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """The rows of input_ids times sqrt(hidden_size), the scale rounded to the table's dtype first (HF's
    Gemma3TextScaledWordEmbedding: in bf16, sqrt(2560) = 50.596 is 50.5). A Python number, so autograd saves no
    tensor for it."""
    scale = torch.tensor(table.embedding_dim ** 0.5, device="cpu").to(table.weight.dtype).item()
    return table(input_ids) * scale


class Gemma3Embedding(LlamaEmbedding):
    """Llama's embedding, its rows scaled by sqrt(hidden_size)."""

    lookup = staticmethod(scaled_embedding)


class Gemma3Attention(nn.Module):
    """Grouped-query attention with RMSNorm on each head of q and k, rotate-half RoPE of the layer type's own
    frequencies, scores scaled by query_pre_attn_scalar^-1/2, over a sliding window on sliding layers."""

    def __init__(self, cfg: Gemma3TextConfig, layer_type: str) -> None:
        super().__init__()
        self.cfg, self.rope = cfg, cfg.rope(layer_type)
        self.window = cfg.attention().window(layer_type)
        d, q, kv = cfg.hidden_size, cfg.attention_width, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, q, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, kv, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, kv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, d, bias=cfg.attention_bias)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim))
        v = self.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        sin, cos = sequence_sincos(cfg.max_position_embeddings, cfg.head_dim, start_pos, T, x.dtype, x.device,
                                   positions, self.rope)
        q, k = apply_rotary_halves(q, sin, cos), apply_rotary_halves(k, sin, cos)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), start_pos, cache, positions,
                     self.window, cfg.query_pre_attn_scalar ** -0.5)
        return self.o_proj(out)


class Gemma3MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3Block(nn.Module):
    """Norms before and after each residual branch: h = h + norm(attn(norm(h))); h = h + norm(mlp(norm(h)))."""

    def __init__(self, cfg: Gemma3TextConfig, layer_type: str) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(d, eps)
        self.self_attn = Gemma3Attention(cfg, layer_type)
        self.post_attention_layernorm = OffsetRMSNorm(d, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(d, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = OffsetRMSNorm(d, eps)

    def forward(self, h: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), start_pos, cache, positions))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Head(LlamaHead):
    """Llama's head with Gemma's final norm (1 + weight)."""

    norm_type: ClassVar[type[nn.Module]] = OffsetRMSNorm


UNITS = FamilyUnits(embed=Gemma3Embedding, block=Gemma3Block, head=Gemma3Head, model=Llama)
