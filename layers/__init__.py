"""GPT-J model math: configuration, the streamable units, the resident reference model and the loss."""
from layers.block import GPTJBlock, GPTJEmbedding, GPTJHead, KVCache, init_weights
from layers.config import PRESETS, ConfigError, GPTJConfig
from layers.loss import IGNORE_INDEX, causal_lm_loss
from layers.model import (
    GPTJ, IGNORED_CHECKPOINT_SUFFIXES, CheckpointMismatch, build_unit, check_state_dict, unit_hf_key, unit_names,
    unit_prefix,
)

__all__ = [
    "GPTJ", "GPTJBlock", "GPTJConfig", "GPTJEmbedding", "GPTJHead", "KVCache", "PRESETS", "ConfigError",
    "CheckpointMismatch", "IGNORE_INDEX", "IGNORED_CHECKPOINT_SUFFIXES", "causal_lm_loss", "check_state_dict",
    "build_unit", "init_weights", "unit_hf_key", "unit_names", "unit_prefix",
]
