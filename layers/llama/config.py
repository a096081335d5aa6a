"""The Llama family's configurations (torch-free), transformers' field names: `llama`, and `mistral`, `qwen2`
and `qwen3` as small variations of it. RMSNorm, SwiGLU, grouped-query attention, rotate-half RoPE (with
`rope_parameters`: default, linear, dynamic, llama3). Its units are in layers/llama/units.py.

The variations are class attributes, so the units never ask which model_type they hold: `qkv_bias` (qwen2's
q/k/v biases), `qk_norm` (qwen3's RMSNorm on each head of q and k; `qk_norm_whole`: over the whole projections,
as olmoe's), and which of transformers' optional flags (`attention_bias`, `mlp_bias`) the family's transformers
class honours. The MLP is dense, or a sparse mixture of experts that the config holds as a facet (`sparse_mlp`,
layers/moe); its costs are a facet the config names (`mlp_costs`), composed into the block's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from layers.config import (
    PRESETS, ConfigError, ModelConfig, check_heads, check_size, check_pad_token_id, check_rms_norm_eps,
    family, positive_ints,
)
from layers.adapter import StateDictAdapter
from layers.attention import AttentionLayout
from layers.costs import Costs
from layers.llama.adapter import LlamaAdapter, MistralAdapter, Qwen2Adapter, Qwen3Adapter
from layers.llama.costs import LlamaCosts, MlpCosts, SwiGLUCosts
from layers.llama.targets import LlamaTargets
from layers.params import UnitParams
from layers.targets import LoraTargets

# The sizes of each model_type's `example()`: two layers, four query heads on two key/value heads.
TINY: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)

# What each rope_type needs besides rope_theta (transformers' modeling_rope_utils).
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def checked_rope(rope: Any, name: str = "rope_parameters") -> tuple[tuple[str, Any], ...]:
    """transformers' rope_parameters (a dict, or our sorted items) validated, as sorted items (hashable); `name`
    is where a message says the dict is."""
    params = dict(rope.items() if isinstance(rope, Mapping) else rope)
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    for key in ("rope_theta", *ROPE_TYPES[kind]):
        value = params.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name}[{key!r}] must be a positive number for rope_type {kind!r}, got {value!r}")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor={partial!r} is not supported (RoPE over whole heads); remove it")
    if kind == "llama3" and params["low_freq_factor"] >= params["high_freq_factor"]:
        raise ConfigError(f"{name}' low_freq_factor must be below high_freq_factor")
    return tuple(sorted(params.items()))


class LlamaParams(UnitParams):
    """The Llama family's parameters by unit: a dense SwiGLU MLP, or the sparse MLP its config holds."""

    def embed(self) -> int:
        return self.cfg.vocab_size * self.cfg.hidden_size

    def block(self) -> int:
        cfg = self.cfg
        d = cfg.hidden_size
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        attention = d * q + 2 * d * kv + q * d
        attention += (q + 2 * kv) if cfg.attention_bias or cfg.qkv_bias else 0
        attention += d if cfg.attention_bias else 0  # o_proj's bias
        if cfg.qk_norm:
            attention += (q + kv) if cfg.qk_norm_whole else 2 * cfg.head_dim
        return 2 * d + attention + self.mlp()  # input_layernorm, post_attention_layernorm

    def mlp(self) -> int:
        """The parameters of a block's MLP: SwiGLU's three projections and their biases, or the sparse MLP's."""
        cfg = self.cfg
        if cfg.sparse_mlp is not None:
            return cfg.sparse_mlp.params(cfg.hidden_size)
        d, f = cfg.hidden_size, cfg.intermediate_size
        return 3 * d * f + ((2 * f + d) if cfg.mlp_bias else 0)

    def head(self) -> int:
        # norm, lm_head (no bias); a tied lm_head is the embedding's weight, held by the embedding's state
        cfg = self.cfg
        return cfg.hidden_size + (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)

    def borrowed(self, unit: str) -> dict[str, tuple[str, str]]:
        tied = unit == "head" and self.cfg.tie_word_embeddings
        return {"lm_head.weight": ("embed", "embed_tokens.weight")} if tied else {}


class LlamaAttention(AttentionLayout):
    """Full attention on every block; a window is one on every block, which its context stops short of."""

    def context(self) -> tuple[int, str]:
        # Within the window every key of a causal sequence is visible: the window changes nothing there.
        cfg = self.cfg
        if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_position_embeddings:
            return cfg.sliding_window, (f"sliding_window={cfg.sliding_window}; attention over a sliding window "
                                        "is not supported")
        return cfg.max_position_embeddings, f"max_position_embeddings={cfg.max_position_embeddings}"


@family
@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    costs_class: ClassVar[type[Costs]] = LlamaCosts
    mlp_costs: ClassVar[type[MlpCosts]] = SwiGLUCosts  # its MLP's facet of the costs
    model_type: ClassVar[str] = "llama"
    ignored_checkpoint_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    adapter_class: ClassVar[type[StateDictAdapter]] = LlamaAdapter
    lora_class: ClassVar[type[LoraTargets]] = LlamaTargets
    params_class: ClassVar[type[UnitParams]] = LlamaParams
    attention_class: ClassVar[type[AttentionLayout]] = LlamaAttention
    architecture: ClassVar[str] = "LlamaForCausalLM"
    qkv_bias: ClassVar[bool] = False  # q/k/v biases whatever attention_bias says (qwen2)
    qk_norm: ClassVar[bool] = False  # RMSNorm over each head of q and k before RoPE (qwen3)
    qk_norm_whole: ClassVar[bool] = False  # that RMSNorm over q's and k's whole projections instead (olmoe)
    honoured_flags: ClassVar[tuple[str, ...]] = ("attention_bias", "mlp_bias")
    slides: ClassVar[bool] = False  # whether transformers' class reads sliding_window
    # Whether transformers' config turns the window on only with use_sliding_window, on the layers from
    # max_window_layers on (or those layer_types names), rather than on every layer whenever it is set (mistral).
    switched_window: ClassVar[bool] = False

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    # None: num_attention_heads (multi-head attention), and hidden_size // num_attention_heads; __post_init__ sets them
    num_key_value_heads: int = None  # type: ignore[assignment]  # resolved in __post_init__
    head_dim: int = None  # type: ignore[assignment]  # resolved in __post_init__
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # Items of transformers' rope_parameters dict (rope_theta, rope_type, its factors), sorted: hashable.
    rope_parameters: Any = field(default=(("rope_theta", 10000.0), ("rope_type", "default")))
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    pad_token_id: int | None = None  # transformers' Llama-family classes make it the embedding's padding_idx

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None and isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        positive_ints(self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
        check_heads(self)
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; the {self.model_type} family "
                              "uses 'silu'")
        check_rms_norm_eps(self.rms_norm_eps)
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        for flag in ("attention_bias", "mlp_bias"):
            value = getattr(self, flag)
            if not isinstance(value, bool) or (value and flag not in self.honoured_flags):
                raise ConfigError(f"{flag}={value!r} is not supported for {self.model_type}; set it to false")
        if self.sliding_window is not None:
            if not self.slides:
                raise ConfigError(f"sliding_window is not part of {self.model_type}; remove it")
            positive_ints(self, "sliding_window")
        check_pad_token_id(self)
        self._check_rope()
        check_size(self)

    def _check_rope(self) -> None:
        object.__setattr__(self, "rope_parameters", checked_rope(self.rope_parameters))

    @classmethod
    def example(cls) -> "LlamaConfig":
        """Grouped-query attention, llama3 RoPE scaling, both of Llama's optional biases and a padding row."""
        return cls(**TINY, rope_parameters=_scaled_llama3(500000.0, 8.0, 8), attention_bias=True, mlp_bias=True,
                   pad_token_id=1)

    # --- the common vocabulary ------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @property
    def qk_norm_rows(self) -> tuple[int, int]:
        """The rows per token the q and k norms normalise (each a statistic they save): a head each, or one."""
        return (1, 1) if self.qk_norm_whole else (self.num_attention_heads, self.num_key_value_heads)

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_parameters)


@family
@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    model_type: ClassVar[str] = "mistral"
    architecture: ClassVar[str] = "MistralForCausalLM"
    honoured_flags: ClassVar[tuple[str, ...]] = ()
    slides: ClassVar[bool] = True
    adapter_class: ClassVar[type[StateDictAdapter]] = MistralAdapter

    @classmethod
    def example(cls) -> "MistralConfig":
        """A window no shorter than the sequences (attention over a sliding window is refused)."""
        return cls(**TINY, sliding_window=TINY["max_position_embeddings"])


@family
@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    model_type: ClassVar[str] = "qwen2"
    architecture: ClassVar[str] = "Qwen2ForCausalLM"
    qkv_bias: ClassVar[bool] = True
    honoured_flags: ClassVar[tuple[str, ...]] = ()
    slides: ClassVar[bool] = True
    switched_window: ClassVar[bool] = True
    adapter_class: ClassVar[type[StateDictAdapter]] = Qwen2Adapter

    @classmethod
    def example(cls) -> "Qwen2Config":
        """q/k/v biases (Qwen2's own) with grouped-query attention."""
        return cls(**TINY)


@family
@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    model_type: ClassVar[str] = "qwen3"
    architecture: ClassVar[str] = "Qwen3ForCausalLM"
    qk_norm: ClassVar[bool] = True
    honoured_flags: ClassVar[tuple[str, ...]] = ("attention_bias",)
    slides: ClassVar[bool] = True
    switched_window: ClassVar[bool] = True
    adapter_class: ClassVar[type[StateDictAdapter]] = Qwen3Adapter

    @classmethod
    def example(cls) -> "Qwen3Config":
        """q/k norms, one key/value head for four query heads, and a head_dim apart from hidden_size's share."""
        return cls(**{**TINY, "num_key_value_heads": 1}, head_dim=16)


def _scaled_llama3(theta: float, factor: float, original: int) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted({"rope_theta": theta, "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": original}.items()))


def _llama3(theta: float, factor: float) -> tuple[tuple[str, Any], ...]:
    return _scaled_llama3(theta, factor, 8192)


def _theta(theta: float) -> tuple[tuple[str, Any], ...]:
    return (("rope_theta", theta), ("rope_type", "default"))


PRESETS.update({
    # The published shapes (their config.json files); tests/test_llama.py checks the parameter counts.
    "llama-3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                rope_parameters=_llama3(500000.0, 32.0)),
    "llama-3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                rms_norm_eps=1e-5, rope_parameters=_llama3(500000.0, 8.0)),
    "mistral-7b": MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                                rms_norm_eps=1e-5, sliding_window=4096),
    "qwen2.5-7b": Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                              num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                              rms_norm_eps=1e-6, rope_parameters=_theta(1000000.0)),
    "qwen3-8b": Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_parameters=_theta(1000000.0)),
    # A small Llama for quick runs: GQA (4 query heads per key/value head) and llama3 RoPE scaling.
    "llama-debug": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               rope_parameters=_scaled_llama3(10000.0, 8.0, 16)),
    # Synthetic, no published checkpoint: Llama's shape at GPT-J-350M's width and parameter count (SwiGLU at
    # 2.75 x d, 4 query heads per key/value head, Llama 2's vocabulary), for `streamer bench` on a CPU.
    "llama-350m": LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=26,
                              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                              rms_norm_eps=1e-5, rope_parameters=_theta(500000.0)),
})
