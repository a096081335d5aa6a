"""The AdamW update of one chunk of a unit's flat state, with torch's own Adam kernels."""
from __future__ import annotations

import torch
from torch.optim.adam import adam

from streamer.config import TrainerConfig


def adamw_chunk(state: dict[str, torch.Tensor], start: int, decay_end: int, tc: TrainerConfig,
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
