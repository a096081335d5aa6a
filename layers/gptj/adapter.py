"""How transformers names GPT-J's model (torch-free): its config.json read and written, its checkpoint's keys
('transformer.h.3.')."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from layers.adapter import StateDictAdapter
from layers.config import ConfigError, take_aliases

# Dropout is a training-time regulariser the public checkpoints set to 0.
_HF_DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")


class GPTJAdapter(StateDictAdapter):
    body: ClassVar[str] = "transformer."
    blocks: ClassVar[str] = "h"
    final_norm: ClassVar[str] = "ln_f"

    @classmethod
    def config_fields(cls, config: type[Any], raw: dict[str, Any]) -> dict[str, Any]:
        for key in _HF_DROPOUT_KEYS:
            value = raw.pop(key, 0.0)
            if value not in (0, 0.0, None):
                raise ConfigError(f"{key}={value} is not supported (no dropout); set it to 0.0")
        take_aliases(raw, {"hidden_size": "n_embd", "num_attention_heads": "n_head",
                           "num_hidden_layers": "n_layer", "max_position_embeddings": "n_positions"})
        # The published GPT-J config says "rotary": true; rotary is not optional here.
        if raw.pop("rotary", True) is not True:
            raise ConfigError("rotary=false (no rotary embedding) is not GPT-J; remove it or set it to true")
        if raw.get("rotary_dim", 64) is None:
            raise ConfigError("rotary_dim=None (rotary over the whole head) is not supported; set rotary_dim")
        return cls.own_fields(config, raw)

    def to_hf(self) -> dict[str, Any]:
        """The config.json that transformers.GPTJForCausalLM reads."""
        vocab_size = self.cfg.vocab_size
        return {
            "architectures": ["GPTJForCausalLM"], "model_type": "gptj",
            **dataclasses.asdict(self.cfg),
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": 50256 if vocab_size > 50256 else 0,
            "eos_token_id": 50256 if vocab_size > 50256 else 0,
        }
