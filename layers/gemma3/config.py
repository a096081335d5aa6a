"""Gemma 3's text decoder (`gemma3_text`, transformers' Gemma3ForCausalLM), torch-free, transformers' field
names. Llama's attention and rotate-half RoPE with: the embedding scaled by sqrt(hidden_size); RMSNorm about
1 + weight, before and after both attention and the MLP, and on each head of q and k; GeGLU (gelu with tanh);
scores scaled by query_pre_attn_scalar^-1/2; sliding-window layers between global ones (`layer_types`), each kind
with its own RoPE; tied embeddings. Its units are in layers/gemma3/units.py."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from layers.config import (
    PRESETS, ConfigError, ModelConfig, check_heads, check_size, check_pad_token_id, check_rms_norm_eps,
    family, positive_ints,
)
from layers.attention import SlidingLayers
from layers.llama.config import LlamaParams, checked_rope
from layers.gemma3.adapter import LAYER_TYPES, Gemma3Adapter, pattern_layers, rope_per_layer_type
from layers.gemma3.costs import Gemma3Costs
from layers.llama.targets import LlamaTargets


def deepened(cfg: Any, sizes: Mapping[str, int]) -> Any:
    """cfg (with `attention_layers`) at the depth `sizes` asks for, its layer types repeated from the first layer
    on: what `resized` builds on for a family whose layers alternate."""
    layers = sizes.get("num_hidden_layers", cfg.num_hidden_layers)
    kinds = tuple(cfg.attention_layers[i % cfg.num_hidden_layers] for i in range(layers))
    return dataclasses.replace(cfg, num_hidden_layers=layers, attention_layers=kinds)


class Gemma3Params(LlamaParams):
    """Llama's embedding and head (tied by default); a block of four norms, q/k norms and GeGLU."""

    def block(self) -> int:
        cfg = self.cfg
        d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.attention_width, cfg.kv_width
        attention = 2 * d * q + 2 * d * kv + ((q + 2 * kv + d) if cfg.attention_bias else 0)
        return 4 * d + attention + 2 * cfg.head_dim + 3 * d * f  # four norms, q/k norms, GeGLU


class Gemma3Attention(SlidingLayers):
    """Each layer type with its own RoPE table."""

    def rotary_table(self, layer_type: str) -> Any:
        return self.cfg.rope(layer_type)


@family
@dataclass(frozen=True)
class Gemma3TextConfig(ModelConfig):
    costs_class = Gemma3Costs
    params_class = Gemma3Params
    attention_class = Gemma3Attention
    model_type: ClassVar[str] = "gemma3_text"
    adapter_class = Gemma3Adapter  # Llama's checkpoint layout
    lora_class = LlamaTargets  # Llama's projections

    # transformers' defaults (Gemma3TextConfig's)
    vocab_size: int = 262_208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 0  # the embedding row whose lookups give it no gradient (HF's padding_idx)
    tie_word_embeddings: bool = True
    # Per layer type, the sorted items of its RoPE parameters: ((layer type, ((key, value), ...)), ...).
    # None: transformers' defaults.
    rope_parameters: Any = None
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    # transformers' layer_types (its attention facet gives them: `layer_types()`); None: every 6th global.
    attention_layers: tuple[str, ...] = None  # type: ignore[assignment]  # None until __post_init__ resolves it
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        positive_ints(self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
        check_heads(self)
        if self.hidden_size % self.num_attention_heads:  # transformers' own check
            raise ConfigError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                              f"({self.num_attention_heads})")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ConfigError(f"hidden_activation {self.hidden_activation!r} is not supported; gemma3_text uses "
                              "'gelu_pytorch_tanh'")
        check_rms_norm_eps(self.rms_norm_eps)
        for flag in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        check_pad_token_id(self)
        scalar = self.query_pre_attn_scalar
        if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or scalar <= 0:
            raise ConfigError(f"query_pre_attn_scalar must be a positive number, got {scalar!r}")
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(self, cap) is not None:
                raise ConfigError(f"{cap}={getattr(self, cap)!r} is not supported (no soft-capping); set it to null")
        layers = pattern_layers(self.num_hidden_layers, 6) if self.attention_layers is None else self.attention_layers
        object.__setattr__(self, "attention_layers", tuple(layers))
        if len(self.attention_layers) != self.num_hidden_layers or not set(self.attention_layers) <= set(LAYER_TYPES):
            raise ConfigError(f"layer_types must name {self.num_hidden_layers} layers (num_hidden_layers), each "
                              f"{' or '.join(LAYER_TYPES)}; got {list(self.attention_layers)}")
        if "sliding_attention" in self.attention_layers:
            positive_ints(self, "sliding_window")
        rope = rope_per_layer_type({}) if self.rope_parameters is None else dict(self.rope_parameters)
        object.__setattr__(self, "rope_parameters", tuple(sorted(
            (kind, checked_rope(rope[kind], f"rope_parameters[{kind!r}]")) for kind in LAYER_TYPES)))
        check_size(self)

    @classmethod
    def example(cls) -> "Gemma3TextConfig":
        """Both layer types, a window (6) shorter than the tests' sequences, linear RoPE scaling on the global
        layer, a query_pre_attn_scalar apart from head_dim, a head_dim apart from hidden_size's share, grouped
        -query attention, attention biases and a tied head."""
        rope = rope_per_layer_type({"rope_scaling": {"rope_type": "linear", "factor": 8.0}})
        return cls(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=32, rope_parameters=rope,
                   attention_bias=True, query_pre_attn_scalar=24, sliding_window=6,
                   attention_layers=("sliding_attention", "full_attention", "sliding_attention"))

    def resized(self, **sizes: int) -> "Gemma3TextConfig":
        """ModelConfig.resized; another depth repeats the layer types from the first layer on."""
        return ModelConfig.resized(deepened(self, sizes), **sizes)

    # --- the common vocabulary ------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    def rope(self, layer_type: str) -> tuple[tuple[str, Any], ...]:
        return dict(self.rope_parameters)[layer_type]

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _gemma3(**sizes: Any) -> Gemma3TextConfig:
    """A published Gemma 3 text decoder: head_dim 256, every 6th layer global, RoPE bases 1e6 (global) and 1e4
    (sliding), query_pre_attn_scalar 256, tied embeddings."""
    scaling = sizes.pop("rope_scaling", None)
    rope = rope_per_layer_type({"rope_scaling": scaling})
    return Gemma3TextConfig(head_dim=256, query_pre_attn_scalar=256, rope_parameters=rope, **sizes)


PRESETS.update({
    # The text decoders of the published checkpoints (their config.json's text_config); tests/test_gemma3.py
    # checks the parameter counts transformers gives them.
    "gemma-3-1b": _gemma3(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                          num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32768,
                          sliding_window=512),
    "gemma-3-4b": _gemma3(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=131072,
                          sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "gemma-3-12b": _gemma3(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                           num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=131072,
                           sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0}),
})
