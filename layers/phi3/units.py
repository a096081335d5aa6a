"""The Phi-3 family's streamed units and its resident model, whose state_dict is key for key transformers'
Phi3ForCausalLM: Llama's block (layers/llama/units.py) with q, k and v from one projection and the gate and up
from one; the embedding and the head are Llama's."""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from layers.block import KVCache
from layers.llama.units import Llama, LlamaBlock, LlamaEmbedding, LlamaHead, rotary_attention
from layers.model import FamilyUnits
from layers.phi3.config import Phi3Config


class Phi3Attention(nn.Module):
    """Grouped-query attention whose q, k and v are the three parts of one projection's output, in that order."""

    def __init__(self, cfg: Phi3Config) -> None:
        super().__init__()
        self.cfg = cfg
        d, q, kv = cfg.hidden_size, cfg.attention_width, cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(d, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, d, bias=False)

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        kv = cfg.num_key_value_heads * cfg.head_dim
        q, k, v = self.qkv_proj(x).split((cfg.attention_width, kv, kv), dim=-1)
        q = q.view(B, T, cfg.num_attention_heads, cfg.head_dim)
        k, v = k.view(B, T, cfg.num_key_value_heads, cfg.head_dim), v.view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        return self.o_proj(rotary_attention(cfg, q, k, v, start_pos, cache, positions))


class Phi3MLP(nn.Module):
    """SwiGLU with the gate and up projections in one: gate, up = gate_up(x); down(silu(gate) * up)."""

    def __init__(self, cfg: Phi3Config) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Phi3Block(LlamaBlock):
    """Llama's pre-norm residual block with Phi-3's fused projections."""

    attention_type: ClassVar[type[nn.Module]] = Phi3Attention
    mlp_type: ClassVar[type[nn.Module]] = Phi3MLP



UNITS = FamilyUnits(embed=LlamaEmbedding, block=Phi3Block, head=LlamaHead, model=Llama)
