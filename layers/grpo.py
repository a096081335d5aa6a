"""Group Relative Policy Optimization's loss as TRL's GRPOTrainer computes it, an `Objective` of the head's chunked
loss; and the advantages it reads, from rewards normalized within each prompt's group of completions.

A row is a prompt and one of its completions, labels -100 but on the completion. Each completion token's loss is
-min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * kl, where ratio is
exp(logp - old_logp) (old_logp: the policy that made the completion; without it, logp itself detached, so the
ratio is 1 but its gradient is not zero), A the row's advantage and kl TRL's k3 estimate
exp(ref - logp) - (ref - logp) - 1 (times the ratio: TRL's bias correction). The loss types reduce the tokens'
losses as TRL's do. The gradient w.r.t. each token's log-probability is in closed form, so the forward saves one
fp32 number per position for the backward."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from layers.loss import Objective

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")  # TRL's names of the clipped-ratio losses
SCALE_REWARDS = ("group", "batch", "none")


@dataclass(frozen=True)
class GRPOLoss:
    """GRPO's loss settings, by TRL's GRPOConfig names. `epsilon_high` None is `epsilon` (TRL's default);
    `max_completion_length` is dr_grpo's divisor; `temperature` scales the logits the log-probabilities are taken
    from, as TRL's (the sampling temperature); `use_bias_correction_kl`: the KL weighted by the ratio (TRL's
    default)."""

    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    max_completion_length: int = 256
    temperature: float = 1.0
    use_bias_correction_kl: bool = True

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {self.loss_type!r}")
        if self.beta < 0 or self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError(f"beta, epsilon and epsilon_high must be >= 0; got {self.beta}, {self.epsilon}, "
                             f"{self.epsilon_high}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def upper(self) -> float:
        return 1 + (self.epsilon if self.epsilon_high is None else self.epsilon_high)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """(rows,) fp32 advantages of (rows,) summed rewards, each prompt's `num_generations` completions consecutive:
    the reward minus its group's mean, divided by the group's (or, "batch", the whole batch's) standard deviation
    plus 1e-4 unless scale_rewards is "none" (TRL's sum_then_normalize). A NaN reward (unscorable) is left out of
    the statistics and its advantage is 0."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}; got {scale_rewards!r}")
    rewards = rewards.float()
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    grouped = rewards.view(-1, num_generations)
    advantages = rewards - grouped.nanmean(dim=1).repeat_interleave(num_generations)
    if scale_rewards == "group":
        std = _nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = _nanstd(rewards, dim=0).expand_as(rewards)
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def _nanstd(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The unbiased standard deviation ignoring NaNs (TRL's nanstd)."""
    mean = t.nanmean(dim=dim, keepdim=True)
    variance = ((t - mean) ** 2).nanmean(dim=dim)
    count = (~t.isnan()).sum(dim=dim)
    return (variance * count / (count - 1)).sqrt()


class GRPOObjective(Objective):
    """One micro-batch's GRPO loss. `advantages` (rows,); `old` and `reference` (rows, T): each position's
    log-probability under the policy that sampled the completions and under the reference (None: the ratio's
    numerator detached, and no KL; beta > 0 needs `reference`), aligned as the head's log-probabilities (position t
    scores the token at t + 1). `rows` and `tokens`: the step's rows and completion tokens, over its micro-batches;
    `micro_batches`: how many there are (grpo, bnpo and dr_grpo divide each micro-batch's loss by it, as TRL's
    gradient accumulation)."""

    def __init__(self, loss: GRPOLoss, advantages: torch.Tensor, old: torch.Tensor | None,
                 reference: torch.Tensor | None, rows: float, tokens: float, micro_batches: int) -> None:
        if loss.beta and reference is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        self.loss, self.advantages = loss, advantages.float()
        self.old = None if old is None else old.float()
        self.reference = None if reference is None or not loss.beta else reference.float()
        self.rows, self.tokens, self.micro_batches = rows, tokens, micro_batches
        self.temperature = loss.temperature

    def _divisor(self, learned: torch.Tensor) -> torch.Tensor:
        """What the masked tokens' summed loss is divided by (rows: grpo's per-row mean is taken first)."""
        kind = self.loss.loss_type
        if kind == "grpo":
            return torch.tensor(self.rows, dtype=torch.float32)
        if kind == "bnpo":  # this micro-batch's tokens, then the mean over micro-batches
            return learned.sum().float().clamp(min=1.0) * self.micro_batches
        if kind == "dr_grpo":
            return torch.tensor(self.rows * self.loss.max_completion_length, dtype=torch.float32)
        return torch.tensor(max(self.tokens, 1.0), dtype=torch.float32)  # dapo: the step's tokens

    def forward(self, token_logps: torch.Tensor, learned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = learned.float()
        advantage = self.advantages.to(token_logps.device).unsqueeze(1)
        ratio = torch.ones_like(token_logps) if self.old is None else (token_logps - self.old).exp()
        clipped = ratio.clamp(1 - self.loss.epsilon_low, self.loss.upper)
        unclipped, kept = ratio * advantage, clipped * advantage
        token_loss = -torch.minimum(unclipped, kept)
        # d token_loss / d logp: -ratio * A through the unclipped term, and through the clipped one while the
        # ratio is inside the clip range; torch.minimum splits a tie's gradient, both halves alike then.
        inside = (ratio >= 1 - self.loss.epsilon_low) & (ratio <= self.loss.upper)
        grad = torch.where(unclipped < kept, -ratio * advantage,
                           torch.where(unclipped > kept, torch.where(inside, -ratio * advantage, 0.0),
                                       -ratio * advantage * (0.5 + 0.5 * inside.float())))
        if self.reference is not None:
            gap = self.reference - token_logps
            kl = gap.exp() - gap - 1
            kl_grad = 1 - gap.exp()
            if self.loss.use_bias_correction_kl:  # kl * ratio, whose derivative is ratio * (kl' + kl)
                kl, kl_grad = kl * ratio, ratio * (kl_grad + kl)
            token_loss = token_loss + self.loss.beta * kl
            grad = grad + self.loss.beta * kl_grad
        divisor = self._divisor(learned).to(token_logps.device)
        if self.loss.loss_type == "grpo":  # each row's mean over its tokens first
            length = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
            loss = ((token_loss * mask).sum(dim=1, keepdim=True) / length).sum() / divisor
            weight = mask / length / divisor
        else:
            loss = (token_loss * mask).sum() / divisor
            weight = mask / divisor
        # Minus the gradient of the micro-batch's loss w.r.t. each position's log-probability: all the backward keeps.
        return loss, -(grad * weight)

    def scale(self, saved: torch.Tensor | None, learned: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
        assert saved is not None
        return saved * grad_loss.float()


class TokenLogProbs(Objective):
    """Each position's log-probability of its target (0 where not learned), kept in `tokens` (rows, T): GRPO's old
    policy's and reference's; the loss is their sum. `temperature` as GRPOLoss's."""

    tokens: torch.Tensor | None = None

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = temperature

    def forward(self, token_logps: torch.Tensor, learned: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.tokens = token_logps
        return token_logps.sum(), None

    def scale(self, saved: torch.Tensor | None, learned: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
        return -learned.float() * grad_loss.float()
