"""The Llama family's byte and FLOP inputs for memory_model (torch-free), measured against autograd
(tests/test_planner.py). The MLP's terms are methods (`mlp_matmul_params`, `mlp_saved_per_token`, `frozen_mlp_saves`),
which a sparse MLP's facet (layers/moe/costs.py) overrides."""
from __future__ import annotations

from layers.costs import BaseCosts, FrozenBlockSaves


class LlamaCosts(BaseCosts):
    """A Llama-family block (the variations are the config's class attributes) and head."""

    def block_matmul_params(self) -> int:
        d, q, kv = self.cfg.hidden_size, self.cfg.attention_width, self.cfg.num_key_value_heads * self.cfg.head_dim
        return 2 * d * q + 2 * d * kv + self.mlp_matmul_params()

    def mlp_matmul_params(self) -> int:
        """The weights of the matmuls a token goes through in a block's MLP."""
        return 3 * self.cfg.hidden_size * self.cfg.intermediate_size

    def block_saved_per_token(self, es: int) -> int:
        d, q = self.cfg.hidden_size, self.cfg.attention_width
        kv = self.cfg.num_key_value_heads * self.cfg.head_dim
        # Each RMSNorm over w features: its fp32 input (the input itself in fp32), rstd, the normalised values
        # (the weight's multiplier), and its output (the next matmuls' input).
        def norm(w: int, rows: int = 1) -> int:
            return 4 * w + 4 * rows + es * w

        saved = 2 * (norm(d) + es * d)  # input_layernorm and post_attention_layernorm, and their outputs
        if self.cfg.qk_norm:  # over q and k, per head or whole; their outputs go to RoPE, which saves only its tables
            saved += norm(q, self.cfg.qk_norm_rows[0]) + norm(kv, self.cfg.qk_norm_rows[1])
        saved += 4 * es * q  # rotated q, k and v repeated to every query head (SDPA's inputs), its output
        return saved + self.mlp_saved_per_token(es)

    def mlp_saved_per_token(self, es: int) -> int:
        """Bytes the MLP saves per token besides its input (the post-attention norm's output)."""
        return 4 * es * self.cfg.intermediate_size  # gate, silu(gate), up, and their product (down_proj's input)

    def block_saves_input(self, es: int) -> bool:
        return es == 4  # RMSNorm saves its fp32 input: in fp32 the input itself, else a copy

    def block_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        d, f = self.cfg.hidden_size, self.cfg.intermediate_size
        # down_proj's backward gives the gradient w.r.t. its input, the product (then freed); the product's
        # backward gives the gradients w.r.t. silu(gate) and up: two (N, f) more, and down_proj's gradient.
        # (The post-attention RMSNorm's fp32 backward can hold more where f is near d; not modelled.)
        return ((2 * es * f, d * f + (d if self.cfg.mlp_bias else 0), 0),)

    def head_saved_per_token(self, es: int, frozen: bool = False) -> int:
        # The final RMSNorm (its normalised values only for its weight's gradient) and its output
        return 4 * self.cfg.hidden_size + 4 + (1 if frozen else 2) * es * self.cfg.hidden_size

    def frozen_block_saves(self, es: int, targets: frozenset[str], plain: bool, grad_in: bool) -> FrozenBlockSaves:
        d, q = self.cfg.hidden_size, self.cfg.attention_width
        kv = self.cfg.num_key_value_heads * self.cfg.head_dim
        # A frozen RMSNorm keeps only its fp32 input and rstd, and only where its input needs a gradient.
        norm = 4 * d + 4
        q_grad, k_grad = grad_in or "q_proj" in targets, grad_in or "k_proj" in targets
        attention = q_grad or k_grad or grad_in or "v_proj" in targets
        saved = norm if grad_in else 0  # input_layernorm
        saved += d * es if plain and targets & {"q_proj", "k_proj", "v_proj"} else 0  # its output, the adapters'
        if self.cfg.qk_norm:
            saved += (4 * q + 4 * self.cfg.qk_norm_rows[0] if q_grad else 0)
            saved += (4 * kv + 4 * self.cfg.qk_norm_rows[1] if k_grad else 0)
        saved += 4 * q * es if attention else 0  # rotated q, k and v repeated to every query head, the output
        saved += q * es if not attention and plain and "o_proj" in targets else 0  # o_proj's adapter input
        mlp_in = grad_in or attention or "o_proj" in targets  # the residual after attention needs a gradient
        saved += norm if mlp_in else 0  # post_attention_layernorm
        mlp, mlp_inputs = self.frozen_mlp_saves(es, targets, plain, mlp_in)
        inputs = {"q_proj": grad_in, "k_proj": grad_in, "v_proj": grad_in, "o_proj": attention, **mlp_inputs}
        return FrozenBlockSaves(saved + mlp, attention, q_grad or k_grad, {t: inputs[t] for t in targets},
                                input_saved=grad_in and self.block_saves_input(es))  # input_layernorm's

    def frozen_mlp_saves(self, es: int, targets: frozenset[str], plain: bool,
                         mlp_in: bool) -> tuple[int, dict[str, bool]]:
        """A frozen MLP's saved bytes per token (`mlp_in`: its input needs a gradient), and for each of its
        projections whether its input needs a gradient."""
        d, f = self.cfg.hidden_size, self.cfg.intermediate_size
        saved = d * es if plain and targets & {"gate_proj", "up_proj"} else 0  # its input, the adapters'
        gate, up = mlp_in or "gate_proj" in targets, mlp_in or "up_proj" in targets
        saved += 2 * f * es if gate else 0  # silu's input and, for silu(gate)'s gradient, up
        saved += f * es if up else 0  # silu(gate), for up's gradient
        saved += f * es if plain and "down_proj" in targets else 0  # the product, down_proj's adapter input
        return saved, {"gate_proj": mlp_in, "up_proj": mlp_in, "down_proj": gate or up}
