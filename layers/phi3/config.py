"""The Phi-3 family's configuration (torch-free), transformers' `phi3` (Phi-3 mini/medium, Phi-3.5, Phi-4): Llama's
block with q, k and v in one projection (`qkv_proj`, q's rows then k's then v's) and the gate and up projections
in one (`gate_up_proj`, the gate's rows first), as transformers holds and stores them. Its RoPE is the default one
or `longrope` (layers/rotary.py), over the first `partial_rotary_factor` of each head (Phi-4-mini: 0.75). The
embedding's `pad_token_id` row gets no gradient, as in transformers' nn.Embedding(padding_idx). Its units are in
layers/phi3/units.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from layers.config import PRESETS, ConfigError, family, positive_ints
from layers.llama.config import TINY, LlamaAttention, LlamaConfig
from layers.phi3.adapter import Phi3Adapter
from layers.phi3.costs import Phi3Costs
from layers.phi3.targets import Phi3Targets

# What each rope_type transformers' Phi-3 accepts needs besides rope_theta: longrope's factors per frequency.
ROPE_TYPES: dict[str, tuple[str, ...]] = {"default": (), "longrope": ("short_factor", "long_factor")}


class Phi3Attention(LlamaAttention):
    def regime_change(self) -> int | None:
        cfg = self.cfg
        return cfg.original_max_position_embeddings if cfg.rope["rope_type"] == "longrope" else None


@family
@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    attention_class = Phi3Attention
    costs_class = Phi3Costs
    adapter_class = Phi3Adapter
    model_type: ClassVar[str] = "phi3"
    architecture: ClassVar[str] = "Phi3ForCausalLM"
    lora_class = Phi3Targets
    honoured_flags: ClassVar[tuple[str, ...]] = ()
    slides: ClassVar[bool] = True

    # The context the model was pretrained on: longrope's short factors up to it, its long factors past it.
    original_max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        positive_ints(self, "original_max_position_embeddings")

    def _check_rope(self) -> None:
        params = dict(self.rope_parameters.items() if isinstance(self.rope_parameters, Mapping)
                      else self.rope_parameters)
        kind = params.setdefault("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ConfigError(f"rope_type {kind!r} is not supported for phi3; supported: {', '.join(ROPE_TYPES)}")
        for key in ("rope_theta", "partial_rotary_factor", "factor", "attention_factor"):
            value = params.get(key, 1.0)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"rope_parameters[{key!r}] must be a positive number, got {value!r}")
        partial = params.setdefault("partial_rotary_factor", 1.0)
        if not 0 < partial <= 1 or int(self.head_dim * partial) % 2:
            raise ConfigError(f"partial_rotary_factor={partial!r} must rotate an even number of each head's "
                              f"{self.head_dim} dims")
        rotary_dim = int(self.head_dim * partial)
        for key in ROPE_TYPES[kind]:
            value = params.get(key)
            if not isinstance(value, (list, tuple)) or len(value) != rotary_dim // 2 or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value):
                raise ConfigError(f"rope_parameters[{key!r}] must be {rotary_dim // 2} positive numbers for "
                                  f"longrope, got {value!r}")
            params[key] = tuple(value)
        if kind == "longrope":  # transformers' Phi-3 puts its own field there, whatever the dict says
            params["original_max_position_embeddings"] = self.original_max_position_embeddings
        object.__setattr__(self, "rope_parameters", tuple(sorted(params.items())))

    @classmethod
    def example(cls) -> "Phi3Config":
        """Grouped-query attention, longrope with a pretrained context of 16 (the tests' sequences of 24 take
        the long factors, of 16 the short ones), half of each head rotated, and a padding row."""
        rotary_half = TINY["hidden_size"] // TINY["num_attention_heads"] // 4
        return cls(**TINY, original_max_position_embeddings=16, pad_token_id=1, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.25 * i for i in range(rotary_half)],
            "long_factor": [2.0 + 3.0 * i for i in range(rotary_half)]})

    # --- the common vocabulary ------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope["partial_rotary_factor"])

    @property
    def rope(self) -> dict[str, Any]:
        """transformers' rope_parameters, its factors as lists (transformers' validation asks for lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_parameters}


PRESETS.update({
    # The published shapes (tests/hub_configs/phi-4.json, phi-3-mini-4k-instruct.json); tests/test_phi3.py checks
    # the parameter counts against transformers'.
    "phi-4": Phi3Config(vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=10, max_position_embeddings=16384,
                        original_max_position_embeddings=16384, rms_norm_eps=1e-5, pad_token_id=100257,
                        rope_parameters={"rope_theta": 250000.0, "rope_type": "default"}),
    "phi-3-mini-4k": Phi3Config(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                                original_max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=32000,
                                sliding_window=2047, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
})
