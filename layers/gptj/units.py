"""GPT-J's streamed units (embedding, decoder block, final norm + head) and its resident model, whose
state_dict is key for key Hugging Face's GPTJForCausalLM."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layers.block import KVCache, full_attention_only, attend, embedding, init_weights, language_model_output
from layers.gptj.config import GPTJConfig
from layers.loss import Objective
from layers.model import CausalLM, FamilyUnits
from layers.rotary import apply_rotary, sequence_sincos


class GPTJEmbedding(nn.Module):
    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        self.wte = embedding(cfg.vocab_size, cfg.n_embd)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids)  # (B, T, d)


class GPTJAttention(nn.Module):
    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.n_embd
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` (B, T): each token's position in its example (packed rows restart at 0 per example), so
        examples neither see each other nor their offset in the row; None: 0..T-1 from start_pos, causal."""
        cfg = self.cfg
        B, T, _ = x.shape
        split = (B, T, cfg.n_head, cfg.head_dim)
        q, k, v = self.q_proj(x).view(split), self.k_proj(x).view(split), self.v_proj(x).view(split)  # (B, T, H, D)
        sin, cos = sequence_sincos(cfg.n_positions, cfg.rotary_dim, start_pos, T, x.dtype, x.device, positions)
        q, k = apply_rotary(q, sin, cos), apply_rotary(k, sin, cos)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), start_pos, cache, positions)
        return self.out_proj(out)


class GPTJMLP(nn.Module):
    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.n_embd, cfg.intermediate_size)
        self.fc_out = nn.Linear(cfg.intermediate_size, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))  # tanh GELU == HF's gelu_new


class GPTJBlock(nn.Module):
    """Parallel attention and MLP on one shared LayerNorm: h + attn(ln_1(h)) + mlp(ln_1(h))."""

    def __init__(self, cfg: GPTJConfig, layer_type: str = "full_attention") -> None:
        super().__init__()
        full_attention_only(cfg, layer_type)
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPTJAttention(cfg)
        self.mlp = GPTJMLP(cfg)

    def forward(self, h: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.ln_1(h)
        return h + self.attn(x, start_pos, cache, positions) + self.mlp(x)


class GPTJHead(nn.Module):
    """Final LayerNorm and the language-model head: float32 logits, or with labels the causal-LM loss."""

    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, vocab_chunk: int = 0,
                objective: Objective | None = None) -> torch.Tensor:
        """Logits (B, T, vocab), or given labels `objective`'s loss (layers.block.language_model_output)."""
        return language_model_output(self.ln_f(h), self.lm_head, labels, vocab_chunk, objective)


class _Transformer(nn.Module):
    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        self.wte = GPTJEmbedding(cfg).wte
        self.h = nn.ModuleList(GPTJBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)


class GPTJ(CausalLM):
    """GPT-J for causal LM, resident. `model(input_ids)` -> float32 logits (B, T, vocab)."""

    def __init__(self, cfg: GPTJConfig, init: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = _Transformer(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size)
        if init:
            init_weights(self)

    def forward(self, input_ids: torch.Tensor, start_pos: int = 0, caches: list[KVCache] | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` (B, T): packed rows' positions, restarting at 0 in each example (GPTJAttention)."""
        h = self.transformer.wte(input_ids)  # (B, T, d)
        for i, block in enumerate(self.transformer.h):
            h = block(h, start_pos, None if caches is None else caches[i], positions)
        return self.lm_head(self.transformer.ln_f(h)).float()  # (B, T, vocab)


UNITS = FamilyUnits(embed=GPTJEmbedding, block=GPTJBlock, head=GPTJHead, model=GPTJ)
