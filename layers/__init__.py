"""Model math: each family's configuration and streamable units, the resident reference models and the loss.

The configurations (layers.config and each family folder's config.py) are torch-free, so memory_model can use
them without torch; the torch-using names are imported on first use (PEP 562).

`FAMILY_PACKAGES` is the one registration of the model families: a family is a folder, `layers/<family>/`, and
its line there (docs/ADDING_A_FAMILY.md). Importing `layers` imports each, whose `@family` classes fill
`FAMILIES` in this order: the order the CLI's help, its messages and README's list of models give them.
Everything that lists the families reads `FAMILIES`.
"""
from __future__ import annotations

import importlib
from typing import Any

from layers.config import FAMILIES, PRESETS, ConfigError, ModelConfig

# The family folders; a folder may define several model_types (layers.llama: llama, mistral, qwen2, qwen3) or
# none yet (layers.gpt_oss, built but not registered).
FAMILY_PACKAGES: tuple[str, ...] = (
    "layers.gptj",
    "layers.llama",
    "layers.olmo2",
    "layers.phi3",
    "layers.gemma3",
    "layers.moe",
    "layers.gpt_oss",
)


def load_family(package: str) -> list[str]:
    """Import a family folder's config module, which registers its `@family` classes, and give the names its
    package exports (its `__all__`)."""
    importlib.import_module(f"{package}.config")
    return list(getattr(importlib.import_module(package), "__all__", ()))


# Each family's exported names (its config classes) -> its package: `from layers import LlamaConfig`.
_FAMILY_NAMES = {name: package for package in FAMILY_PACKAGES for name in load_family(package)}

_LAZY = {
    "KVCache": "layers.block", "init_weights": "layers.block", "RMSNorm": "layers.block",
    "GPTJBlock": "layers.gptj.units", "GPTJEmbedding": "layers.gptj.units", "GPTJHead": "layers.gptj.units",
    "GPTJ": "layers.gptj.units",
    "IGNORE_INDEX": "layers.loss", "causal_lm_loss": "layers.loss", "learned_tokens": "layers.loss",
    "CausalLM": "layers.model", "CheckpointMismatch": "layers.model", "FamilyUnits": "layers.model",
    "build_unit": "layers.model", "check_state_dict": "layers.model", "resident_model": "layers.model",
    "unit_kind": "layers.model", "weight_decayed": "layers.model",
    **_FAMILY_NAMES,
}

__all__ = ["FAMILIES", "FAMILY_PACKAGES", "PRESETS", "ConfigError", "ModelConfig", "load_family", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'layers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
