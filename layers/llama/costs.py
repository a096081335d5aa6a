"""The Llama family's byte and FLOP inputs for memory_model (torch-free), measured against autograd
(tests/test_planner.py). A block composes its attention's terms (here, with the config's variations) and its MLP's,
a facet of its own: `SwiGLUCosts` for a dense SwiGLU, a sparse mixture of experts' in layers/moe/costs.py. The config
names its MLP's facet (`LlamaConfig.mlp_costs`)."""
from __future__ import annotations

from typing import Any, Protocol

from layers.costs import BaseCosts, FrozenBlockSaves


class MlpCosts(Protocol):
    """The MLP of a Llama-family block: its terms of the block's `layers.costs.Costs`."""

    def __init__(self, cfg: Any) -> None: ...

    def matmul_params(self) -> int:
        """The weights of the matmuls a token goes through in the MLP."""
        ...

    def active_width(self) -> int:
        """The width of the MLP a token goes through (`Costs.active_mlp_width`)."""
        ...

    def saved_per_token(self, es: int) -> int:
        """Bytes the MLP saves per token besides its input (the post-attention norm's output)."""
        ...

    def backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        """The block's backward peaks while its MLP's backward runs (`Costs.block_backward_peaks`)."""
        ...

    def frozen_saves(self, es: int, targets: frozenset[str], plain: bool, mlp_in: bool) -> tuple[int, dict[str, bool]]:
        """A frozen MLP's saved bytes per token (`mlp_in`: its input needs a gradient), and for each of its
        projections whether its input needs a gradient."""
        ...

    def saved_after_per_token(self, es: int) -> int:
        """`Costs.experts_saved_after_per_token`."""
        ...

    def group_backward_peaks(self, es: int, group: int) -> tuple[tuple[int, int, int], ...]:
        """`Costs.expert_group_backward_peaks`."""
        ...

    def auxiliary_loss_bytes(self) -> int:
        """`Costs.auxiliary_loss_bytes`."""
        ...


class SwiGLUCosts:
    """A dense SwiGLU MLP (gate, up and down projections, their optional biases)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg  # a Llama-family config, which imports this module: not imported here

    def matmul_params(self) -> int:
        return 3 * self.cfg.hidden_size * self.cfg.intermediate_size

    def active_width(self) -> int:
        return self.cfg.intermediate_size

    def saved_per_token(self, es: int) -> int:
        return 4 * es * self.cfg.intermediate_size  # gate, silu(gate), up, and their product (down_proj's input)

    def backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        d, f = self.cfg.hidden_size, self.cfg.intermediate_size
        # down_proj's backward gives the gradient w.r.t. its input, the product (then freed); the product's
        # backward gives the gradients w.r.t. silu(gate) and up: two (N, f) more, and down_proj's gradient.
        # (The post-attention RMSNorm's fp32 backward can hold more where f is near d; not modelled.)
        return ((2 * es * f, d * f + (d if self.cfg.mlp_bias else 0), 0),)

    def frozen_saves(self, es: int, targets: frozenset[str], plain: bool, mlp_in: bool) -> tuple[int, dict[str, bool]]:
        d, f = self.cfg.hidden_size, self.cfg.intermediate_size
        saved = d * es if plain and targets & {"gate_proj", "up_proj"} else 0  # its input, the adapters'
        gate, up = mlp_in or "gate_proj" in targets, mlp_in or "up_proj" in targets
        saved += 2 * f * es if gate else 0  # silu's input and, for silu(gate)'s gradient, up
        saved += f * es if up else 0  # silu(gate), for up's gradient
        saved += f * es if plain and "down_proj" in targets else 0  # the product, down_proj's adapter input
        return saved, {"gate_proj": mlp_in, "up_proj": mlp_in, "down_proj": gate or up}

    def saved_after_per_token(self, es: int) -> int:
        return 0

    def group_backward_peaks(self, es: int, group: int) -> tuple[tuple[int, int, int], ...]:
        return ()

    def auxiliary_loss_bytes(self) -> int:
        return 0


class LlamaCosts(BaseCosts):
    """A Llama-family block (attention's variations are the config's class attributes; its MLP is `mlp`, the
    facet the config names) and head."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.mlp: MlpCosts = cfg.mlp_costs(cfg)

    def block_matmul_params(self) -> int:
        d, q, kv = self.cfg.hidden_size, self.cfg.attention_width, self.cfg.num_key_value_heads * self.cfg.head_dim
        return 2 * d * q + 2 * d * kv + self.mlp.matmul_params()

    def active_mlp_width(self) -> int:
        return self.mlp.active_width()

    def experts_saved_after_per_token(self, es: int) -> int:
        return self.mlp.saved_after_per_token(es)

    def expert_group_backward_peaks(self, es: int, group: int) -> tuple[tuple[int, int, int], ...]:
        return self.mlp.group_backward_peaks(es, group)

    def auxiliary_loss_bytes(self) -> int:
        return self.mlp.auxiliary_loss_bytes()

    def block_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        return self.mlp.backward_peaks(es)  # the MLP's backward, the block's first, holds the most

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
        return saved + self.mlp.saved_per_token(es)

    def block_saves_input(self, es: int) -> bool:
        return es == 4  # RMSNorm saves its fp32 input: in fp32 the input itself, else a copy

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
        mlp, mlp_inputs = self.mlp.frozen_saves(es, targets, plain, mlp_in)
        inputs = {"q_proj": grad_in, "k_proj": grad_in, "v_proj": grad_in, "o_proj": attention, **mlp_inputs}
        return FrozenBlockSaves(saved + mlp, attention, q_grad or k_grad, {t: inputs[t] for t in targets},
                                input_saved=grad_in and self.block_saves_input(es))  # input_layernorm's
