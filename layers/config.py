"""GPT-J configuration: Hugging Face's field names, validated, frozen."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


class ConfigError(ValueError):
    """A configuration that cannot describe a GPT-J model; the message names the fix."""


# HF config.json keys that describe training/generation/bookkeeping rather than
# the model's shape: accepted and ignored by from_hf().
_HF_IGNORED_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "gradient_checkpointing", "task_specific_params", "tokenizer_class",
    "attention_dropout", "_name_or_path", "output_attentions", "output_hidden_states",
    "return_dict", "scale_attn_weights", "summary_type", "summary_use_proj",
    "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    "id2label", "label2id", "chunk_size_feed_forward", "is_decoder", "is_encoder_decoder",
    "problem_type", "_attn_implementation_autoset", "_attn_implementation",
})
# Dropout is a training-time regulariser the public checkpoints set to 0.
_HF_DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
_SUPPORTED_ACTIVATIONS = ("gelu_new",)


@dataclass(frozen=True)
class GPTJConfig:
    vocab_size: int = 50400
    n_positions: int = 2048
    n_embd: int = 4096
    n_layer: int = 28
    n_head: int = 16
    rotary_dim: int = 64
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "rotary_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_inner is not None and (
            not isinstance(self.n_inner, int) or isinstance(self.n_inner, bool) or self.n_inner <= 0
        ):
            raise ConfigError(f"n_inner must be a positive integer or None (= 4 * n_embd), got {self.n_inner!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"choose n_head among the divisors of {self.n_embd}"
            )
        if self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim ({self.rotary_dim}) must be even: rotary rotates pairs of dimensions")
        if self.rotary_dim > self.head_dim:
            raise ConfigError(
                f"rotary_dim ({self.rotary_dim}) cannot exceed the head dimension n_embd/n_head = {self.head_dim}"
            )
        if self.activation_function not in _SUPPORTED_ACTIVATIONS:
            raise ConfigError(
                f"activation_function {self.activation_function!r} is not supported; GPT-J uses 'gelu_new'"
            )
        if not isinstance(self.layer_norm_epsilon, (int, float)) or not 0 < self.layer_norm_epsilon < 1:
            raise ConfigError(f"layer_norm_epsilon must be in (0, 1), got {self.layer_norm_epsilon!r}")
        if self.tie_word_embeddings is not False:
            raise ConfigError(f"tie_word_embeddings must be False (GPT-J's embedding and lm_head are separate), "
                              f"got {self.tie_word_embeddings!r}")
        # Every tensor's byte size must fit a 64-bit count: 16 bytes of training state per parameter, and the
        # fp32 rotary table of n_positions x rotary_dim.
        if 16 * max(self.num_params(), self.n_positions * self.rotary_dim) >= 2**63:
            raise ConfigError(f"a model of {self.num_params():,} parameters (vocab_size {self.vocab_size}, n_embd "
                              f"{self.n_embd}, n_layer {self.n_layer}, n_positions {self.n_positions}) is too "
                              "large to address; check the config's sizes")

    # --- derived shapes -------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    def block_params(self) -> int:
        d, f = self.n_embd, self.inner_dim
        return 2 * d + 4 * d * d + (d * f + f) + (f * d + d)  # ln_1, q/k/v/out, fc_in, fc_out

    def embed_params(self) -> int:
        return self.vocab_size * self.n_embd

    def head_params(self) -> int:
        return 2 * self.n_embd + self.vocab_size * self.n_embd + self.vocab_size  # ln_f, lm_head

    def num_params(self) -> int:
        return self.embed_params() + self.n_layer * self.block_params() + self.head_params()

    def unit_names(self) -> list[str]:
        """The streamed units in execution order: 'embed', 'block.0' … 'block.{L-1}', 'head'."""
        return ["embed", *(f"block.{i}" for i in range(self.n_layer)), "head"]

    def unit_params(self, unit: str) -> int:
        if unit == "embed":
            return self.embed_params()
        if unit == "head":
            return self.head_params()
        return self.block_params()

    # --- construction ----------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "GPTJConfig":
        try:
            return PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None

    @classmethod
    def named(cls, model: str | Path) -> "GPTJConfig":
        """What a --model names: a preset, else a Hugging Face config.json or a folder holding one."""
        if str(model) in PRESETS:
            return PRESETS[str(model)]
        if not Path(model).exists():
            raise ConfigError(f"{str(model)!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                              "config.json or folder holding one")
        return cls.from_hf(model)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> "GPTJConfig":
        """Build from our own field names; an unknown field is an error, not ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in set(fields) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**fields)

    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any]) -> "GPTJConfig":
        """Read a Hugging Face GPT-J config: a dict, a config.json, or a folder holding one."""
        raw = dict(source) if isinstance(source, Mapping) else _read_hf_json(Path(source))
        model_type = raw.pop("model_type", "gptj")
        if model_type != "gptj":
            raise ConfigError(f"model_type is {model_type!r}; only GPT-J ('gptj') checkpoints are supported")
        for key in _HF_DROPOUT_KEYS:
            value = raw.pop(key, 0.0)
            if value not in (0, 0.0, None):
                raise ConfigError(f"{key}={value} is not supported (no dropout); set it to 0.0")
        aliases = {"hidden_size": "n_embd", "num_attention_heads": "n_head",
                   "num_hidden_layers": "n_layer", "max_position_embeddings": "n_positions"}
        for alias, name in aliases.items():
            if alias in raw:
                value = raw.pop(alias)
                if name in raw and raw[name] != value:
                    raise ConfigError(f"{alias}={value} contradicts {name}={raw[name]}; keep one of them")
                raw[name] = value
        # The published GPT-J config says "rotary": true; rotary is not optional here.
        if raw.pop("rotary", True) is not True:
            raise ConfigError("rotary=false (no rotary embedding) is not GPT-J; remove it or set it to true")
        if raw.get("rotary_dim", 64) is None:
            raise ConfigError("rotary_dim=None (rotary over the whole head) is not supported; set rotary_dim")
        fields = {k: v for k, v in raw.items() if k not in _HF_IGNORED_KEYS}
        return cls.from_dict(fields)

    def to_hf(self) -> dict[str, Any]:
        """The config.json that transformers.GPTJForCausalLM reads."""
        return {
            "architectures": ["GPTJForCausalLM"], "model_type": "gptj",
            **dataclasses.asdict(self),
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": 50256 if self.vocab_size > 50256 else 0,
            "eos_token_id": 50256 if self.vocab_size > 50256 else 0,
        }


def _read_hf_json(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no GPT-J config at {path}; pass a config.json or the folder that holds it")
    try:
        raw = json.loads(path.read_text(encoding="utf-8-sig"))  # a byte-order mark (Notepad) is no error
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


PRESETS: dict[str, GPTJConfig] = {
    # The public EleutherAI/gpt-j-6B.
    "gptj-6b": GPTJConfig(),
    # GPT-J-shaped models sized for a 2-core, 24 GiB machine.
    "gptj-4b": GPTJConfig(n_embd=3584, n_layer=24, n_head=14, rotary_dim=64),
    "gptj-2.7b": GPTJConfig(n_embd=2560, n_layer=32, n_head=20, rotary_dim=32),
    "gptj-1.3b": GPTJConfig(n_embd=2048, n_layer=24, n_head=16, rotary_dim=32),
    "gptj-350m": GPTJConfig(n_embd=1024, n_layer=20, n_head=16, rotary_dim=16),
    "gptj-demo": GPTJConfig(vocab_size=4096, n_positions=256, n_embd=384, n_layer=6, n_head=6, rotary_dim=16),
    "gptj-debug": GPTJConfig(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8),
}
