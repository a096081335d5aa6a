"""Model math: each family's configuration and streamable units, the resident reference models and the loss.

The configurations (layers.config and each family folder's config.py) are torch-free, so memory_model can use
them without torch; the torch-using names are imported on first use (PEP 562). Importing a family's package
registers its config classes in `FAMILIES`.
"""
from __future__ import annotations

import importlib
from typing import Any

from layers.config import FAMILIES, PRESETS, ConfigError, ModelConfig
from layers.gptj import GPTJConfig
from layers.llama import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from layers.olmo2 import Olmo2Config
from layers.phi3 import Phi3Config
from layers.gemma3 import Gemma3TextConfig
from layers.moe import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
from layers.gpt_oss import GptOssConfig

_LAZY = {
    "KVCache": "layers.block", "init_weights": "layers.block", "RMSNorm": "layers.block",
    "GPTJBlock": "layers.gptj.units", "GPTJEmbedding": "layers.gptj.units", "GPTJHead": "layers.gptj.units",
    "GPTJ": "layers.gptj.units",
    "IGNORE_INDEX": "layers.loss", "causal_lm_loss": "layers.loss", "learned_tokens": "layers.loss",
    "CausalLM": "layers.model", "CheckpointMismatch": "layers.model", "FamilyUnits": "layers.model",
    "build_unit": "layers.model", "check_state_dict": "layers.model", "resident_model": "layers.model",
    "unit_kind": "layers.model", "weight_decayed": "layers.model",
}

__all__ = ["FAMILIES", "PRESETS", "ConfigError", "Gemma3TextConfig", "GPTJConfig", "GptOssConfig", "LlamaConfig",
           "MistralConfig", "MixtralConfig", "ModelConfig", "Olmo2Config", "OlmoeConfig", "Phi3Config", "Qwen2Config",
           "Qwen3Config", "Qwen3MoeConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'layers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
