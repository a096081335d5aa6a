"""How transformers names Phi-3's model (torch-free): Llama's checkpoint keys; its config.json's dropouts and
older names of longrope."""
from __future__ import annotations

from typing import Any, ClassVar

from layers.config import ConfigError
from layers.llama.adapter import LlamaAdapter, rope_parameters_of

# Dropout is a training-time regulariser the published checkpoints set to 0.
_HF_DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attention_dropout")


class Phi3Adapter(LlamaAdapter):
    defaults: ClassVar[dict[str, Any]] = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                                          "pad_token_id": 32000}
    @classmethod
    def config_fields(cls, config: type[Any], raw: dict[str, Any]) -> dict[str, Any]:
        for key in _HF_DROPOUT_KEYS:
            value = raw.pop(key, 0.0)
            if value not in (0, None):
                raise ConfigError(f"{key}={value!r} is not supported (no dropout); set it to 0.0")
        rope = rope_parameters_of(raw)
        if rope["rope_type"] in ("su", "yarn"):  # transformers' names of longrope in older Phi-3 files
            rope["rope_type"] = "longrope"
        rope.setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        raw["rope_parameters"] = rope
        return cls.own_fields(config, {k: v for k, v in raw.items() if k not in ("attention_bias", "mlp_bias")})

    def to_hf(self) -> dict[str, Any]:
        return {**super().to_hf(), "resid_pdrop": 0.0, "embd_pdrop": 0.0}
