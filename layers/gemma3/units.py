"""Gemma 3's streamed units (scaled embedding, decoder block of either layer type, final norm + head) and its
resident model, whose state_dict is key for key transformers' Gemma3ForCausalLM."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layers.block import KVCache, OffsetRMSNorm, attend, embedding, init_weights, language_model_output
from layers.gemma3.config import Gemma3TextConfig
from layers.model import CausalLM, FamilyUnits
from layers.rotary import apply_rotary_halves, positions_sincos, rows_sincos


def scaled_embedding(table: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """The rows of input_ids times sqrt(hidden_size), the scale rounded to the table's dtype first (HF's
    Gemma3TextScaledWordEmbedding: in bf16, sqrt(2560) = 50.596 is 50.5). A Python number, so autograd saves no
    tensor for it."""
    scale = torch.tensor(table.embedding_dim ** 0.5, device="cpu").to(table.weight.dtype).item()
    return table(input_ids) * scale


class Gemma3Embedding(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return scaled_embedding(self.embed_tokens, input_ids)  # (B, T, d)


class Gemma3Attention(nn.Module):
    """Grouped-query attention with RMSNorm on each head of q and k, rotate-half RoPE of the layer type's own
    frequencies, scores scaled by query_pre_attn_scalar^-1/2, over a sliding window on sliding layers."""

    def __init__(self, cfg: Gemma3TextConfig, layer_type: str) -> None:
        super().__init__()
        self.cfg, self.rope = cfg, cfg.rope(layer_type)
        self.window = cfg.attention_window(layer_type)
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
        if positions is None:
            sin, cos = positions_sincos(cfg.max_position_embeddings, cfg.head_dim, start_pos, T, x.dtype, x.device,
                                        self.rope)
        else:
            sin, cos = rows_sincos(cfg.max_position_embeddings, cfg.head_dim, positions, x.dtype, self.rope)
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


class Gemma3Head(nn.Module):
    """Final norm and the language-model head (no bias): float32 logits, or with labels the causal-LM loss."""

    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, vocab_chunk: int = 0,
                num_items: float | None = None) -> torch.Tensor:
        return language_model_output(self.norm(h), self.lm_head, labels, vocab_chunk, num_items)


class _Model(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.embed_tokens = Gemma3Embedding(cfg).embed_tokens
        self.layers = nn.ModuleList(Gemma3Block(cfg, kind) for kind in cfg.layer_types())
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3(CausalLM):
    """Gemma 3's text decoder for causal LM, resident. `model(input_ids)` -> float32 logits (B, T, vocab)."""

    def __init__(self, cfg: Gemma3TextConfig, init: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if init:
            init_weights(self)
        if cfg.tie_word_embeddings:  # one parameter, the embedding's (transformers' tie_weights)
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, start_pos: int = 0, caches: list[KVCache] | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = scaled_embedding(self.model.embed_tokens, input_ids)  # (B, T, d)
        for i, block in enumerate(self.model.layers):
            h = block(h, start_pos, None if caches is None else caches[i], positions)
        return self.lm_head(self.model.norm(h)).float()  # (B, T, vocab)


UNITS = FamilyUnits(embed=Gemma3Embedding, block=Gemma3Block, head=Gemma3Head, model=Gemma3)
