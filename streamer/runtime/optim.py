"""The optimizer's settings (`OptimizerConfig`) and the AdamW update of one chunk of a unit's flat state, with
torch's own Adam kernels."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.adam import adam

from memory_model.shapes import PlanConfig
from memory_model.settings import Choice, Number, Pair, check_settings, same_setting, setting
from streamer.errors import ConfigError

NONFINITE_POLICIES = ("stop", "skip")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, gradient clipping, the moments' dtype in the store, and what a non-finite step does."""

    lr: float = setting(1e-4, "peak learning rate", Number(0.0, low_open=True))
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW's moment decay rates, each in [0, 1): B1,B2 or B1 B2",
                                         Pair(Number(0.0, 1.0, high_open=True)))
    eps: float = setting(1e-8, "AdamW's epsilon, added to the root of the second moment", Number(0.0, low_open=True))
    weight_decay: float = setting(0.1, "AdamW weight decay (matrices only)", Number(0.0))
    # None: no clipping. `streamer train --max-grad-norm` says 0 instead (a flag cannot be None), so the run
    # declares its own flag and passes `or None`.
    max_grad_norm: float | None = 1.0
    moment_dtype: str = same_setting(PlanConfig, "moment_dtype")  # the planner prices the store's moments too
    nonfinite: str = setting("stop", "on a non-finite loss or gradient: stop the run, or skip the step "
                                     "(nothing is updated; the next batch follows)", Choice(NONFINITE_POLICIES),
                             "POLICY")

    def __post_init__(self) -> None:
        check_settings(self, ConfigError.of)
        if self.max_grad_norm is not None and (isinstance(self.max_grad_norm, bool) or not isinstance(
                self.max_grad_norm, (int, float)) or not self.max_grad_norm > 0 or math.isinf(self.max_grad_norm)):
            raise ConfigError(f"max_grad_norm must be > 0 or None (no clipping), got {self.max_grad_norm!r}")


def adamw_chunk(state: dict[str, torch.Tensor], start: int, decay_end: int, tc: OptimizerConfig,
                step: int, lr: float, clip_coef: float) -> None:
    """Update master/exp_avg/exp_avg_sq in place from grad for elements [start, start + n) of a unit.

    Elements before `decay_end` are matrices and embeddings (decayed); the rest are biases and LayerNorm
    parameters (not decayed). AdamW is elementwise, so a flat chunk gives what per-parameter tensors give.
    """
    grad = state["grad"]
    if clip_coef != 1.0:
        grad.mul_(clip_coef)
    count = grad.numel()
    split = min(max(decay_end - start, 0), count)
    device = grad.device
    # torch's fused kernel makes one pass over the state (6x the single-tensor path on this CPU); meta has none.
    fused = device.type in ("cpu", "cuda")
    for lo, hi, weight_decay in ((0, split, tc.weight_decay), (split, count, 0.0)):
        if lo == hi:
            continue
        # adam() advances the step tensor itself: hand it the count before this step.
        steps = [torch.tensor(float(step - 1), device=device if fused else "cpu")]
        adam([state["master"][lo:hi]], [grad[lo:hi]], [state["exp_avg"][lo:hi]], [state["exp_avg_sq"][lo:hi]],
             [], steps, foreach=False, fused=fused or None, decoupled_weight_decay=True, amsgrad=False,
             beta1=tc.betas[0], beta2=tc.betas[1], lr=lr, weight_decay=weight_decay, eps=tc.eps, maximize=False)
