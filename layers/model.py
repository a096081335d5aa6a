"""What generic code asks of a family's torch side: a unit's module, the resident reference model, its strict
HF loading, and the weight-decay rule. The family's units module is named by its config (`cfg.units`)."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Sequence

import torch
from torch import nn

from layers.config import ModelConfig


def weight_decayed(shape: Sequence[int]) -> bool:
    """AdamW decays matrices and embeddings, not biases or norm weights (HF Trainer's rule)."""
    return len(shape) >= 2


def family_units(cfg: ModelConfig) -> ModuleType:
    """The module of cfg's family units: UNITS ({'embed', 'block', 'head'} -> class) and MODEL."""
    return importlib.import_module(cfg.units)


def build_unit(cfg: ModelConfig, unit: str, device: torch.device | str = "meta") -> nn.Module:
    """An empty module of a unit's type (on `meta` by default: a shell for torch.func.functional_call)."""
    factory = family_units(cfg).UNITS.get(unit.split(".", 1)[0])
    if factory is None:
        raise ValueError(f"unknown unit {unit!r}; units are 'embed', 'block.N', 'head'")
    with torch.device(device):
        return factory(cfg)


def resident_model(cfg: ModelConfig, init: bool = True) -> "CausalLM":
    """The family's whole model in memory, HF's structure and keys; HF's initialisation unless `init=False`."""
    return family_units(cfg).MODEL(cfg, init=init)


class CausalLM(nn.Module):
    """The base of a family's resident model: `model(input_ids)` -> float32 logits (B, T, vocab); its
    state_dict is the transformers class's, key for key."""

    cfg: ModelConfig

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load an HF state dict strictly, naming missing, extra and mis-shaped keys. A tied parameter is read
        from the one tensor a tied checkpoint holds."""
        clean = {k: v for k, v in state_dict.items() if not k.endswith(self.cfg.ignored_checkpoint_suffixes)}
        for tied, owner in self.cfg.tied_hf_keys().items():
            if owner in clean:
                clean[tied] = clean[owner]
        check_state_dict(self.state_dict(), clean)
        self.load_state_dict(clean, strict=True)


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
