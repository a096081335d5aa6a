"""Direct Preference Optimization's loss as TRL's DPOTrainer computes it, an `Objective` of the head's chunked loss.

A micro-batch holds its pairs' chosen rows, then their rejected rows (TRL's order). A row's log-probability is
the sum over its learned (completion) positions. Each pair's loss is a function of
delta = (chosen - ref_chosen) - (rejected - ref_rejected); the step's loss is its pairs' mean. The gradient
w.r.t. each row's log-probability is in closed form, so the forward saves one fp32 number per row for the
backward and nothing else."""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from layers.loss import Objective


class PreferenceLoss(Protocol):
    """DPO's settings as TRL's DPOConfig names them (memory_model.objective.ObjectiveConfig)."""

    # Read-only members, so that the frozen ObjectiveConfig satisfies them.
    @property
    def beta(self) -> float: ...
    @property
    def loss_type(self) -> str: ...  # sigmoid, ipo, hinge or robust
    @property
    def label_smoothing(self) -> float: ...  # read by robust alone: the probability a preference is flipped


def pair_loss(loss: PreferenceLoss, delta: torch.Tensor, avg_delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's loss and its derivative (fp32), by TRL's formulas: w.r.t. delta, or for ipo w.r.t. `avg_delta`,
    delta from log-probabilities averaged over each row's completion tokens, which ipo reads instead."""
    beta, eps = loss.beta, loss.label_smoothing
    z = beta * delta
    if loss.loss_type == "sigmoid":
        return -F.logsigmoid(z), -beta * torch.sigmoid(-z)
    if loss.loss_type == "hinge":
        return torch.relu(1 - z), torch.where(1 - z > 0, -beta, 0.0)
    if loss.loss_type == "ipo":
        gap = avg_delta - 1 / (2 * beta)
        return gap ** 2, 2 * gap
    if loss.loss_type == "robust":
        value = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
        return value, beta * (-(1 - eps) * torch.sigmoid(-z) - eps * torch.sigmoid(z)) / (1 - 2 * eps)
    raise ValueError(f"unknown DPO loss type {loss.loss_type!r}")


class DPOObjective(Objective):
    """One micro-batch's DPO loss: its pairs' summed loss over `pairs`, the step's pairs (over its micro-batches
    and processes), so that the step's loss is their mean. `reference` (rows,): the reference model's
    log-probability of each row, or None where the step computes it in its own forward (`reference_in_step`);
    `lengths` (rows,): each row's completion tokens (ipo averages over them)."""

    def __init__(self, loss: PreferenceLoss, reference: torch.Tensor | None, lengths: torch.Tensor,
                 pairs: float) -> None:
        self.reference = None if reference is None else reference.float()
        self.reference_in_step = reference is None
        self.loss, self.lengths, self.pairs = loss, lengths.float(), pairs
        self._metrics: dict[str, torch.Tensor] = {}

    def take_reference(self, token_logps: torch.Tensor, learned: torch.Tensor) -> None:
        self.reference = token_logps.sum(dim=1)  # as `forward` sums the policy's

    @staticmethod
    def saved_bytes(rows: int) -> int:
        return 4 * rows  # d loss / d each row's log-probability, fp32

    def forward(self, token_logps: torch.Tensor, learned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logps = token_logps.sum(dim=1)  # (rows,), as TRL sums its per-token log-probabilities
        chosen, rejected = logps.chunk(2)
        assert self.reference is not None  # given, or taken in the step's forward before this
        ref_chosen, ref_rejected = self.reference.chunk(2)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        length = self.lengths.clamp(min=1.0)
        chosen_length, rejected_length = length.chunk(2)
        delta = chosen_ratio - rejected_ratio
        per_pair, grad = pair_loss(self.loss, delta, chosen_ratio / chosen_length - rejected_ratio / rejected_length)
        if self.loss.loss_type == "ipo":  # d delta-averaged / d each row
            row_grad = torch.cat([grad / chosen_length, -grad / rejected_length])
        else:
            row_grad = torch.cat([grad, -grad])
        beta = self.loss.beta
        chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
        self._metrics = {"rewards/chosen": chosen_rewards.sum(), "rewards/rejected": rejected_rewards.sum(),
                         "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
                         "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
                         "logps/chosen": chosen.sum(), "logps/rejected": rejected.sum(),
                         "pairs": torch.tensor(float(chosen.numel()), device=logps.device)}
        # The gradient of the micro-batch's loss, a fresh (rows,) tensor: the one thing its backward keeps.
        return per_pair.sum() / self.pairs, -(row_grad / self.pairs)

    def scale(self, saved: torch.Tensor | None, learned: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
        assert saved is not None  # forward saved each row's gradient
        return learned.float() * (saved * grad_loss.float()).unsqueeze(1)

    def metrics(self) -> dict[str, torch.Tensor]:
        return self._metrics


class RowLogProbs(Objective):
    """Each row's log-probability, summed over its learned positions, kept in `rows` (the reference model's, for
    DPO); the loss is their sum."""

    rows: torch.Tensor | None = None

    def forward(self, token_logps: torch.Tensor, learned: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.rows = token_logps.sum(dim=1)
        return self.rows.sum(), None

    def scale(self, saved: torch.Tensor | None, learned: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
        return -learned.float() * grad_loss.float()
