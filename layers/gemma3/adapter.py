"""How transformers names Gemma 3's text decoder (torch-free): Llama's checkpoint keys; its config.json's layer
types and RoPE per layer type, in transformers' current form or an older one."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from layers.config import ConfigError
from layers.llama.adapter import LlamaAdapter

LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' RoPE bases where a config names none: rope_theta for global layers, rope_local_base_freq for
# sliding ones (Gemma3TextConfig.default_theta).
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def pattern_layers(layers: int, pattern: int) -> tuple[str, ...]:
    """transformers' layer_types from an older config's sliding_window_pattern: every pattern-th layer global."""
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))


def rope_per_layer_type(raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The RoPE of each layer type as Gemma3TextConfig reads a config.json: its nested `rope_parameters`, or the
    older `rope_theta` and `rope_scaling` (global layers) and `rope_local_base_freq` (sliding layers). As
    transformers does, `rope_scaling` updates the global layers' {"rope_type": "default"}."""
    given = raw.get("rope_parameters")
    if given is not None and not (isinstance(given, Mapping) and set(given) <= set(LAYER_TYPES)):
        raise ConfigError("rope_parameters must map full_attention and sliding_attention to their RoPE "
                          f"(transformers' gemma3_text form), got {given!r}")
    rope = {kind: dict((given or {}).get(kind) or {"rope_type": "default"}) for kind in LAYER_TYPES}
    rope["full_attention"].update(raw.get("rope_scaling") or {})
    rope["full_attention"].setdefault("rope_theta", raw.get("rope_theta", DEFAULT_THETA["full_attention"]))
    rope["sliding_attention"].setdefault("rope_theta",
                                         raw.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"]))
    for params in rope.values():
        params.setdefault("rope_type", params.pop("type", "default"))
    return rope


class Gemma3Adapter(LlamaAdapter):
    @classmethod
    def config_fields(cls, config: type[Any], raw: dict[str, Any]) -> dict[str, Any]:
        for name, fine in (("attention_dropout", (0, None)), ("use_bidirectional_attention", (False, None))):
            if raw.get(name) not in fine:
                raise ConfigError(f"{name}={raw[name]!r} is not supported; set it to {fine[0]!r}")
        raw["rope_parameters"] = tuple((kind, tuple(sorted(params.items())))
                                       for kind, params in rope_per_layer_type(raw).items())
        layers = raw.get("num_hidden_layers")
        if raw.get("layer_types") is not None:
            raw["attention_layers"] = tuple(raw["layer_types"])
        elif isinstance(layers, int) and layers > 0:
            pattern = raw.get("sliding_window_pattern", 6)
            if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
                raise ConfigError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
            raw["attention_layers"] = pattern_layers(layers, pattern)
        return cls.own_fields(config, raw)

    def to_hf(self) -> dict[str, Any]:
        cfg = self.cfg
        out = {"architectures": ["Gemma3ForCausalLM"], "model_type": cfg.model_type, **dataclasses.asdict(cfg),
               "rope_parameters": {kind: dict(params) for kind, params in cfg.rope_parameters},
               "layer_types": list(cfg.attention_layers), "initializer_range": 0.02, "use_cache": True,
               "attention_dropout": 0.0}
        del out["attention_layers"]
        return out
