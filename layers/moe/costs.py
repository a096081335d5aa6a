"""A sparse mixture-of-experts MLP's byte and FLOP inputs for memory_model (torch-free), the MLP facet of a
Llama-family block (`layers.llama.costs.MlpCosts`): routed tokens, no padding per expert; a LoRA run's with adapters
on the experts; the load-balancing loss's bytes."""
from __future__ import annotations

from typing import Any


class SparseMlpCosts:
    """A sparse mixture of experts. A token goes through the router and its `num_experts_per_tok` experts only: its
    FLOPs and elementwise work (`active_width`) are those, and what the experts save is per routed token whatever
    the routing, since nothing is padded per expert."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg  # a mixture's config, which imports this module: not imported here
        self.mlp = cfg.sparse_mlp  # its block's sparse MLP (layers.config.SparseMlp)

    def auxiliary_loss_bytes(self) -> int:
        # The load balance's fp32 sums over the forward: each expert's count of choices and its probabilities.
        return 2 * 4 * self.mlp.num_experts if self.mlp.output_router_logits else 0

    def matmul_params(self) -> int:
        d, f = self.cfg.hidden_size, self.mlp.width
        return self.mlp.num_experts * d + self.mlp.num_experts_per_tok * 3 * d * f  # the router, then k experts

    def active_width(self) -> int:
        return self.mlp.num_experts_per_tok * self.mlp.width

    def routing_saved(self) -> int:
        """Per token: the router's fp32 probabilities (softmax's output), the chosen experts (top-k's int64
        indices), and, where renormalised, the chosen probabilities and their sum (the division's operands)."""
        k = self.mlp.num_experts_per_tok
        return 4 * self.mlp.num_experts + 8 * k + ((4 * k + 4) if self.mlp.norm_topk_prob else 0)

    def saved_per_token(self, es: int) -> int:
        d, f, k = self.cfg.hidden_size, self.mlp.width, self.mlp.num_experts_per_tok
        # Per routed token: its token's index (the gather of the experts' inputs) and its place in (token,
        # choice) order (the gather of their outputs), int64 each; its input row (the gate/up matmul's), gate and
        # up (silu's input), silu(gate), their product (down's input), the expert's output and its routing
        # weight (the weighting product's operands).
        return self.routing_saved() + k * (16 + es * (2 * d + 4 * f) + es)

    def saved_after_per_token(self, es: int) -> int:
        # Per routed token: its place in (token, choice) order, the expert's output and its routing weight.
        return self.mlp.num_experts_per_tok * (8 + es * self.cfg.hidden_size + es)

    def backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        return self.group_backward_peaks(es, self.mlp.num_experts)

    def group_backward_peaks(self, es: int, group: int) -> tuple[tuple[int, int, int], ...]:
        # Per token as if every routed token chose this group's experts: what a group's rows hold depends on the
        # routing, and the bound is what both the runtime's charge and the plan can state.
        d, f, k, experts = self.cfg.hidden_size, self.mlp.width, self.mlp.num_experts_per_tok, group
        # The backward of the weighting by the routing weights: the gradient w.r.t. the routed outputs, the
        # product that gives the weights' gradient, and that gradient. Then the SwiGLU product's backward: the
        # gradient w.r.t. its input, silu(gate)'s and up's, and down's weight gradient, when the routed outputs,
        # their gradient, the product itself and the gather's indices are gone. Then the gate/up matmul's:
        # its input's gradient and its weight's, when silu's input and output and the last gradients are gone.
        return ((2 * es * k * d + es * k, 0, 0),
                (2 * es * k * f - es * k * d - 8 * k, experts * d * f, 0),
                (-2 * es * k * f - 8 * k, 3 * experts * d * f, 0))

    def frozen_saves(self, es: int, targets: frozenset[str], plain: bool, mlp_in: bool) -> tuple[int, dict[str, bool]]:
        d, f, k = self.cfg.hidden_size, self.mlp.width, self.mlp.num_experts_per_tok
        gate_up, down = "experts.gate_up_proj" in targets, "experts.down_proj" in targets
        routed = mlp_in or gate_up  # gate and up need a gradient
        # Frozen experts keep no matmul input but their adapters' (the routed input rows, the product). Per routed
        # token: where the input needs a gradient, its gather's indices and the expert's output (the routing
        # weight needs one too); where the outputs need one, their gather's indices and the routing weight (the
        # weighting product's operands); gate and up (silu's input), silu(gate).
        per_routed = 8 + es * d if mlp_in else 0
        per_routed += 8 + es if routed or down else 0
        per_routed += es * d if gate_up else 0
        per_routed += 3 * f * es if routed else 0
        per_routed += f * es if down else 0
        return ((self.routing_saved() if mlp_in else 0) + k * per_routed,
                {"experts.gate_up_proj": mlp_in, "experts.down_proj": routed})
