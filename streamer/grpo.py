"""GRPO on the streamed step, through the Python API: rows of a prompt and a completion, the log-probabilities of
the policy that sampled them and of the reference, and one step whose loss is layers/grpo.py's `GRPOObjective`
(TRL's GRPOTrainer's, given the same prompts, completions and rewards).

Rollouts and the loop that generates, scores and steps are `rollout` and `GRPORun` below."""
from __future__ import annotations

from typing import Sequence

import torch

from layers import IGNORE_INDEX
from layers.grpo import GRPOLoss, GRPOObjective, TokenLogProbs
from memory_model.schedule import step_events
from streamer.errors import StreamerError
from streamer.runtime.step import MicroBatch, StepContext
from streamer.trainer import StreamingTrainer


def completion_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                    pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), (rows, T): each prompt followed by its completion, padded on the right with `pad_id`;
    labels -100 but on the completion. T is the longest row."""
    if len(prompts) != len(completions):
        raise StreamerError(f"{len(prompts)} prompts but {len(completions)} completions; give one prompt per row")
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), length), IGNORE_INDEX, dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        row = torch.tensor([*prompt, *completion], dtype=torch.long)
        ids[i, :len(row)] = row
        labels[i, len(prompt):len(row)] = row[len(prompt):]
    return ids, labels


def token_logps(trainer: StreamingTrainer, input_ids: torch.Tensor, labels: torch.Tensor,
                temperature: float = 1.0, reference: bool = False) -> torch.Tensor:
    """(rows, T) fp32 on the host: each position's log-probability of its (shifted) label, 0 where it is -100, by
    forward passes only, one micro-batch's rows at a time. `reference`: the reference model's (with LoRA the base
    with the adapters off; else the weights as they are now); else the policy's as it is now (GRPO's old policy)."""
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise StreamerError(f"input_ids and labels must be (batch, seq) alike; got {tuple(input_ids.shape)} and "
                            f"{tuple(labels.shape)}")
    device = trainer.executor.device
    micro = max(1, input_ids.shape[0] // trainer.tc.step.grad_accum)
    out = []
    for ids, lab in zip(input_ids.split(micro), labels.split(micro), strict=True):
        objective = TokenLogProbs(temperature)
        ctx = StepContext([MicroBatch(ids.to(device), lab.to(device), objective=objective)], trainer.step_count,
                          0.0, adapters_off=reference and trainer.adapters is not None)
        with torch.no_grad():
            trainer.executor.run(step_events(trainer.step_spec(1, backward=False)), ctx)
        trainer.executor.clear_graphs()
        assert objective.tokens is not None
        out.append(objective.tokens.float().cpu())
    return torch.cat(out)


def grpo_objectives(loss: GRPOLoss, labels: torch.Tensor, advantages: torch.Tensor, micro_batches: int,
                    old: torch.Tensor | None = None, reference: torch.Tensor | None = None) -> list[GRPOObjective]:
    """Each micro-batch's GRPO objective, the rows split in `micro_batches` parts in order (as `step` splits them)."""
    rows = labels.shape[0]
    if advantages.shape != (rows,):
        raise StreamerError(f"GRPO needs one advantage per row ({rows}); got {tuple(advantages.shape)}")
    for name, t in (("old", old), ("reference", reference)):
        if t is not None and t.shape != labels.shape:
            raise StreamerError(f"the {name} log-probabilities must be (rows, T) as the labels "
                                f"{tuple(labels.shape)}; got {tuple(t.shape)}")
    if loss.beta and reference is None:
        raise StreamerError("beta > 0 needs the reference's log-probabilities (token_logps(..., reference=True))")
    if rows % micro_batches:
        raise StreamerError(f"{rows} rows do not split into grad_accum={micro_batches} micro-batches")
    tokens = float((labels[:, 1:] != IGNORE_INDEX).sum())

    def parts(t: torch.Tensor | None) -> list[torch.Tensor | None]:
        return [None] * micro_batches if t is None else list(t.chunk(micro_batches))
    return [GRPOObjective(loss, a, o, r, float(rows), tokens, micro_batches)
            for a, o, r in zip(advantages.chunk(micro_batches), parts(old), parts(reference), strict=True)]


def grpo_step(trainer: StreamingTrainer, loss: GRPOLoss, input_ids: torch.Tensor, labels: torch.Tensor,
              advantages: torch.Tensor, old: torch.Tensor | None = None,
              reference: torch.Tensor | None = None) -> float:
    """One optimizer step of GRPO's loss over the rows (`completion_rows`); returns the loss (TRL's)."""
    objectives = grpo_objectives(loss, labels, advantages, trainer.tc.step.grad_accum, old, reference)
    return trainer.step(input_ids, labels, objectives=objectives)
