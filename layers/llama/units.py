"""The Llama family's streamed units (embedding, decoder block, final norm + head) and its resident model, whose
state_dict is key for key transformers' LlamaForCausalLM (MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM). The variations are the config's class attributes (layers/llama.py)."""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from layers.block import KVCache, full_attention_only, RMSNorm, attend, embedding, init_weights, language_model_output
from layers.llama.config import LlamaConfig
from layers.loss import Objective
from layers.model import CausalLM, FamilyUnits, family_units
from layers.rotary import apply_rotary_halves, sequence_sincos


class LlamaEmbedding(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)

    @staticmethod
    def lookup(table: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of input_ids (B, T) -> (B, T, d); the resident model looks up its table the same way."""
        return table(input_ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(self.embed_tokens, input_ids)


def rotary_attention(cfg: LlamaConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int,
                     cache: KVCache | None, positions: torch.Tensor | None) -> torch.Tensor:
    """Rotate-half RoPE on q (B, T, H, D) and k (B, T, H_kv, D) over each head's first rotary_dim dims, then
    causal attention with v: (B, T, H * D). `positions` (B, T): packed rows' positions, restarting at 0 in each
    example; None: 0..T-1 from start_pos."""
    T = q.shape[1]
    sin, cos = sequence_sincos(cfg.max_position_embeddings, cfg.rotary_dim, start_pos, T, q.dtype, q.device,
                               positions, cfg.rope_parameters)
    q, k = apply_rotary_halves(q, sin, cos), apply_rotary_halves(k, sin, cos)
    return attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), start_pos, cache, positions)


class LlamaAttention(nn.Module):
    """Grouped-query attention: H query heads share H_kv key/value heads; rotate-half RoPE on q and k."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        self.q_proj = nn.Linear(d, q, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv, bias=qkv_bias)
        self.o_proj = nn.Linear(q, d, bias=cfg.attention_bias)
        if cfg.qk_norm:  # over each head, or over the whole projection
            self.q_norm = RMSNorm(q if cfg.qk_norm_whole else cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(kv if cfg.qk_norm_whole else cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` (B, T): packed rows' positions, restarting at 0 in each example; None: 0..T-1 from
        start_pos."""
        cfg = self.cfg
        B, T, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if cfg.qk_norm and cfg.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm and not cfg.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(rotary_attention(cfg, q, k, v, start_pos, cache, positions))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm residual: h = h + attn(norm(h)); h = h + mlp(norm(h))."""

    # The attention and MLP modules (Phi-3's hold their projections fused; a mixture of experts' MLP is sparse)
    attention_type: ClassVar[type[nn.Module]] = LlamaAttention
    mlp_type: ClassVar[type[nn.Module]] = LlamaMLP

    def __init__(self, cfg: LlamaConfig, layer_type: str = "full_attention") -> None:
        super().__init__()
        full_attention_only(cfg, layer_type)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_type(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.mlp_type(cfg)

    def forward(self, h: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), start_pos, cache, positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaHead(nn.Module):
    """Final RMSNorm and the language-model head (no bias): float32 logits, or with labels the causal-LM loss."""

    norm_type: ClassVar[type[nn.Module]] = RMSNorm  # the family's RMSNorm (OLMo 2's and Gemma's differ)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.norm = self.norm_type(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, vocab_chunk: int = 0,
                objective: Objective | None = None) -> torch.Tensor:
        """Logits (B, T, vocab), or given labels `objective`'s loss (layers.block.language_model_output)."""
        return language_model_output(self.norm(h), self.lm_head, labels, vocab_chunk, objective)


class _Model(nn.Module):
    """transformers' `model.` body: the embedding table, the blocks of each layer type, the final norm."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        units = family_units(cfg)
        table = units.embed(cfg).embed_tokens
        assert isinstance(table, nn.Embedding)  # every family's table
        self.embed_tokens = table
        self.layers = nn.ModuleList(units.block(cfg, kind) for kind in cfg.attention().layer_types())
        head = units.head
        assert isinstance(head, type) and issubclass(head, LlamaHead)  # a Llama-shaped family's
        self.norm = head.norm_type(cfg.hidden_size, cfg.rms_norm_eps)


class Llama(CausalLM):
    """A model for causal LM of any Llama-shaped family (embedding, blocks, final norm, lm_head; its units
    `UNITS`), resident. `model(input_ids)` -> float32 logits (B, T, vocab)."""

    def __init__(self, cfg: LlamaConfig, init: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        embedding = family_units(cfg).embed
        assert isinstance(embedding, type) and issubclass(embedding, LlamaEmbedding)  # a Llama-shaped family's
        self.lookup = embedding.lookup
        self.model = _Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if init:
            init_weights(self)
        if cfg.tie_word_embeddings:  # one parameter, the embedding's (transformers' tie_weights)
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, start_pos: int = 0, caches: list[KVCache] | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.lookup(self.model.embed_tokens, input_ids)  # (B, T, d)
        for i, block in enumerate(self.model.layers):
            h = block(h, start_pos, None if caches is None else caches[i], positions)
        return self.lm_head(self.model.norm(h)).float()  # (B, T, vocab)


UNITS = FamilyUnits(embed=LlamaEmbedding, block=LlamaBlock, head=LlamaHead, model=Llama)
