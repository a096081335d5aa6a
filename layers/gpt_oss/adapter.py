"""How transformers names and saves gpt-oss's model (torch-free): Llama's checkpoint keys, its experts fused as
transformers holds them (the published files hold them MXFP4-packed); its config.json's YaRN and layer types."""
from __future__ import annotations

import dataclasses
from typing import Any

from layers.config import ConfigError
from layers.llama.adapter import LlamaAdapter, rope_parameters_of
from layers.moe.adapter import read_hf_experts

# transformers' RoPE where a config names none (GptOssConfig's): YaRN, 32 times the original 4096 positions.
DEFAULT_ROPE: dict[str, Any] = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}


class GptOssAdapter(LlamaAdapter):
    """Every tensor whole under its own name; the experts' may be packed."""

    @classmethod
    def config_fields(cls, config: type[Any], raw: dict[str, Any]) -> dict[str, Any]:
        read_hf_experts(raw)
        if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
            raw["rope_scaling"] = {k: v for k, v in DEFAULT_ROPE.items() if k != "rope_theta"}
        raw.setdefault("rope_theta", DEFAULT_ROPE["rope_theta"])  # GptOssConfig.default_theta
        raw["rope_parameters"] = {"rope_theta": raw["rope_theta"], **rope_parameters_of(raw)}
        if raw.get("layer_types") is not None:
            raw["attention_layers"] = tuple(raw["layer_types"])
        dropout = raw.get("attention_dropout")
        if dropout not in (0, None):
            raise ConfigError(f"attention_dropout={dropout!r} is not supported (no dropout); set it to 0.0")
        return cls.own_fields(config, raw)

    def to_hf(self) -> dict[str, Any]:
        cfg = self.cfg
        out = {"architectures": [cfg.architecture], "model_type": cfg.model_type, **dataclasses.asdict(cfg),
               "rope_parameters": cfg.rope, "layer_types": list(cfg.attention_layers),
               "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0}
        del out["attention_layers"], out["mlp_bias"]
        return out

    def packed(self, key: str) -> tuple[str, str] | None:
        prefix, _, name = key.rpartition(".mlp.experts.")
        if not prefix or name not in ("gate_up_proj", "down_proj"):
            return None
        return f"{key}_blocks", f"{key}_scales"
