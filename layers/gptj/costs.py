"""GPT-J's byte and FLOP inputs for memory_model (torch-free); on the CPU its LayerNorms keep mean and rstd in the
input dtype."""
from __future__ import annotations

from layers.costs import BaseCosts, FrozenBlockSaves


class GPTJCosts(BaseCosts):
    """GPT-J's block (parallel attention and MLP after one LayerNorm) and head."""

    def block_matmul_params(self) -> int:
        return 4 * self.cfg.n_embd ** 2 + 2 * self.cfg.n_embd * self.cfg.intermediate_size

    def block_saved_per_token(self, es: int) -> int:
        d, f = self.cfg.n_embd, self.cfg.intermediate_size
        return es * (d  # h: the block input, saved by ln_1
                     + d  # x = ln_1(h), shared by q/k/v_proj and fc_in
                     + 4 * d  # rotated q and k, v, and the attention output (saved by SDPA and out_proj)
                     + 2 * f  # fc_in output (gelu's input) and gelu output (fc_out's input)
                     + 2)  # LayerNorm mean, rstd

    def block_saves_input(self, es: int) -> bool:
        return True  # ln_1 saves h

    def block_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        d, f = self.cfg.n_embd, self.cfg.intermediate_size
        # The MLP's backward runs first. fc_out's gives the gradient w.r.t. gelu's output; gelu's output is freed
        # as gelu's backward adds the gradient w.r.t. its input: one (N, f) more, and fc_out's gradient.
        mlp = (es * f, d * f + d, 0)
        # SDPA's backward: dq, dk, dv, the gradient w.r.t. the attention output and the MLP's share of the
        # gradient w.r.t. x; the MLP's saved (N, f) pair is gone. The MLP's and out_proj's gradients exist.
        attention = (es * (5 * d - 2 * f), 2 * d * f + d + f + d * d, 0)
        return mlp, attention

    def head_saved_per_token(self, es: int, frozen: bool = False) -> int:
        # LayerNorm's kernel saves the same whether its weights need a gradient or not.
        return es * (2 * self.cfg.n_embd + 2)  # h (ln_f's input), ln_f's output (the loss's input); mean, rstd

    def frozen_block_saves(self, es: int, targets: frozenset[str], plain: bool, grad_in: bool) -> FrozenBlockSaves:
        d, f = self.cfg.n_embd, self.cfg.intermediate_size
        attention = grad_in or bool(targets & {"q_proj", "k_proj", "v_proj"})  # SDPA's inputs need a gradient
        saved = (d + 2) * es if grad_in else 0  # h and ln_1's mean and rstd
        saved += d * es if plain and targets & {"q_proj", "k_proj", "v_proj", "fc_in"} else 0  # x, the adapters'
        saved += 3 * d * es if attention else 0  # rotated q and k, v
        saved += d * es if attention or (plain and "out_proj" in targets) else 0  # the attention output
        saved += f * es if grad_in or "fc_in" in targets else 0  # gelu's input
        saved += f * es if plain and "fc_out" in targets else 0  # gelu's output, fc_out's adapter input
        # ln_1's output feeds attention and the MLP alike (parallel residual).
        input_grad = {t: grad_in or (t == "out_proj" and attention) or (t == "fc_out" and "fc_in" in targets)
                      for t in targets}
        return FrozenBlockSaves(saved, attention, grad_in or bool(targets & {"q_proj", "k_proj"}), input_grad,
                                input_saved=grad_in)  # ln_1's input, where it needs a gradient
