"""Phi-3's byte inputs for memory_model (torch-free): Llama's, with fused projections."""
from __future__ import annotations

from layers.costs import FrozenBlockSaves
from layers.llama.costs import LlamaCosts


class Phi3Costs(LlamaCosts):
    """Phi-3's block: Llama's, with q, k and v in one projection and the gate and up in one."""

    def _v_saved(self) -> int:
        """The features per token of the storage SDPA's v is: a copy per query head under grouped-query
        attention, else a view of qkv_proj's whole output."""
        q, kv = self.cfg.attention_width, self.cfg.num_key_value_heads * self.cfg.head_dim
        return q if self.cfg.num_key_value_heads != self.cfg.num_attention_heads else q + 2 * kv

    def block_saved_per_token(self, es: int) -> int:
        d, q, f = self.cfg.hidden_size, self.cfg.attention_width, self.cfg.intermediate_size
        # Each RMSNorm: its fp32 input, rstd, the normalised values; its output (the next matmul's input).
        saved = 2 * (4 * d + 4 + 2 * es * d)
        saved += es * (3 * q + self._v_saved())  # rotated q, k repeated to every query head, v, SDPA's output
        # gate_up_proj's output (silu's input and up), silu(gate), and the product (down_proj's input)
        return saved + 4 * es * f

    def frozen_block_saves(self, es: int, targets: frozenset[str], plain: bool, grad_in: bool) -> FrozenBlockSaves:
        d, q, f = self.cfg.hidden_size, self.cfg.attention_width, self.cfg.intermediate_size
        norm = 4 * d + 4  # a frozen RMSNorm keeps its fp32 input and rstd where its input needs a gradient
        attention = grad_in or "qkv_proj" in targets  # q, k and v need a gradient together or not at all
        saved = norm if grad_in else 0  # input_layernorm
        saved += d * es if plain and "qkv_proj" in targets else 0  # its output, the adapter's input
        saved += es * (3 * q + self._v_saved()) if attention else 0  # SDPA's inputs and output
        saved += q * es if not attention and plain and "o_proj" in targets else 0  # o_proj's adapter input
        mlp_in = attention or "o_proj" in targets  # the residual after attention needs a gradient
        saved += norm if mlp_in else 0  # post_attention_layernorm
        saved += d * es if plain and "gate_up_proj" in targets else 0  # its output, the adapter's input
        gate_up = mlp_in or "gate_up_proj" in targets
        saved += 3 * f * es if gate_up else 0  # gate_up_proj's output (silu's input, up) and silu(gate)
        saved += f * es if plain and "down_proj" in targets else 0  # the product, down_proj's adapter input
        inputs = {"qkv_proj": grad_in, "o_proj": attention, "gate_up_proj": mlp_in, "down_proj": gate_up}
        return FrozenBlockSaves(saved, attention, attention, {t: inputs[t] for t in targets},
                                input_saved=grad_in and self.block_saves_input(es))  # input_layernorm's
