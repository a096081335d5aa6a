"""GPT-J model math: configuration, the streamable units, the resident reference model and the loss.

The configuration (layers.config) is torch-free, so memory_model can use it without torch; the torch-using
names are imported on first use (PEP 562).
"""
from __future__ import annotations

import importlib
from typing import Any

from layers.config import PRESETS, ConfigError, GPTJConfig

_LAZY = {
    "GPTJBlock": "layers.block", "GPTJEmbedding": "layers.block", "GPTJHead": "layers.block",
    "KVCache": "layers.block", "init_weights": "layers.block",
    "IGNORE_INDEX": "layers.loss", "causal_lm_loss": "layers.loss", "learned_tokens": "layers.loss",
    "GPTJ": "layers.model", "IGNORED_CHECKPOINT_SUFFIXES": "layers.model", "CheckpointMismatch": "layers.model",
    "build_unit": "layers.model", "check_state_dict": "layers.model", "unit_hf_key": "layers.model",
    "unit_prefix": "layers.model", "weight_decayed": "layers.model",
}

__all__ = ["PRESETS", "ConfigError", "GPTJConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'layers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
