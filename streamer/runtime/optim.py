"""The optimizer's settings (`OptimizerConfig`), its learning-rate schedule (`LRSchedule`) and the AdamW update
of one chunk of a unit's flat state, with torch's own Adam kernels."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.adam import adam

from memory_model.shapes import PlanConfig
from memory_model.settings import Choice, Integer, Number, Pair, check_settings, same_setting, setting
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
    max_grad_norm: float = setting(1.0, "clip gradients to this global norm (0: no clipping)", Number(0.0))
    moment_dtype: str = same_setting(PlanConfig, "moment_dtype")  # the planner prices the store's moments too
    nonfinite: str = setting("stop", "on a non-finite loss or gradient: stop the run, or skip the step "
                                     "(nothing is updated; the next batch follows)", Choice(NONFINITE_POLICIES),
                             "POLICY")

    def __post_init__(self) -> None:
        check_settings(self, ConfigError.of)


SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LRSchedule:
    """constant, or linear warmup then cosine / linear decay to min_lr_ratio * lr at total_steps."""

    kind: str = setting("constant", "learning-rate schedule after warmup: constant, cosine or linear",
                        Choice(SCHEDULES), "KIND")
    warmup_steps: int = setting(0, "linear warmup steps", Integer(0))
    total_steps: int | None = setting(None, "the step the decay ends at", Integer(0))
    min_lr_ratio: float = setting(0.0, "the cosine/linear schedule ends at this fraction of --lr", Number(0.0, 1.0))

    def __post_init__(self) -> None:
        check_settings(self, ConfigError.of)
        if self.kind != "constant" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ConfigError(f"a {self.kind} schedule needs total_steps > warmup_steps ({self.warmup_steps})")

    def lr_at(self, step: int, base_lr: float) -> float:
        """Learning rate of optimizer step `step` (1-based, as torch counts Adam steps).

        Identical to Hugging Face's schedulers (transformers.get_constant_schedule_with_warmup,
        get_linear_schedule_with_warmup, get_cosine_schedule_with_warmup and, with min_lr_ratio,
        get_cosine_with_min_lr_schedule_with_warmup(min_lr_rate=...)), whose lambda at scheduler index step - 1
        sets the lr of optimizer step `step`: so step 1 of a warmup trains at lr 0. The same float operations in
        the same order make the values bit-equal. HF has no linear schedule with a floor: ours scales the linear
        factor as its cosine does, factor * (1 - min_lr_ratio) + min_lr_ratio, so min_lr_ratio 0 is HF's
        linear exactly (and any ratio is get_polynomial_decay_schedule_with_warmup(power=1, lr_end=ratio * lr)
        up to rounding). Past total_steps the decay stays at its end value.
        """
        current = step - 1
        if current < self.warmup_steps:
            return base_lr * (float(current) / float(max(1, self.warmup_steps)))
        if self.kind == "constant":
            return base_lr * 1.0
        assert self.total_steps is not None
        current = min(current, self.total_steps)
        decay_steps = float(max(1, self.total_steps - self.warmup_steps))
        if self.kind == "cosine":
            progress = float(current - self.warmup_steps) / decay_steps
            factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
        else:
            factor = max(0.0, float(self.total_steps - current) / decay_steps)
        return base_lr * max(0, factor * (1 - self.min_lr_ratio) + self.min_lr_ratio)


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
