"""Causal-LM loss with Hugging Face semantics."""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of position t predicting labels[t+1]; labels equal to -100 are not counted.

    logits: (B, T, vocab), labels: (B, T). The shift happens here, as in HF's ForCausalLMLoss.
    """
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # (B, T)
    return F.cross_entropy(logits.float().flatten(0, 1), shifted.flatten(), ignore_index=IGNORE_INDEX)
