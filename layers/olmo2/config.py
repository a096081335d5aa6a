"""OLMo 2's configuration (torch-free), transformers' Olmo2Config field names. OLMo 2 is Llama's decoder
(SwiGLU, rotate-half RoPE, grouped-query attention where configured) with its norms moved: each sublayer's output
is RMS-normalised before the residual add, nothing is normalised before a sublayer, and q and k are
RMS-normalised over their whole projections (every head together) before the split into heads. Its RMSNorms
multiply their weight in fp32 and its RoPE rotates in fp32, casting back after. Its units are in
layers/olmo2/units.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from layers.config import PRESETS, family
from layers.llama.config import TINY, LlamaConfig, LlamaParams
from layers.olmo2.costs import Olmo2Costs


class Olmo2Params(LlamaParams):
    def block(self) -> int:
        cfg = self.cfg
        d, q, f = cfg.hidden_size, cfg.attention_width, cfg.intermediate_size
        kv = cfg.num_key_value_heads * cfg.head_dim
        attention = 2 * d * q + 2 * d * kv + ((q + 2 * kv + d) if cfg.attention_bias else 0)
        attention += q + kv  # q_norm and k_norm, over the whole projections
        return attention + 3 * d * f + 2 * d  # post_attention_layernorm, post_feedforward_layernorm


@family
@dataclass(frozen=True)
class Olmo2Config(LlamaConfig):
    costs_class = Olmo2Costs
    params_class = Olmo2Params
    model_type: ClassVar[str] = "olmo2"
    architecture: ClassVar[str] = "Olmo2ForCausalLM"
    honoured_flags: ClassVar[tuple[str, ...]] = ("attention_bias",)  # its MLP has no biases
    rotary_fp32: ClassVar[bool] = True

    # transformers' Olmo2Config defaults where they differ from Llama's.
    vocab_size: int = 50304
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 1

    @classmethod
    def example(cls) -> "Olmo2Config":
        """Grouped-query attention with a head_dim apart from hidden_size's share (q's norm twice the model's
        width, k's its width), the attention biases, and a padding row."""
        return cls(**TINY, head_dim=16, attention_bias=True, rope_parameters=(("rope_theta", 500000.0),
                                                                              ("rope_type", "default")))


PRESETS.update({
    # The published shapes (their config.json files); tests/test_olmo2.py checks the parameter counts.
    "olmo-2-7b": Olmo2Config(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                             rms_norm_eps=1e-6, pad_token_id=100277, rope_parameters=(("rope_theta", 500000.0),
                                                                                     ("rope_type", "default"))),
    "olmo-2-13b": Olmo2Config(vocab_size=100352, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                              num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
                              rms_norm_eps=1e-6, pad_token_id=100277, rope_parameters=(("rope_theta", 500000.0),
                                                                                      ("rope_type", "default"))),
})
