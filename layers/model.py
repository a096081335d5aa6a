"""The resident reference model; its state_dict is key-for-key Hugging Face's GPTJForCausalLM."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from layers.block import GPTJBlock, GPTJEmbedding, GPTJHead, KVCache, init_weights
from layers.config import GPTJConfig

# Buffers that old GPT-J checkpoints carry and that hold no learned state.
IGNORED_CHECKPOINT_SUFFIXES = ("attn.bias", "attn.masked_bias")


def weight_decayed(shape: Sequence[int]) -> bool:
    """AdamW decays matrices and embeddings, not biases or LayerNorm parameters (HF Trainer's rule)."""
    return len(shape) >= 2


class _Transformer(nn.Module):
    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        self.wte = GPTJEmbedding(cfg).wte
        self.h = nn.ModuleList(GPTJBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)


class GPTJ(nn.Module):
    """GPT-J for causal LM. `model(input_ids)` -> float32 logits (B, T, vocab)."""

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

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a GPTJForCausalLM state dict strictly, naming missing, extra and mis-shaped keys."""
        clean = {k: v for k, v in state_dict.items() if not k.endswith(IGNORED_CHECKPOINT_SUFFIXES)}
        check_state_dict(self.state_dict(), clean)
        self.load_state_dict(clean, strict=True)


def build_unit(cfg: GPTJConfig, unit: str, device: torch.device | str = "meta") -> nn.Module:
    """An empty module of a unit's type (on `meta` by default: a shell for torch.func.functional_call)."""
    kind = unit.split(".", 1)[0]
    factory = {"embed": GPTJEmbedding, "block": GPTJBlock, "head": GPTJHead}.get(kind)
    if factory is None:
        raise ValueError(f"unknown unit {unit!r}; units are 'embed', 'block.N', 'head'")
    with torch.device(device):
        return factory(cfg)


def unit_prefix(unit: str) -> str:
    """The HF key prefix of a unit's tensors: 'embed' -> 'transformer.', 'block.3' -> 'transformer.h.3.'."""
    if unit == "embed":
        return "transformer."
    if unit == "head":
        return ""
    return f"transformer.h.{unit.split('.', 1)[1]}."


def unit_hf_key(unit: str, local_key: str) -> str:
    """Map a unit module's own key to the HF key: ('head', 'ln_f.weight') -> 'transformer.ln_f.weight'."""
    if unit == "head" and local_key.startswith("ln_f."):
        return "transformer." + local_key
    return unit_prefix(unit) + local_key


class CheckpointMismatch(ValueError):
    """A state dict whose keys or shapes do not match the model."""


def check_state_dict(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    wrong = sorted(
        f"{k}: expected {tuple(expected[k].shape)}, got {tuple(given[k].shape)}"
        for k in set(expected) & set(given) if tuple(expected[k].shape) != tuple(given[k].shape)
    )
    problems = []
    if missing:
        problems.append(f"missing keys {_few(missing)}")
    if extra:
        problems.append(f"unexpected keys {_few(extra)}")
    if wrong:
        problems.append(f"wrong shapes {_few(wrong)}")
    if problems:
        raise CheckpointMismatch(
            "checkpoint does not match the model config: " + "; ".join(problems)
            + " (is config.json the one this checkpoint was saved with?)"
        )


def _few(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return f"[{shown}{f', … {len(items) - limit} more' if len(items) > limit else ''}]"
