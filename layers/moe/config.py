"""The mixture-of-experts families' configurations (torch-free), transformers' field names: `qwen3_moe`, a Qwen3
whose MLP is a sparse mixture of experts, `mixtral`, a Mistral whose MLP is, and `olmoe`. Each is a Llama-family
config that names its attention's variations (Qwen3's, Mistral's, OLMo's) rather than inheriting them. Their units
are in layers/moe/units.py.

A sparse MLP replaces the dense one of a Llama-family block: the config holds it as a facet, not as an ancestor
class (`layers.config.SparseMlp`, `ModelConfig.sparse_mlp`), which its units, costs (`SparseMlpCosts`), LoRA targets
(`ExpertsTargets`) and adapter (`ExpertsAdapter`) read. A router (`gate`, a linear map to one logit per expert)
picks each token's `num_experts_per_tok` experts by their softmax probabilities, and the token's output is the sum
of those experts' SwiGLU outputs weighted by the probabilities (renormalised over the chosen ones where
`norm_topk_prob`). Everything else is the Llama family's, variations and all.

With `output_router_logits` the model's loss adds `router_aux_loss_coef` times transformers' load-balancing loss
(Switch Transformer's) over every layer's routing: layers/moe/units.py's `RouterBalance`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from layers.config import PRESETS, ConfigError, SparseMlp, family
from layers.llama.config import TINY, LlamaConfig, MistralConfig, Qwen3Config
from layers.moe.adapter import MixtralAdapter, OlmoeAdapter, Qwen3MoeAdapter
from layers.moe.costs import SparseMlpCosts
from layers.moe.targets import ExpertsTargets


def holds(cfg: LlamaConfig, mlp: SparseMlp) -> None:
    """Give a mixture's config its sparse MLP facet, built from its own fields: first in its `__post_init__`, since
    the sizes' checks count the experts' parameters."""
    object.__setattr__(cfg, "sparse_mlp", mlp)


@family
@dataclass(frozen=True)
class Qwen3MoeConfig(LlamaConfig):
    """Qwen3's attention (RMSNorm on each head of q and k, `Qwen3Config`'s variations) and a sparse MLP in every
    layer. transformers' class can make some layers dense (`decoder_sparse_step`, `mlp_only_layers`): published
    configs do not, and it is refused here."""

    model_type: ClassVar[str] = "qwen3_moe"
    adapter_class = Qwen3MoeAdapter
    mlp_costs = SparseMlpCosts
    lora_class = ExpertsTargets
    architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    qk_norm: ClassVar[bool] = Qwen3Config.qk_norm
    honoured_flags: ClassVar[tuple[str, ...]] = Qwen3Config.honoured_flags
    slides: ClassVar[bool] = Qwen3Config.slides
    switched_window: ClassVar[bool] = Qwen3Config.switched_window

    intermediate_size: int = 6144  # the dense MLP's width, which no layer has here
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        holds(self, SparseMlp(self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size,
                              self.norm_topk_prob, self.output_router_logits, self.router_aux_loss_coef))
        super().__post_init__()

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
class MixtralConfig(LlamaConfig):
    """Mistral's attention (`MistralConfig`'s variations) and a sparse MLP of `num_local_experts` experts of width
    `intermediate_size`. The router's chosen probabilities are always renormalised: a softmax over the chosen
    experts' logits, computed as transformers does (softmax over all, top-k, divided by their sum). transformers
    keeps them in fp32 for the weighting; here they are cast to the compute dtype first (the same in fp32, a
    rounding apart in bf16)."""

    model_type: ClassVar[str] = "mixtral"
    architecture: ClassVar[str] = "MixtralForCausalLM"
    adapter_class = MixtralAdapter
    mlp_costs = SparseMlpCosts
    lora_class = ExpertsTargets
    honoured_flags: ClassVar[tuple[str, ...]] = MistralConfig.honoured_flags
    slides: ClassVar[bool] = MistralConfig.slides

    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        holds(self, SparseMlp(self.num_local_experts, self.num_experts_per_tok, self.intermediate_size, True,
                              self.output_router_logits, self.router_aux_loss_coef))
        super().__post_init__()

    @classmethod
    def example(cls) -> "MixtralConfig":
        """Four experts, two per token, narrower than the model; grouped-query attention and no window."""
        return cls(**{**TINY, "intermediate_size": 16}, num_local_experts=4, num_experts_per_tok=2)


@family
@dataclass(frozen=True)
class OlmoeConfig(LlamaConfig):
    """OLMo's attention (RMSNorm over q's and k's whole projections, as OLMo 2's) and a sparse MLP of
    `num_experts` experts of width `intermediate_size`, not renormalised by default. Its embedding's
    `pad_token_id` row gets no gradient and starts at zero, as transformers' nn.Embedding(padding_idx) does."""

    model_type: ClassVar[str] = "olmoe"
    adapter_class = OlmoeAdapter
    mlp_costs = SparseMlpCosts
    lora_class = ExpertsTargets
    architecture: ClassVar[str] = "OlmoeForCausalLM"
    qk_norm: ClassVar[bool] = True
    qk_norm_whole: ClassVar[bool] = True
    honoured_flags: ClassVar[tuple[str, ...]] = ("attention_bias",)

    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.01
    pad_token_id: int | None = 1

    def __post_init__(self) -> None:
        holds(self, SparseMlp(self.num_experts, self.num_experts_per_tok, self.intermediate_size,
                              self.norm_topk_prob, self.output_router_logits, self.router_aux_loss_coef))
        super().__post_init__()
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ConfigError(f"head_dim={self.head_dim} is not hidden_size / num_attention_heads "
                              f"({self.hidden_size} / {self.num_attention_heads}): OLMoE's q norm spans "
                              "hidden_size; remove head_dim")

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
