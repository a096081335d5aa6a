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

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from layers.config import PRESETS, ConfigError, FrozenBlockSaves
from layers.gemma3.config import LAYER_TYPES, deepened
from layers.llama.config import LlamaConfig, rope_parameters_of
from layers.moe.config import MixtureOfExperts

# transformers' RoPE where a config names none (GptOssConfig's): YaRN, 32 times the original 4096 positions.
DEFAULT_ROPE: dict[str, Any] = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}


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


@dataclass(frozen=True)
class GptOssConfig(MixtureOfExperts, LlamaConfig):
    model_type: ClassVar[str] = "gpt_oss"
    architecture: ClassVar[str] = "GptOssForCausalLM"
    honoured_flags: ClassVar[tuple[str, ...]] = ("attention_bias",)
    slides: ClassVar[bool] = True
    attention_sinks: ClassVar[bool] = True
    # LoRA targets attention's projections alone, and the experts load whole (`experts()`): the experts' tensors,
    # input dimension first and with biases, are neither PEFT-style targets here nor carried by expert groups.
    projections: ClassVar[dict[str, str]] = {
        "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
        "o_proj": "self_attn.o_proj"}
    lora_parameters: ClassVar[tuple[str, ...]] = ()

    # transformers' defaults (GptOssConfig's: gpt-oss-120b's sizes), so no hf_defaults
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
        super().__post_init__()
        self.check_experts()
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

    # --- the common vocabulary ------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    @property
    def norm_topk_prob(self) -> bool:
        return True  # the softmax is over the chosen experts' logits

    @property
    def expert_width(self) -> int:
        return self.intermediate_size

    def layer_types(self) -> tuple[str, ...]:
        return self.attention_layers

    def attention_window(self, layer_type: str) -> int | None:
        return self.sliding_window if layer_type == "sliding_attention" else None

    def rotary_table(self, layer_type: str) -> Any:
        return self.rope_parameters

    def context(self) -> tuple[int, str]:
        return self.max_position_embeddings, f"max_position_embeddings={self.max_position_embeddings}"

    def experts(self) -> int:
        return 0

    # --- parameters -------------------------------------------------------------------------------
    def block_params(self) -> int:
        return super().block_params() + self.num_attention_heads  # and each head's sink

    def mlp_params(self) -> int:
        d, f, experts = self.hidden_size, self.expert_width, self.num_experts
        # the router and its bias; each expert's gate/up and down projections and their biases
        return experts * (d + 1) + experts * (3 * d * f + 2 * f + d)

    # --- what memory_model needs, measured (tests/test_planner.py) ----------------------------------------
    def block_saved_per_token(self, es: int) -> int:
        d, q = self.hidden_size, self.attention_width
        # Each RMSNorm: its fp32 input, rstd and fp32 normalised values (the weight multiplies in fp32), and its
        # output cast back (the next matmuls' input). Attention: rotated q, k and v repeated to every query head,
        # and its output (o_proj's input); its probabilities are per key (memory_model.shapes).
        return 2 * (8 * d + 4 + es * d) + 4 * es * q + self.mlp_saved_per_token(es)

    def mlp_saved_per_token(self, es: int) -> int:
        d, f, k = self.hidden_size, self.expert_width, self.num_experts_per_tok
        # The top-k's int64 indices and the softmax over them. Per routed token: its gathers' int64 indices (its
        # token's row, each projection's bias, its place back in (token, choice) order), its input row (the
        # gate/up matmul's), the gate/up output (the clamps' input), sigmoid's output, the clamped gate, up + 1,
        # the gated product and their product (down's input): 2f + 5f; its output and routing weight.
        return 8 * k + es * k + k * (32 + es * (2 * d + 7 * f))

    def block_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        d, k, experts = self.hidden_size, self.num_experts_per_tok, self.num_experts
        weighting, product, gate_up = super().block_backward_peaks(es)
        # The clamped SwiGLU's backward, as the other mixtures' SwiGLU's, but for the down bias's gather index
        # also gone, the routing weights' gradient made, and down's bias gradient with its weight's.
        per_token, params, fixed = product
        return weighting, (per_token - 8 * k + es * k, params + experts * d, fixed), gate_up

    def scores_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        d, q, kv = self.hidden_size, self.attention_width, self.num_key_value_heads * self.head_dim
        # The softmax's backward: besides its two gradients, v's at every query head and the residual's; the MLP's
        # saved tensors, the post-attention norm's, o_proj's input, v repeated to every head and the incoming
        # gradient w.r.t. attention's output gone; every weight gradient but q/k/v_proj's, the sinks' and the
        # first norm's made.
        attention_in = d * q + q + 2 * (d * kv + kv) + self.num_attention_heads + d
        return ((-(self.mlp_saved_per_token(es) + 8 * d + 4 + es * q), self.block_params() - attention_in, 0),)

    def head_saved_per_token(self, es: int, frozen: bool = False) -> int:
        # The final RMSNorm: its fp32 input, rstd, the fp32 normalised values (for its weight's gradient only),
        # and its output cast back (lm_head's input)
        return 4 * self.hidden_size + 4 + (0 if frozen else 4 * self.hidden_size) + es * self.hidden_size

    def frozen_block_saves(self, es: int, targets: frozenset[str], plain: bool, grad_in: bool) -> FrozenBlockSaves:
        d, q = self.hidden_size, self.attention_width
        norm = 4 * d + 4  # a frozen RMSNorm: its fp32 input and rstd, where its input needs a gradient
        q_grad, k_grad = grad_in or "q_proj" in targets, grad_in or "k_proj" in targets
        scores = q_grad or k_grad  # the scores need a gradient: the mask and the rotary tables are saved
        attention = scores or grad_in or "v_proj" in targets  # its probabilities are saved
        saved = norm if grad_in else 0  # input_layernorm
        saved += d * es if plain and targets & {"q_proj", "k_proj", "v_proj"} else 0  # its output, the adapters'
        # Unlike SDPA, the scores' matmul keeps only what a gradient needs: q for k's, k repeated for q's; the
        # probabilities' keeps v repeated for theirs.
        saved += es * q * (int(k_grad) + int(q_grad) + int(scores))
        saved += es * q if plain and "o_proj" in targets else 0  # attention's output, o_proj's adapter input
        mlp_in = grad_in or attention or "o_proj" in targets  # the residual after attention needs a gradient
        saved += norm if mlp_in else 0  # post_attention_layernorm
        mlp, mlp_inputs = self.frozen_mlp_saves(es, targets, plain, mlp_in)
        inputs = {"q_proj": grad_in, "k_proj": grad_in, "v_proj": grad_in, "o_proj": attention, **mlp_inputs}
        return FrozenBlockSaves(saved + mlp, attention, scores, {t: inputs[t] for t in targets},
                                input_saved=grad_in and self.block_saves_input(es), scores=scores)

    def frozen_mlp_saves(self, es: int, targets: frozenset[str], plain: bool,
                         mlp_in: bool) -> tuple[int, dict[str, bool]]:
        d, f, k = self.hidden_size, self.expert_width, self.num_experts_per_tok
        if not mlp_in:
            return 0, {}
        # Frozen experts keep no matmul input and no bias index: per routed token its two other gathers'
        # indices, the gate/up output, the activation's four and its output (the routing weights' multiplier).
        return 8 * k + es * k + k * (16 + es * (6 * f + d)), {}

    # --- how transformers saves the experts ------------------------------------------------------
    def hf_saved_parts(self, key: str) -> list[list[str]] | None:
        return None  # fused, as it holds them (the published files hold them MXFP4-packed: `hf_packed`)

    def hf_packed(self, key: str) -> tuple[str, str] | None:
        prefix, _, name = key.rpartition(".mlp.experts.")
        if not prefix or name not in ("gate_up_proj", "down_proj"):
            return None
        return f"{key}_blocks", f"{key}_scales"

    # --- Hugging Face config.json ------------------------------------------------------------------
    @classmethod
    def from_hf_fields(cls, raw: dict[str, Any]) -> "GptOssConfig":
        cls.read_hf_experts(raw)
        if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
            raw["rope_scaling"] = {k: v for k, v in DEFAULT_ROPE.items() if k != "rope_theta"}
        raw.setdefault("rope_theta", DEFAULT_ROPE["rope_theta"])  # GptOssConfig.default_theta
        raw["rope_parameters"] = {"rope_theta": raw["rope_theta"], **rope_parameters_of(raw)}
        if raw.get("layer_types") is not None:
            raw["attention_layers"] = tuple(raw["layer_types"])
        dropout = raw.get("attention_dropout")
        if dropout not in (0, None):
            raise ConfigError(f"attention_dropout={dropout!r} is not supported (no dropout); set it to 0.0")
        return cls.from_dict(cls.own_fields(raw))

    def to_hf(self) -> dict[str, Any]:
        out = {"architectures": [self.architecture], "model_type": self.model_type, **dataclasses.asdict(self),
               "rope_parameters": self.rope, "layer_types": list(self.attention_layers),
               "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0}
        del out["attention_layers"], out["mlp_bias"]
        return out


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
