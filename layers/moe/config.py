"""The mixture-of-experts families' configurations (torch-free), transformers' field names: `qwen3_moe`, a Qwen3
whose MLP is a sparse mixture of experts, `mixtral`, a Mistral whose MLP is, and `olmoe`. Their units are in
layers/moe/units.py.

A sparse MLP (`MixtureOfExperts`) replaces the dense one of a Llama-family block: a router (`gate`, a linear map
to one logit per expert) picks each token's `num_experts_per_tok` experts by their softmax probabilities, and the
token's output is the sum of those experts' SwiGLU outputs weighted by the probabilities (renormalised over the
chosen ones where `norm_topk_prob`). Everything else is the Llama family's, variations and all.

With `output_router_logits` the model's loss adds `router_aux_loss_coef` times transformers' load-balancing loss
(Switch Transformer's) over every layer's routing: layers/moe/units.py's `RouterBalance`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from layers.config import PRESETS, ConfigError, family, positive_ints
from layers.llama.config import TINY, LlamaConfig, MistralConfig, Qwen3Config
from layers.adapter import StateDictAdapter
from layers.llama.costs import MlpCosts
from layers.moe.adapter import ExpertsAdapter, MixtralAdapter, OlmoeAdapter, Qwen3MoeAdapter
from layers.moe.costs import SparseMlpCosts
from layers.moe.targets import ExpertsTargets
from layers.targets import LoraTargets

if TYPE_CHECKING:  # the mixin's methods reach LlamaConfig's through super(): the type checker sees it as one
    _MixinBase = LlamaConfig
else:
    _MixinBase = object


class MixtureOfExperts(_MixinBase):
    """The sparse MLP's fields, parameters, LoRA targets and saved names, for a config class that also subclasses
    LlamaConfig; its byte and FLOP inputs are the block's MLP facet `SparseMlpCosts` (layers/moe/costs.py)."""

    mlp_costs: ClassVar[type[MlpCosts]] = SparseMlpCosts
    adapter_class: ClassVar[type[StateDictAdapter]] = ExpertsAdapter

    num_experts_per_tok: int
    output_router_logits: bool  # the loss adds the routers' load-balancing loss, times router_aux_loss_coef
    router_aux_loss_coef: float
    hidden_size: int
    if TYPE_CHECKING:  # a field of one family, derived by another's property: read-only to the type checker
        @property
        def num_experts(self) -> int: ...
        @property
        def norm_topk_prob(self) -> bool: ...
        @property
        def expert_width(self) -> int: ...  # each expert's SwiGLU width, by the family's own field
    else:
        num_experts: int
        norm_topk_prob: bool
        expert_width: int
    lora_class: ClassVar[type[LoraTargets]] = ExpertsTargets
    expert_keys: ClassVar[tuple[str, ...]] = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

    def check_experts(self) -> None:
        positive_ints(self, "num_experts", "num_experts_per_tok")
        if self.expert_width <= 0:
            raise ConfigError(f"the experts' width must be a positive integer, got {self.expert_width!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most the number of "
                              f"experts ({self.num_experts})")
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        if not isinstance(self.output_router_logits, bool):
            raise ConfigError(f"output_router_logits must be true or false, got {self.output_router_logits!r}")
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
            raise ConfigError(f"router_aux_loss_coef must be a finite number, got {coef!r}")

    def mlp_params(self) -> int:
        d, f, experts = self.hidden_size, self.expert_width, self.num_experts
        return experts * d + experts * 3 * d * f  # the router, each expert's gate, up and down projections

    def experts(self) -> int:
        return self.num_experts

    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.expert_width  # its gate, up and down projections


@family
@dataclass(frozen=True)
class Qwen3MoeConfig(MixtureOfExperts, Qwen3Config):
    """Qwen3's attention (RMSNorm on each head of q and k) and a sparse MLP in every layer. transformers' class
    can make some layers dense (`decoder_sparse_step`, `mlp_only_layers`): published configs do not, and it is
    refused here."""

    model_type: ClassVar[str] = "qwen3_moe"
    adapter_class = Qwen3MoeAdapter
    architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    hf_defaults: ClassVar[dict[str, Any]] = {"num_key_value_heads": 4, "max_position_embeddings": 32768,
                                             "intermediate_size": 6144, "sliding_window": 4096}

    intermediate_size: int = 6144  # the dense MLP's width, which no layer has here
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        self.check_experts()  # first: the sizes' checks count the experts' parameters
        super().__post_init__()

    @property
    def expert_width(self) -> int:
        return self.moe_intermediate_size

    def resized(self, **sizes: int) -> "Qwen3MoeConfig":
        """Generic code sizes a model's MLP by `intermediate_size` (a calibration probe's, a smaller model's):
        here the MLP is the experts, so their width scales with it, in proportion."""
        if "intermediate_size" in sizes:
            sizes["moe_intermediate_size"] = max(
                1, self.moe_intermediate_size * sizes["intermediate_size"] // self.intermediate_size)
        return super().resized(**sizes)

    @classmethod
    def example(cls) -> "Qwen3MoeConfig":
        """Four experts, two per token, renormalised; q/k norms on a head_dim apart from hidden_size's share."""
        return cls(**{**TINY, "num_key_value_heads": 1}, head_dim=16, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, norm_topk_prob=True)


@family
@dataclass(frozen=True)
class MixtralConfig(MixtureOfExperts, MistralConfig):
    """Mistral's attention and a sparse MLP of `num_local_experts` experts of width `intermediate_size`. The
    router's chosen probabilities are always renormalised: a softmax over the chosen experts' logits, computed
    as transformers does (softmax over all, top-k, divided by their sum). transformers keeps them in fp32 for
    the weighting; here they are cast to the compute dtype first (the same in fp32, a rounding apart in bf16)."""

    model_type: ClassVar[str] = "mixtral"
    architecture: ClassVar[str] = "MixtralForCausalLM"
    adapter_class = MixtralAdapter
    hf_defaults: ClassVar[dict[str, Any]] = {"num_key_value_heads": 8, "max_position_embeddings": 131072,
                                             "sliding_window": None, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5}

    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        self.check_experts()  # first: the sizes' checks count the experts' parameters
        super().__post_init__()

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    @property
    def norm_topk_prob(self) -> bool:
        return True

    @property
    def expert_width(self) -> int:
        return self.intermediate_size

    @classmethod
    def example(cls) -> "MixtralConfig":
        """Four experts, two per token, narrower than the model; grouped-query attention and no window."""
        return cls(**{**TINY, "intermediate_size": 16}, num_local_experts=4, num_experts_per_tok=2)


@family
@dataclass(frozen=True)
class OlmoeConfig(MixtureOfExperts, LlamaConfig):
    """OLMo's attention (RMSNorm over q's and k's whole projections, as OLMo 2's) and a sparse MLP of
    `num_experts` experts of width `intermediate_size`, not renormalised by default. Its embedding's
    `pad_token_id` row gets no gradient and starts at zero, as transformers' nn.Embedding(padding_idx) does."""

    model_type: ClassVar[str] = "olmoe"
    adapter_class = OlmoeAdapter
    architecture: ClassVar[str] = "OlmoeForCausalLM"
    qk_norm: ClassVar[bool] = True
    qk_norm_whole: ClassVar[bool] = True
    honoured_flags: ClassVar[tuple[str, ...]] = ("attention_bias",)
    hf_defaults: ClassVar[dict[str, Any]] = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5}

    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.01
    pad_token_id: int | None = 1

    def __post_init__(self) -> None:
        self.check_experts()  # first: the sizes' checks count the experts' parameters
        super().__post_init__()
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ConfigError(f"head_dim={self.head_dim} is not hidden_size / num_attention_heads "
                              f"({self.hidden_size} / {self.num_attention_heads}): OLMoE's q norm spans "
                              "hidden_size; remove head_dim")

    @property
    def expert_width(self) -> int:
        return self.intermediate_size

    @classmethod
    def example(cls) -> "OlmoeConfig":
        """Four experts, two per token, not renormalised; q/k norms over the whole projections, grouped-query
        attention, q/k/v/o biases, and a padding token."""
        return cls(**{**TINY, "intermediate_size": 16}, num_experts=4, num_experts_per_tok=2, attention_bias=True)


THETA_1E6 = (("rope_theta", 1000000.0), ("rope_type", "default"))
PRESETS.update({
    # Qwen/Qwen3-30B-A3B's config.json; tests/test_moe.py checks transformers' parameter count.
    "qwen3-30b-a3b": Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                    head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                    rope_parameters=THETA_1E6,
                                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                    norm_topk_prob=True),
    # mistralai/Mixtral-8x7B-v0.1's config.json.
    "mixtral-8x7b": MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                                  rms_norm_eps=1e-5, rope_parameters=THETA_1E6, num_local_experts=8,
                                  num_experts_per_tok=2),
    # allenai/OLMoE-1B-7B-0924's config.json.
    "olmoe-1b-7b": OlmoeConfig(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                               num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                               rms_norm_eps=1e-5, num_experts=64, num_experts_per_tok=8, pad_token_id=1),
})
