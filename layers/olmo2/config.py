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

from layers.config import PRESETS, FrozenBlockSaves, family
from layers.llama.config import TINY, LlamaConfig


@family
@dataclass(frozen=True)
class Olmo2Config(LlamaConfig):
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

    # --- parameters -------------------------------------------------------------------------------
    def block_params(self) -> int:
        d, q, f = self.hidden_size, self.attention_width, self.intermediate_size
        kv = self.num_key_value_heads * self.head_dim
        attention = 2 * d * q + 2 * d * kv + ((q + 2 * kv + d) if self.attention_bias else 0)
        attention += q + kv  # q_norm and k_norm, over the whole projections
        return attention + 3 * d * f + 2 * d  # post_attention_layernorm, post_feedforward_layernorm

    # --- what memory_model needs, measured (tests/test_planner.py) ----------------------------------------
    def block_saved_per_token(self, es: int) -> int:
        d, q, f = self.hidden_size, self.attention_width, self.intermediate_size
        kv = self.num_key_value_heads * self.head_dim
        # Each RMSNorm over w features, in any dtype: its fp32 input (in fp32 the input itself), rstd, and the
        # fp32 normalised values (the weight's multiplier); its cast output is saved by what reads it.
        def norm(w: int) -> int:
            return 8 * w + 4

        saved = es * d  # the block's input, q/k/v_proj's
        saved += norm(q) + norm(kv)  # q_norm, k_norm; RoPE after them saves only its tables
        saved += 4 * es * q  # rotated q, k and v repeated to every query head (SDPA's inputs), its output
        saved += norm(d)  # post_attention_layernorm over o_proj's output
        saved += es * d  # the residual after attention, gate_proj's and up_proj's input
        saved += 4 * es * f  # gate, silu(gate), up, and their product (down_proj's input)
        return saved + norm(d)  # post_feedforward_layernorm over down_proj's output

    def block_saves_input(self, es: int) -> bool:
        return True  # no norm before attention: q/k/v_proj save the input itself

    def block_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        d, f = self.hidden_size, self.intermediate_size
        # First post_feedforward_layernorm's fp32 backward: four (N, d) fp32 gradients and products at once,
        # less a row's statistic already freed, and its weight's gradient. Then the MLP's: the product's
        # backward gives the gradients w.r.t. silu(gate) and up, two (N, f), with down_proj's gradient made; the
        # norm's saved tensors (its fp32 input, rstd and normalised values) are freed by then.
        return ((16 * d - 4, d, 0), (2 * es * f - (8 * d + 4), d * f + d, 0))

    def head_saved_per_token(self, es: int, frozen: bool = False) -> int:
        # The final RMSNorm: its fp32 input, rstd, the fp32 normalised values (for its weight's gradient only),
        # and its output cast back (lm_head's input)
        return 4 * self.hidden_size + 4 + (0 if frozen else 4 * self.hidden_size) + es * self.hidden_size

    def frozen_block_saves(self, es: int, targets: frozenset[str], plain: bool, grad_in: bool) -> FrozenBlockSaves:
        d, q, f = self.hidden_size, self.attention_width, self.intermediate_size
        kv = self.num_key_value_heads * self.head_dim
        # A frozen RMSNorm keeps only its fp32 input and rstd, and only where its input needs a gradient.
        def norm(w: int, needed: bool) -> int:
            return 4 * w + 4 if needed else 0

        q_grad, k_grad = grad_in or "q_proj" in targets, grad_in or "k_proj" in targets
        attention = q_grad or k_grad or grad_in or "v_proj" in targets
        saved = d * es if plain and targets & {"q_proj", "k_proj", "v_proj"} else 0  # the input, the adapters'
        saved += norm(q, q_grad) + norm(kv, k_grad)
        saved += 4 * q * es if attention else 0  # rotated q, k and v repeated to every query head, the output
        saved += q * es if not attention and plain and "o_proj" in targets else 0  # o_proj's adapter input
        mlp_in = grad_in or attention or "o_proj" in targets  # o_proj's output, and the residual after it
        saved += norm(d, attention or "o_proj" in targets)  # post_attention_layernorm
        saved += d * es if plain and targets & {"gate_proj", "up_proj"} else 0  # the residual, the adapters'
        gate, up = mlp_in or "gate_proj" in targets, mlp_in or "up_proj" in targets
        saved += 2 * f * es if gate else 0  # silu's input and, for silu(gate)'s gradient, up
        saved += f * es if up else 0  # silu(gate), for up's gradient
        saved += f * es if plain and "down_proj" in targets else 0  # the product, down_proj's adapter input
        saved += norm(d, gate or up or "down_proj" in targets)  # post_feedforward_layernorm
        inputs = {"q_proj": grad_in, "k_proj": grad_in, "v_proj": grad_in, "o_proj": attention,
                  "gate_proj": mlp_in, "up_proj": mlp_in, "down_proj": gate or up}
        return FrozenBlockSaves(saved, attention, q_grad or k_grad, {t: inputs[t] for t in targets},
                                input_saved=plain and bool(targets & {"q_proj", "k_proj", "v_proj"}))


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
