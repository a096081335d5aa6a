"""The GPT-J family's configuration (torch-free): Hugging Face's field names, validated, frozen; its presets, its
parameter counts. How transformers names it is layers/gptj/adapter.py. Its units are in layers/gptj/units.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from layers.config import PRESETS, ConfigError, ModelConfig, check_size, family, positive_ints
from layers.attention import AttentionLayout
from layers.gptj.adapter import GPTJAdapter
from layers.gptj.costs import GPTJCosts
from layers.gptj.targets import GPTJTargets
from layers.params import UnitParams

_SUPPORTED_ACTIVATIONS = ("gelu_new",)


class GPTJParams(UnitParams):
    def embed(self) -> int:
        return self.cfg.vocab_size * self.cfg.n_embd

    def block(self) -> int:
        d, f = self.cfg.n_embd, self.cfg.intermediate_size
        return 2 * d + 4 * d * d + (d * f + f) + (f * d + d)  # ln_1, q/k/v/out, fc_in, fc_out

    def head(self) -> int:
        d, vocab = self.cfg.n_embd, self.cfg.vocab_size
        return 2 * d + vocab * d + vocab  # ln_f, lm_head


class GPTJAttention(AttentionLayout):
    def context(self) -> tuple[int, str]:
        return self.cfg.n_positions, f"n_positions={self.cfg.n_positions}"


@family
@dataclass(frozen=True)
class GPTJConfig(ModelConfig):
    costs_class = GPTJCosts
    params_class = GPTJParams
    attention_class = GPTJAttention
    model_type: ClassVar[str] = "gptj"
    ignored_checkpoint_suffixes: ClassVar[tuple[str, ...]] = ("attn.bias", "attn.masked_bias")
    adapter_class = GPTJAdapter
    lora_class = GPTJTargets
    own_names: ClassVar[dict[str, str]] = {
        "hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
        "max_position_embeddings": "n_positions", "intermediate_size": "n_inner"}

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
        positive_ints(self, "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "rotary_dim")
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
        check_size(self)

    @classmethod
    def example(cls) -> "GPTJConfig":
        """Rotary over part of each head (8 of 16 dimensions), GPT-J's one variation."""
        return cls(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)

    # --- the common vocabulary (HF's attribute_map for GPT-J) -------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layer

    @property
    def num_attention_heads(self) -> int:
        return self.n_head

    @property
    def num_key_value_heads(self) -> int:
        return self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def intermediate_size(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def max_position_embeddings(self) -> int:
        return self.n_positions


PRESETS.update({
    # The public EleutherAI/gpt-j-6B.
    "gptj-6b": GPTJConfig(),
    # GPT-J-shaped models sized for a 2-core, 24 GiB machine.
    "gptj-4b": GPTJConfig(n_embd=3584, n_layer=24, n_head=14, rotary_dim=64),
    "gptj-2.7b": GPTJConfig(n_embd=2560, n_layer=32, n_head=20, rotary_dim=32),
    "gptj-1.3b": GPTJConfig(n_embd=2048, n_layer=24, n_head=16, rotary_dim=32),
    "gptj-350m": GPTJConfig(n_embd=1024, n_layer=20, n_head=16, rotary_dim=16),
    "gptj-demo": GPTJConfig(vocab_size=4096, n_positions=256, n_embd=384, n_layer=6, n_head=6, rotary_dim=16),
    "gptj-debug": GPTJConfig(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8),
})
