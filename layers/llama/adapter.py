"""How transformers names the Llama family's models (torch-free): their config.json read and written, their
checkpoint's keys ('model.layers.3.'). The Llama-shaped families' adapters (phi3, gemma3, the mixtures, gpt-oss)
build on it."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from layers.adapter import StateDictAdapter
from layers.config import ConfigError


def rope_parameters_of(raw: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' `rope_parameters`, or the older `rope_theta` and `rope_scaling` (`type` for `rope_type`)
    that published Llama, Mistral and Qwen configs carry, as one dict."""
    if "rope_parameters" in raw and raw["rope_parameters"] is not None:
        params = dict(raw["rope_parameters"])
    else:
        scaling = dict(raw.get("rope_scaling") or {})
        if "type" in scaling:
            scaling.setdefault("rope_type", scaling.pop("type"))
        params = {"rope_theta": raw.get("rope_theta", 10000.0), "rope_type": "default", **scaling}
    params.setdefault("rope_type", "default")
    return params


class LlamaAdapter(StateDictAdapter):
    """llama, mistral, qwen2, qwen3 and olmo2: the config's class attributes say which of transformers' optional
    fields its class reads (`honoured_flags`, `slides`, `switched_window`)."""

    body: ClassVar[str] = "model."
    blocks: ClassVar[str] = "layers"
    final_norm: ClassVar[str] = "norm"
    required: ClassVar[tuple[str, ...]] = (*StateDictAdapter.required, "intermediate_size")

    @classmethod
    def config_fields(cls, config: type[Any], raw: dict[str, Any]) -> dict[str, Any]:
        dropout = raw.get("attention_dropout")
        if dropout not in (0, None):
            raise ConfigError(f"attention_dropout={dropout!r} is not supported (no dropout); set it to 0.0")
        raw["rope_parameters"] = rope_parameters_of(raw)
        raw["sliding_window"] = cls._window(config, raw)
        # Fields that transformers' class for this model_type never reads change nothing there: nor here.
        unread = {*(() if config.slides else ("sliding_window",)),
                  *(flag for flag in ("attention_bias", "mlp_bias") if flag not in config.honoured_flags)}
        return {k: v for k, v in cls.own_fields(config, raw).items() if k not in unread}

    @staticmethod
    def _window(config: type[Any], raw: Mapping[str, Any]) -> Any:
        """The sliding window transformers' model applies on every layer, None for none. Where use_sliding_window
        switches it (qwen2, qwen3), it slides on the layers layer_types names, else on those from
        max_window_layers on; a window on some layers only is refused (one window is what this model and its
        export hold)."""
        window = raw.get("sliding_window")
        if not config.switched_window or window is None:
            return window
        if raw.get("use_sliding_window") is not True:
            return None
        kinds, layers, full = raw.get("layer_types"), raw.get("num_hidden_layers"), raw.get("max_window_layers")
        if isinstance(kinds, list):
            sliding, total, which = kinds.count("sliding_attention"), len(kinds), "layer_types"
        elif isinstance(layers, int) and isinstance(full, int):
            sliding, total, which = min(max(layers - full, 0), layers), layers, f"max_window_layers={full}"
        else:
            return window  # the sizes' own checks name what is wrong
        if 0 < sliding < total:
            raise ConfigError(f"use_sliding_window=true with {which} slides {sliding} of {total} layers: a window "
                              "on some layers only is not supported; set use_sliding_window to false (the same "
                              f"model on sequences up to sliding_window={window})")
        return window if sliding else None

    def to_hf(self) -> dict[str, Any]:
        cfg = self.cfg
        out = {"architectures": [cfg.architecture], "model_type": cfg.model_type,
               **dataclasses.asdict(cfg), "rope_parameters": cfg.rope,
               "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0}
        for flag in ("attention_bias", "mlp_bias"):
            if flag not in cfg.honoured_flags:
                del out[flag]
        if not cfg.slides:
            del out["sliding_window"]
        elif cfg.switched_window:  # the window on every layer
            out.update(use_sliding_window=cfg.sliding_window is not None, max_window_layers=0)
        return out


class MistralAdapter(LlamaAdapter):
    defaults: ClassVar[dict[str, Any]] = {"num_key_value_heads": 8, "max_position_embeddings": 131072,
                                          "sliding_window": 4096}


class Qwen2Adapter(LlamaAdapter):
    defaults: ClassVar[dict[str, Any]] = {"num_key_value_heads": 32, "max_position_embeddings": 32768,
                                          "sliding_window": 4096, "max_window_layers": 28}


class Qwen3Adapter(LlamaAdapter):
    defaults: ClassVar[dict[str, Any]] = {**Qwen2Adapter.defaults, "head_dim": 128}
