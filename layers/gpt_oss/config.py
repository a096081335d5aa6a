"""OpenAI's gpt-oss (`gpt_oss`, transformers' GptOssForCausalLM), torch-free, transformers' field names. Its units
are in layers/gpt_oss/units.py.

A Llama-family block (RMSNorm, grouped-query attention, rotate-half RoPE) with:
- attention with q/k/v/o biases and a learned logit per head, its *sink*, that joins each query's softmax
  denominator (the sink takes a share of the weight and gives back no value); sliding-window (128) and full
  layers in turn (`layer_types`); YaRN RoPE;
- a sparse MLP of `num_local_experts` experts: the router (`mlp.router`, a linear map with a bias) takes each
  token's top-k logits and their softmax (over the k chosen alone) are the weights; each expert is a clamped
  SwiGLU with biases, out = down((clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)), g = clamp(gate, max=limit),
  its gate and up interleaved in one tensor (`gate_up_proj` (E, d, 2f): gate the even columns, up the odd).
The experts are transformers' tensors as it holds them, input dimension first (`gate_up_proj` (E, d, 2f),
`down_proj` (E, f, d)), the transpose of the other mixtures'.

Not registered (`@family`) yet: of everything tests/test_families.py holds a registered family to, it misses
the streamed-training bound (tests/test_gpt_oss.py says by how much), and tests/test_gpt_oss.py holds it to the
rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from layers.config import PRESETS, ConfigError, SparseMlp
from layers.gemma3.config import LAYER_TYPES, deepened
from layers.attention import SlidingLayers
from layers.llama.config import LlamaConfig, LlamaParams
from layers.moe.config import holds
from layers.gpt_oss.adapter import DEFAULT_ROPE, GptOssAdapter
from layers.gpt_oss.costs import GptOssCosts, GptOssExpertsCosts
from layers.gpt_oss.targets import GptOssTargets


def checked_yarn(rope: Any) -> tuple[tuple[str, Any], ...]:
    """transformers' YaRN rope_parameters (a dict, or our sorted items) validated, as sorted items."""
    params = dict(rope.items() if isinstance(rope, dict) else rope)
    if params.get("rope_type") != "yarn":
        raise ConfigError(f"rope_type {params.get('rope_type')!r} is not supported for gpt_oss; it uses 'yarn'")
    for key in ("rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                "attention_factor", "mscale", "mscale_all_dim"):
        value = params.get(key)
        required = key in ("rope_theta", "factor", "original_max_position_embeddings")
        if (value is not None or required) and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                                or value <= 0):
            raise ConfigError(f"rope_parameters[{key!r}] must be a positive number for YaRN, got {value!r}")
    if not isinstance(params.get("truncate", True), bool):
        raise ConfigError(f"rope_parameters['truncate'] must be true or false, got {params['truncate']!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"partial_rotary_factor={params['partial_rotary_factor']!r} is not supported (RoPE over "
                          "whole heads); remove it")
    return tuple(sorted(params.items()))


def alternating_layers(layers: int) -> tuple[str, ...]:
    """transformers' layer_types where a config names none: sliding, full, sliding, … ."""
    return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))


class GptOssParams(LlamaParams):
    def block(self) -> int:
        return super().block() + self.cfg.num_attention_heads  # and each head's sink

    def mlp(self) -> int:
        d, f, experts = self.cfg.hidden_size, self.cfg.intermediate_size, self.cfg.num_local_experts
        # the router and its bias; each expert's gate/up and down projections and their biases
        return experts * (d + 1) + experts * (3 * d * f + 2 * f + d)


class GptOssAttention(SlidingLayers):
    """One RoPE table for every layer type; the context is max_position_embeddings whatever the window."""

    def rotary_table(self, layer_type: str) -> Any:
        return self.cfg.rope_parameters


@dataclass(frozen=True)
class GptOssConfig(LlamaConfig):
    costs_class = GptOssCosts
    params_class = GptOssParams
    attention_class = GptOssAttention
    mlp_costs = GptOssExpertsCosts
    adapter_class = GptOssAdapter  # the experts fused, as transformers holds them; published files pack them
    model_type: ClassVar[str] = "gpt_oss"
    architecture: ClassVar[str] = "GptOssForCausalLM"
    honoured_flags: ClassVar[tuple[str, ...]] = ("attention_bias",)
    slides: ClassVar[bool] = True
    attention_sinks: ClassVar[bool] = True
    lora_class = GptOssTargets  # attention's projections alone

    # transformers' defaults (GptOssConfig's: gpt-oss-120b's sizes), so no adapter defaults
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880  # each expert's width
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_parameters: Any = tuple(sorted(DEFAULT_ROPE.items()))
    attention_bias: bool = True
    sliding_window: int | None = 128
    # transformers' layer_types; None: sliding and full in turn, sliding first.
    attention_layers: tuple[str, ...] = None  # type: ignore[assignment]  # None until __post_init__ resolves it
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        if self.attention_layers is None and isinstance(self.num_hidden_layers, int):
            object.__setattr__(self, "attention_layers", alternating_layers(self.num_hidden_layers))
        # Its router's softmax is over the chosen experts' logits; its experts load whole: their tensors, input
        # dimension first and with biases, are not carried by expert groups.
        holds(self, SparseMlp(self.num_local_experts, self.num_experts_per_tok, self.intermediate_size, True,
                              self.output_router_logits, self.router_aux_loss_coef, grouped=False))
        super().__post_init__()
        object.__setattr__(self, "attention_layers", tuple(self.attention_layers))
        if len(self.attention_layers) != self.num_hidden_layers or not set(self.attention_layers) <= set(LAYER_TYPES):
            raise ConfigError(f"layer_types must name {self.num_hidden_layers} layers (num_hidden_layers), each "
                              f"{' or '.join(LAYER_TYPES)}; got {list(self.attention_layers)}")
        if "sliding_attention" in self.attention_layers and self.sliding_window is None:
            raise ConfigError("layer_types names sliding_attention layers but sliding_window is null; set it")
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.output_router_logits:
            raise ConfigError("output_router_logits=true is not supported for gpt_oss (no load-balancing loss over "
                              "its routing yet); set it to false")

    def _check_rope(self) -> None:
        object.__setattr__(self, "rope_parameters", checked_yarn(self.rope_parameters))

    @classmethod
    def example(cls) -> "GptOssConfig":
        """Four experts, two per token; sliding and full layers in turn, the window (6) shorter than the tests'
        sequences; YaRN over 8 original positions, truncated; grouped-query attention, a head_dim apart from
        hidden_size's share, and a padding token."""
        rope = {**DEFAULT_ROPE, "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                "truncate": True}
        return cls(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=32, rope_parameters=rope,
                   sliding_window=6, num_local_experts=4, num_experts_per_tok=2, pad_token_id=1)

    def resized(self, **sizes: int) -> "GptOssConfig":
        """ModelConfig.resized; another depth repeats the layer types from the first layer on."""
        return LlamaConfig.resized(deepened(self, sizes), **sizes)


def _gpt_oss(layers: int, experts: int) -> GptOssConfig:
    """A published gpt-oss (its config.json): d 2880, 64 query heads on 8 key/value heads of 64, experts 2880
    wide, 4 per token, YaRN (theta 150000, 32 x 4096 positions, not truncated), the window 128 on every other
    layer, padding token 199999."""
    return GptOssConfig(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, num_local_experts=experts, num_experts_per_tok=4, pad_token_id=199999)


PRESETS.update({
    # openai/gpt-oss-20b's and openai/gpt-oss-120b's config.json; tests/test_gpt_oss.py checks transformers'
    # parameter counts.
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
})
