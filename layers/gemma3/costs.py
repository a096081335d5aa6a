"""Gemma 3's byte and FLOP inputs for memory_model (torch-free): four norms about 1 + weight, q/k norms."""
from __future__ import annotations

from layers.costs import BaseCosts, FrozenBlockSaves


class Gemma3Costs(BaseCosts):
    """Gemma 3's block (four norms about 1 + weight, q/k norms, GeGLU) and head."""

    def block_matmul_params(self) -> int:
        d = self.cfg.hidden_size
        return 2 * d * (self.cfg.attention_width + self.cfg.kv_width) + 3 * d * self.cfg.intermediate_size

    def block_saved_per_token(self, es: int) -> int:
        d, q, kv, f = self.cfg.hidden_size, self.cfg.attention_width, self.cfg.kv_width, self.cfg.intermediate_size
        # Each norm over w features keeps, all in fp32: its input, rstd and the normalised values (the weight's
        # multiplier); its output is the next op's input, saved by that op.
        def norm(w: int, rows: int = 1) -> int:
            return 8 * w + 4 * rows

        saved = 4 * norm(d) + 2 * es * d  # the four norms; the outputs of those before attention and the MLP
        saved += norm(q, self.cfg.num_attention_heads) + norm(kv, self.cfg.num_key_value_heads)  # q/k norms, then RoPE
        saved += 4 * es * q  # rotated q, k and v repeated to every query head (SDPA's inputs), its output
        return saved + 4 * es * f  # gate, gelu(gate), up, and their product (down_proj's input)

    def block_saved_fixed(self, es: int) -> int:
        return 4 * (4 * self.cfg.hidden_size + 2 * self.cfg.head_dim)  # each norm's fp32 1 + weight

    def block_saves_input(self, es: int) -> bool:
        return es == 4  # the first norm saves its fp32 input: in fp32 the input itself, else a copy

    def block_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        d, q, f = self.cfg.hidden_size, self.cfg.attention_width, self.cfg.intermediate_size
        # Measured (tests/test_backward_transient.py). As the backward goes, a norm's saved tensors go (8d + 4
        # per token, its 1 + weight 4d bytes) and its weight's gradient comes. (1) The last norm's fp32
        # backward: four (N, d) fp32 tensors. (2) The MLP's product's backward: the gradients w.r.t. gelu(gate)
        # and up, with down_proj's gradient; the last norm's tensors gone. (3) SDPA's backward: the gradient
        # w.r.t. its output and those w.r.t. q, k and v at every query head; the MLP's and three norms'
        # tensors gone, o_proj's and the MLP's gradients made.
        o_proj = q * d + (d if self.cfg.attention_bias else 0)
        return ((16 * d - 4, d, -4 * d),
                (2 * es * f - 8 * d - 4, d * f + d, -4 * d),
                (4 * es * q - 24 * d - 4 * es * f - 12, o_proj + 3 * d * f + 3 * d, -12 * d))

    def head_saved_per_token(self, es: int, frozen: bool = False) -> int:
        # The final norm's fp32 input and rstd, its normalised values (only for its weight's gradient), and its
        # output (the chunked loss's input).
        return 4 * self.cfg.hidden_size + 4 + (0 if frozen else 4 * self.cfg.hidden_size) + es * self.cfg.hidden_size

    def head_saved_fixed(self) -> int:
        return 4 * self.cfg.hidden_size  # the final norm's fp32 1 + weight

    def frozen_block_saves(self, es: int, targets: frozenset[str], plain: bool, grad_in: bool) -> FrozenBlockSaves:
        c = self.cfg
        d, q, kv, f, D = c.hidden_size, c.attention_width, c.kv_width, c.intermediate_size, c.head_dim
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
        saved += (4 * q + 4 * self.cfg.num_attention_heads if q_grad else 0)
        saved += (4 * kv + 4 * self.cfg.num_key_value_heads if k_grad else 0)
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
