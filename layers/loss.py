"""Causal-LM loss with Hugging Face semantics, from full logits or from the head's input in vocabulary chunks; the
`Objective` the head's chunked loss makes of each learned position's log-probability (the token mean here;
preference objectives in layers/preference.py)."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """labels[t+1] as the target of position t, -100 after the last (HF's ForCausalLMLoss shift). A tensor of
    its own, B x T: a slice of a padded one would keep B x (T + 1) alive where the loss saves it flattened as a
    view (one row)."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[..., :-1] = labels[..., 1:]
    return shifted


def learned_tokens(labels: torch.Tensor) -> int:
    """How many positions of labels (B, T) a loss counts: the targets after the shift that are not -100."""
    return int((shift_labels(labels) != IGNORE_INDEX).sum())


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items: float | None = None) -> torch.Tensor:
    """Mean cross-entropy of position t predicting labels[t+1]; labels equal to -100 are not counted.

    logits: (B, T, vocab), labels: (B, T). The shift happens here, as in HF's ForCausalLMLoss. With
    `num_items` the summed cross-entropy is divided by it instead of by this batch's count (HF's
    num_items_in_batch: the learned tokens of a whole step, over its micro-batches and processes).
    """
    targets = shift_labels(labels).flatten()
    if num_items is None:
        return F.cross_entropy(logits.float().flatten(0, 1), targets, ignore_index=IGNORE_INDEX)
    return F.cross_entropy(logits.float().flatten(0, 1), targets, ignore_index=IGNORE_INDEX,
                           reduction="sum") / num_items


class Objective(ABC):
    """What a micro-batch's loss makes of its learned positions' log-probabilities, as the head's chunked loss
    computes them (`chunked_objective_loss`). The loss's gradient w.r.t. a position's log-probability is all the
    backward needs of it: the logits' gradient is that times (one-hot - softmax). `temperature` divides the logits
    the log-probabilities are taken from (GRPO's sampling temperature, as TRL scores completions)."""

    temperature: float = 1.0
    # The step computes the reference model's log-probabilities in its own forward and hands them to
    # `take_reference` before `forward`: LoRA's base with the adapters off, each unit loaded once serving both.
    reference_in_step: bool = False

    @abstractmethod
    def forward(self, token_logps: torch.Tensor, learned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss from token_logps (B, T) fp32, each position's log-probability of its (shifted) target and 0
        where `learned` (B, T) is False; and what the backward needs of the forward (None: nothing), saved for it."""

    @abstractmethod
    def scale(self, saved: torch.Tensor | None, learned: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
        """Minus the gradient of the loss w.r.t. each position's log-probability, (B, T) fp32 (or broadcastable),
        given the incoming gradient `grad_loss` and what `forward` saved."""

    @staticmethod
    def saved_bytes(rows: int) -> int:
        """The bytes `forward` saves for a micro-batch of `rows` rows (the planner prices them as the head's)."""
        return 0

    def metrics(self) -> dict[str, torch.Tensor]:
        """What the last `forward` measured beside the loss, each summed over its micro-batch (none here)."""
        return {}

    def take_reference(self, token_logps: torch.Tensor, learned: torch.Tensor) -> None:
        """The reference model's token_logps (as `forward` takes them), where `reference_in_step`."""
        raise NotImplementedError(f"{type(self).__name__} takes no reference computed in the step")


class ReferenceOf(Objective):
    """A reference model's pass over the head for `target`, whose `reference_in_step` says the step computes its
    reference: hands the reference's log-probabilities to it (no gradient: the loss is their sum)."""

    def __init__(self, target: Objective) -> None:
        self.target, self.temperature = target, target.temperature

    def forward(self, token_logps: torch.Tensor, learned: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.target.take_reference(token_logps, learned)
        return token_logps.sum(), None

    def scale(self, saved: torch.Tensor | None, learned: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
        return -learned.float() * grad_loss.float()


class TokenMean(Objective):
    """The causal-LM loss: the summed cross-entropy over the learned positions, divided by `num_items` (the step's
    learned tokens, HF's num_items_in_batch) or, without it, by this micro-batch's own count."""

    def __init__(self, num_items: float | None = None) -> None:
        self.num_items = num_items

    def _divisor(self, learned: torch.Tensor) -> torch.Tensor | float:
        return learned.sum() if self.num_items is None else self.num_items

    def forward(self, token_logps: torch.Tensor, learned: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -token_logps.sum() / self._divisor(learned), None

    def scale(self, saved: torch.Tensor | None, learned: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
        return learned.float() * (grad_loss.float() / self._divisor(learned))


def chunked_lm_loss(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                    vocab_chunk: int, num_items: float | None = None) -> torch.Tensor:
    """causal_lm_loss(F.linear(x, weight, bias), labels, num_items) without the (B, T, vocab) logits or their
    gradient (`chunked_objective_loss` with the token mean)."""
    return chunked_objective_loss(x, weight, bias, labels, vocab_chunk, TokenMean(num_items))


def chunked_objective_loss(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                           vocab_chunk: int, objective: Objective) -> torch.Tensor:
    """`objective`'s loss of the log-probabilities of F.linear(x, weight, bias) at labels (shifted, -100 not
    learned), without the (B, T, vocab) logits or their gradient.

    The logits are computed `vocab_chunk` vocabulary rows at a time: the forward keeps only each position's
    log-sum-exp, and the backward computes each chunk's logits again to form its gradient. Every weight row's
    gradient is still one matmul over all positions; the input's gradient is summed over the chunks in fp32.
    Where one chunk holds the whole vocabulary, the forward keeps its fp32 logits instead, and the backward
    turns them into their gradient in place: the backward's peak is unchanged and one matmul is saved.
    """
    return _ChunkedLMLoss.apply(x.flatten(0, 1), weight, bias, shift_labels(labels).flatten(), vocab_chunk,
                                objective, labels.shape)


def _vocab_slices(vocab: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk, vocab)) for lo in range(0, vocab, chunk)]


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lo: int, hi: int,
                  temperature: float = 1.0) -> torch.Tensor:
    """fp32 logits of vocabulary rows [lo, hi): the compute-dtype linear, then the cast (as the heads do), divided
    by `temperature` where it is not 1."""
    logits = F.linear(x, weight[lo:hi], None if bias is None else bias[lo:hi]).float()  # (N, hi - lo)
    return logits if temperature == 1.0 else logits.div_(temperature)


def _in_chunk(targets: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which targets fall in [lo, hi), and their column there (clamped, so gather works on every row and
    on meta tensors, where a boolean index cannot be sized)."""
    return (targets >= lo) & (targets < hi), (targets - lo).clamp(0, hi - lo - 1).unsqueeze(1)


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                vocab_chunk: int, objective: Objective, shape: torch.Size) -> torch.Tensor:
        n = x.shape[0]
        lse_parts, target_logit = [], x.new_zeros(n, dtype=torch.float32)
        kept: tuple[torch.Tensor, ...] = ()
        for lo, hi in _vocab_slices(weight.shape[0], vocab_chunk):
            logits = _chunk_logits(x, weight, bias, lo, hi, objective.temperature)
            lse_parts.append(torch.logsumexp(logits, dim=1))
            inside, column = _in_chunk(targets, lo, hi)
            target_logit = torch.where(inside, logits.gather(1, column).squeeze(1), target_logit)
            kept = (logits,) if hi - lo == weight.shape[0] else ()
            del logits
        lse = torch.logsumexp(torch.stack(lse_parts), dim=0)  # (N,) fp32
        valid = targets != IGNORE_INDEX
        loss, saved = objective.forward(torch.where(valid, target_logit - lse, 0.0).view(shape), valid.view(shape))
        ctx.vocab_chunk, ctx.objective, ctx.shape, ctx.saved = vocab_chunk, objective, shape, saved is not None
        ctx.save_for_backward(x, weight, bias, targets, lse, *((saved,) if saved is not None else ()), *kept)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias, targets, lse, *kept = ctx.saved_tensors
        saved = kept.pop(0) if ctx.saved else None
        valid = (targets != IGNORE_INDEX).view(ctx.shape)
        # d loss / d logit = (softmax - onehot) times minus d loss / d log-probability of the position.
        row_scale = ctx.objective.scale(saved, valid, grad_loss).expand(ctx.shape).reshape(-1, 1)  # (N, 1)
        temperature = ctx.objective.temperature
        if temperature != 1.0:  # the chain rule through logits / temperature
            row_scale = row_scale / temperature
        # A frozen head (LoRA's base) gets no weight gradient: autograd would drop it after it was made.
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if needs_x else None
        grad_weight = torch.empty_like(weight) if needs_weight else None
        grad_bias = torch.empty_like(bias) if bias is not None and needs_bias else None
        for lo, hi in _vocab_slices(weight.shape[0], ctx.vocab_chunk):
            logits = kept.pop() if kept else _chunk_logits(x, weight, bias, lo, hi, temperature)
            grad = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, fp32, in place of the logits
            inside, column = _in_chunk(targets, lo, hi)
            grad.scatter_add_(1, column, -inside.float().unsqueeze(1)).mul_(row_scale)
            grad = grad.to(x.dtype)  # the logits' gradient in the compute dtype, as the cast's backward gives it
            if grad_weight is not None:  # into its rows: a product, then a copy, would be a second (chunk, d)
                torch.mm(grad.t(), x, out=grad_weight[lo:hi])
            if grad_bias is not None:
                grad_bias[lo:hi] = grad.sum(0)
            if grad_x is not None:
                grad_x += grad @ weight[lo:hi]
            del grad, logits  # before the next chunk's logits exist
        return None if grad_x is None else grad_x.to(x.dtype), grad_weight, grad_bias, None, None, None, None
