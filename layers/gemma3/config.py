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
    PRESETS, ConfigError, FrozenBlockSaves, ModelConfig, check_heads, check_pad_token_id, check_rms_norm_eps,
    family, positive_ints,
)
from layers.llama.config import LlamaConfig, checked_rope

LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' RoPE bases where a config names none: rope_theta for global layers, rope_local_base_freq for
# sliding ones (Gemma3TextConfig.default_theta).
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def pattern_layers(layers: int, pattern: int) -> tuple[str, ...]:
    """transformers' layer_types from an older config's sliding_window_pattern: every pattern-th layer global."""
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))


def deepened(cfg: Any, sizes: Mapping[str, int]) -> Any:
    """cfg (with `attention_layers`) at the depth `sizes` asks for, its layer types repeated from the first layer
    on: what `resized` builds on for a family whose layers alternate."""
    layers = sizes.get("num_hidden_layers", cfg.num_hidden_layers)
    kinds = tuple(cfg.attention_layers[i % cfg.num_hidden_layers] for i in range(layers))
    return dataclasses.replace(cfg, num_hidden_layers=layers, attention_layers=kinds)


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


@family
@dataclass(frozen=True)
class Gemma3TextConfig(ModelConfig):
    model_type: ClassVar[str] = "gemma3_text"
    # Llama's checkpoint layout and projection names
    hf_body: ClassVar[str] = LlamaConfig.hf_body
    hf_blocks: ClassVar[str] = LlamaConfig.hf_blocks
    hf_final_norm: ClassVar[str] = LlamaConfig.hf_final_norm
    projections: ClassVar[dict[str, str]] = LlamaConfig.projections
    hf_required: ClassVar[tuple[str, ...]] = (*ModelConfig.hf_required, "intermediate_size")

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
    # transformers' layer_types (a method of every config reads it: layer_types()); None: every 6th global.
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
        self.check_size()

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

    def layer_types(self) -> tuple[str, ...]:
        return self.attention_layers

    def attention_window(self, layer_type: str) -> int | None:
        return self.sliding_window if layer_type == "sliding_attention" else None

    def rope(self, layer_type: str) -> tuple[tuple[str, Any], ...]:
        return dict(self.rope_parameters)[layer_type]

    def rotary_table(self, layer_type: str) -> Any:
        return self.rope(layer_type)

    # --- parameters -------------------------------------------------------------------------------
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def block_params(self) -> int:
        d, f, q, kv = self.hidden_size, self.intermediate_size, self.attention_width, self._kv_width
        attention = 2 * d * q + 2 * d * kv + ((q + 2 * kv + d) if self.attention_bias else 0)
        return 4 * d + attention + 2 * self.head_dim + 3 * d * f  # four norms, q/k norms, GeGLU

    def head_params(self) -> int:
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    def borrowed(self, unit: str) -> dict[str, tuple[str, str]]:
        tied = unit == "head" and self.tie_word_embeddings
        return {"lm_head.weight": ("embed", "embed_tokens.weight")} if tied else {}

    @property
    def _kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def projection_shape(self, name: str) -> tuple[int, int]:
        d, q, kv, f = self.hidden_size, self.attention_width, self._kv_width, self.intermediate_size
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, f),
                "up_proj": (d, f), "down_proj": (f, d)}[name]

    # --- what memory_model needs, measured (tests/test_planner.py) ----------------------------------------
    def block_matmul_params(self) -> int:
        d = self.hidden_size
        return 2 * d * (self.attention_width + self._kv_width) + 3 * d * self.intermediate_size

    def block_saved_per_token(self, es: int) -> int:
        d, q, kv, f = self.hidden_size, self.attention_width, self._kv_width, self.intermediate_size
        # Each norm over w features keeps, all in fp32: its input, rstd and the normalised values (the weight's
        # multiplier); its output is the next op's input, saved by that op.
        def norm(w: int, rows: int = 1) -> int:
            return 8 * w + 4 * rows

        saved = 4 * norm(d) + 2 * es * d  # the four norms; the outputs of those before attention and the MLP
        saved += norm(q, self.num_attention_heads) + norm(kv, self.num_key_value_heads)  # q/k norms, then RoPE
        saved += 4 * es * q  # rotated q, k and v repeated to every query head (SDPA's inputs), its output
        return saved + 4 * es * f  # gate, gelu(gate), up, and their product (down_proj's input)

    def block_saved_fixed(self, es: int) -> int:
        return 4 * (4 * self.hidden_size + 2 * self.head_dim)  # each norm's fp32 1 + weight

    def block_saves_input(self, es: int) -> bool:
        return es == 4  # the first norm saves its fp32 input: in fp32 the input itself, else a copy

    def block_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        d, q, f = self.hidden_size, self.attention_width, self.intermediate_size
        # Measured (tests/test_backward_transient.py). As the backward goes, a norm's saved tensors go (8d + 4
        # per token, its 1 + weight 4d bytes) and its weight's gradient comes. (1) The last norm's fp32
        # backward: four (N, d) fp32 tensors. (2) The MLP's product's backward: the gradients w.r.t. gelu(gate)
        # and up, with down_proj's gradient; the last norm's tensors gone. (3) SDPA's backward: the gradient
        # w.r.t. its output and those w.r.t. q, k and v at every query head; the MLP's and three norms'
        # tensors gone, o_proj's and the MLP's gradients made.
        o_proj = q * d + (d if self.attention_bias else 0)
        return ((16 * d - 4, d, -4 * d),
                (2 * es * f - 8 * d - 4, d * f + d, -4 * d),
                (4 * es * q - 24 * d - 4 * es * f - 12, o_proj + 3 * d * f + 3 * d, -12 * d))

    def head_saved_per_token(self, es: int, frozen: bool = False) -> int:
        # The final norm's fp32 input and rstd, its normalised values (only for its weight's gradient), and its
        # output (the chunked loss's input).
        return 4 * self.hidden_size + 4 + (0 if frozen else 4 * self.hidden_size) + es * self.hidden_size

    def head_saved_fixed(self) -> int:
        return 4 * self.hidden_size  # the final norm's fp32 1 + weight

    def frozen_block_saves(self, es: int, targets: frozenset[str], plain: bool, grad_in: bool) -> FrozenBlockSaves:
        d, q, kv, f, D = self.hidden_size, self.attention_width, self._kv_width, self.intermediate_size, self.head_dim
        # A frozen norm keeps only its fp32 input, rstd and 1 + weight, and only where its input needs a gradient.
        q_grad, k_grad = grad_in or "q_proj" in targets, grad_in or "k_proj" in targets
        attention = q_grad or k_grad or grad_in or "v_proj" in targets
        o_out = attention or "o_proj" in targets  # o_proj's output, the post-attention norm's input
        mlp_in = grad_in or o_out  # the residual after attention, the pre-MLP norm's input
        gate, up = mlp_in or "gate_proj" in targets, mlp_in or "up_proj" in targets
        down_out = gate or up or "down_proj" in targets  # the post-MLP norm's input
        # (width, whether its input needs a gradient) of each norm: the block's four, then q's and k's
        normed = [(d, grad_in), (d, o_out), (d, mlp_in), (d, down_out), (D, q_grad), (D, k_grad)]
        saved = sum(4 * d + 4 for width, needs in normed[:4] if needs)
        saved += (4 * q + 4 * self.num_attention_heads if q_grad else 0)
        saved += (4 * kv + 4 * self.num_key_value_heads if k_grad else 0)
        saved += d * es if plain and targets & {"q_proj", "k_proj", "v_proj"} else 0  # its output, the adapters'
        saved += 4 * q * es if attention else 0  # rotated q, k and v repeated to every query head, the output
        saved += q * es if not attention and plain and "o_proj" in targets else 0  # o_proj's adapter input
        saved += d * es if plain and targets & {"gate_proj", "up_proj"} else 0  # the pre-MLP norm's output
        saved += 2 * f * es if gate else 0  # gelu's input and, for gelu(gate)'s gradient, up
        saved += f * es if up else 0  # gelu(gate), for up's gradient
        saved += f * es if plain and "down_proj" in targets else 0  # the product, down_proj's adapter input
        inputs = {"q_proj": grad_in, "k_proj": grad_in, "v_proj": grad_in, "o_proj": attention,
                  "gate_proj": mlp_in, "up_proj": mlp_in, "down_proj": gate or up}
        fixed = sum(4 * width for width, needs in normed if needs)
        return FrozenBlockSaves(saved, attention, q_grad or k_grad, {t: inputs[t] for t in targets},
                                input_saved=grad_in and self.block_saves_input(es), fixed=fixed)

    # --- Hugging Face config.json ------------------------------------------------------------------
    @classmethod
    def from_hf_fields(cls, raw: dict[str, Any]) -> "Gemma3TextConfig":
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
        return cls.from_dict(cls.own_fields(raw))

    def to_hf(self) -> dict[str, Any]:
        out = {"architectures": ["Gemma3ForCausalLM"], "model_type": self.model_type, **dataclasses.asdict(self),
               "rope_parameters": {kind: dict(params) for kind, params in self.rope_parameters},
               "layer_types": list(self.attention_layers), "initializer_range": 0.02, "use_cache": True,
               "attention_dropout": 0.0}
        del out["attention_layers"]
        return out


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
