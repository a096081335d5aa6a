"""gpt-oss's byte inputs for memory_model (torch-free): its sinks' probabilities, and its clamped experts with
biases, a sparse MLP's facet."""
from __future__ import annotations

from layers.costs import FrozenBlockSaves
from layers.llama.costs import LlamaCosts
from layers.moe.costs import SparseMlpCosts


class GptOssExpertsCosts(SparseMlpCosts):
    """gpt-oss's experts: a clamped SwiGLU of interleaved gate and up, with biases, over a router with a bias."""

    def saved_per_token(self, es: int) -> int:
        d, f, k = self.cfg.hidden_size, self.mlp.width, self.mlp.num_experts_per_tok
        # The top-k's int64 indices and the softmax over them. Per routed token: its gathers' int64 indices (its
        # token's row, each projection's bias, its place back in (token, choice) order), its input row (the
        # gate/up matmul's), the gate/up output (the clamps' input), sigmoid's output, the clamped gate, up + 1,
        # the gated product and their product (down's input): 2f + 5f; its output and routing weight.
        return 8 * k + es * k + k * (32 + es * (2 * d + 7 * f))

    def backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        d, k, experts = self.cfg.hidden_size, self.mlp.num_experts_per_tok, self.mlp.num_experts
        weighting, product, gate_up = super().backward_peaks(es)
        # The clamped SwiGLU's backward, as the other mixtures' SwiGLU's, but for the down bias's gather index
        # also gone, the routing weights' gradient made, and down's bias gradient with its weight's.
        per_token, params, fixed = product
        return weighting, (per_token - 8 * k + es * k, params + experts * d, fixed), gate_up

    def frozen_saves(self, es: int, targets: frozenset[str], plain: bool, mlp_in: bool) -> tuple[int, dict[str, bool]]:
        d, f, k = self.cfg.hidden_size, self.mlp.width, self.mlp.num_experts_per_tok
        if not mlp_in:
            return 0, {}
        # Frozen experts keep no matmul input and no bias index: per routed token its two other gathers'
        # indices, the gate/up output, the activation's four and its output (the routing weights' multiplier).
        return 8 * k + es * k + k * (16 + es * (6 * f + d)), {}


class GptOssCosts(LlamaCosts):
    """gpt-oss's block: attention with a sink per head, whose scores are made whole; its MLP is
    `GptOssExpertsCosts`."""

    def block_saved_per_token(self, es: int) -> int:
        d, q = self.cfg.hidden_size, self.cfg.attention_width
        # Each RMSNorm: its fp32 input, rstd and fp32 normalised values (the weight multiplies in fp32), and its
        # output cast back (the next matmuls' input). Attention: rotated q, k and v repeated to every query head,
        # and its output (o_proj's input); its probabilities are per key (memory_model.shapes).
        return 2 * (8 * d + 4 + es * d) + 4 * es * q + self.mlp.saved_per_token(es)

    def scores_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        d, q, kv = self.cfg.hidden_size, self.cfg.attention_width, self.cfg.num_key_value_heads * self.cfg.head_dim
        # The softmax's backward: besides its two gradients, v's at every query head and the residual's; the MLP's
        # saved tensors, the post-attention norm's, o_proj's input, v repeated to every head and the incoming
        # gradient w.r.t. attention's output gone; every weight gradient but q/k/v_proj's, the sinks' and the
        # first norm's made.
        attention_in = d * q + q + 2 * (d * kv + kv) + self.cfg.num_attention_heads + d
        return ((-(self.mlp.saved_per_token(es) + 8 * d + 4 + es * q), self.cfg.params().block() - attention_in, 0),)

    def head_saved_per_token(self, es: int, frozen: bool = False) -> int:
        # The final RMSNorm: its fp32 input, rstd, the fp32 normalised values (for its weight's gradient only),
        # and its output cast back (lm_head's input)
        return 4 * self.cfg.hidden_size + 4 + (0 if frozen else 4 * self.cfg.hidden_size) + es * self.cfg.hidden_size

    def frozen_block_saves(self, es: int, targets: frozenset[str], plain: bool, grad_in: bool) -> FrozenBlockSaves:
        d, q = self.cfg.hidden_size, self.cfg.attention_width
        norm = 4 * d + 4  # a frozen RMSNorm: its fp32 input and rstd, where its input needs a gradient
        q_grad, k_grad = grad_in or "q_proj" in targets, grad_in or "k_proj" in targets
        scores = q_grad or k_grad  # the scores need a gradient: the mask and the rotary tables are saved
        attention = scores or grad_in or "v_proj" in targets  # its probabilities are saved
        saved = norm if grad_in else 0  # input_layernorm
        saved += d * es if plain and targets & {"q_proj", "k_proj", "v_proj"} else 0  # its output, the adapters'
        # Unlike SDPA, the scores' matmul keeps only what a gradient needs: q for k's, k repeated for q's; the
        # probabilities' keeps v repeated for theirs.
        saved += es * q * (int(k_grad) + int(q_grad) + int(scores))
        saved += es * q if plain and "o_proj" in targets else 0  # attention's output, o_proj's adapter input
        mlp_in = grad_in or attention or "o_proj" in targets  # the residual after attention needs a gradient
        saved += norm if mlp_in else 0  # post_attention_layernorm
        mlp, mlp_inputs = self.mlp.frozen_saves(es, targets, plain, mlp_in)
        inputs = {"q_proj": grad_in, "k_proj": grad_in, "v_proj": grad_in, "o_proj": attention, **mlp_inputs}
        return FrozenBlockSaves(saved + mlp, attention, scores, {t: inputs[t] for t in targets},
                                input_saved=grad_in and self.block_saves_input(es), scores=scores)
