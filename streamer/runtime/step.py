"""Whether the runtime makes the step its settings describe (`check_runnable`), what a step carries between the
executor's events (`StepContext`: its micro-batches and lr, and the state one event hands to a later one), and
how a step can fail."""
from __future__ import annotations

import concurrent.futures as cf
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from layers.loss import Objective
from layers.model import AuxiliaryLoss
from memory_model.step import StepConfig
from streamer.errors import ConfigError, StreamerError
from streamer.runtime.transport import Loaded
from streamer.store.interface import StateWriter


class NonFiniteError(StreamerError):
    """A loss or gradient that is NaN or infinite; nothing of that step was committed."""


class ClippingNeeded(Exception):
    """A fused update ran unclipped, but the gradient norm so far already makes the clip coefficient below 1:
    the step must be undone and made again knowing the coefficient (norm-first, or after the backward)."""


def check_runnable(step: StepConfig) -> None:
    """The runtime runs every step `step` describes but the overlapped update, which only the planner prices (a
    run's settings may name it for `streamer plan`)."""
    if step.update_timing == "overlapped":
        raise ConfigError("--update-timing overlapped is planned only (`streamer plan`): the runtime clips by the "
                          "global norm, known only after the backward; use auto, fused or after-backward")


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None  # packed examples' own positions (GPTJAttention); None: 0..T-1
    attention_mask: torch.Tensor | None = None  # bool, False on padding (transformers'); None: no padding
    # What the head's loss makes of the rows' log-probabilities; None: the token mean over the step's tokens.
    objective: Objective | None = None


@dataclass
class PendingOffload:
    unit: str
    last: bool  # the step's last micro-batch: the accumulated gradient is final and its norm counts
    future: cf.Future[tuple[float, torch.Tensor | None]]  # (squared norm, accumulated gradient) when last
    handles: list[int]  # the ledger charges of the gradient on the device
    # The gradient itself, where the unit's fused update takes its chunks from it (updated_from_backward).
    kept: tuple[torch.Tensor, ...] | None = None


@dataclass
class BackwardGradient:
    """A unit's gradient as its backward made it (one tensor per parameter), held on the device with its ledger
    charges until the unit's fused update has taken its last chunk (memory_model.schedule.updated_from_backward)."""

    pieces: tuple[torch.Tensor, ...]
    handles: list[int]


@dataclass
class StepContext:
    """One step (or forward pass) as its events share it: what its caller gives (micro-batches, lr, tokens),
    what it yields (losses, clip coefficient, mean loss), and what one event hands on to a later one."""

    micro_batches: list[MicroBatch]
    step: int  # the optimizer step being made (1-based)
    lr: float
    # Every micro-batch's loss is its summed cross-entropy over this: the learned tokens of the whole step (every
    # micro-batch of every rank) over the ranks, whose gradients the all-reduce averages (Trainer's
    # num_items_in_batch). None: each micro-batch's own mean.
    tokens: float | None = None
    losses: list[torch.Tensor] = field(default_factory=list)
    # Each micro-batch's objective's metrics (Objective.metrics), summed over the step's micro-batches.
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    clip_coef: float | None = None
    mean_loss: float | None = None
    on_first_update: Callable[["StepContext"], None] | None = None
    # For "infer" events: called with (unit, run) where run(*args) calls the unit with its streamed weights.
    infer: Callable[[str, Callable[..., torch.Tensor]], None] | None = None
    # What the executor hands from one event to a later one:
    fused: bool = False  # the update is fused into the backward
    # A norm-first step's norm pass (memory_model.schedule.norm_pass_spec): each unit's final gradient only
    # gives its squared norm, and is dropped, as a fused step keeps it from the store; the caller sets it.
    norm_pass: bool = False
    training: bool = False  # dropout on (a training step) or off (evaluation, generation)
    # LoRA's adapters off: the frozen base alone, DPO's reference model (Adapters.for_unit).
    adapters_off: bool = False
    # micro-batch -> the reference model's hidden state and its ledger charge, from the first block's forward to
    # the head's, where the micro-batch's objective computes its reference in the step (Objective.reference_in_step)
    references: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    # Generation with the weights resident: no unit leaves the device after its event, so the next pass finds it
    # loaded (Executor.release_kept ends that).
    keep_loaded: bool = False
    # (input, output); an offloaded block's input is on the host (`stashed`), and its output once the next unit has it
    graphs: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = field(default_factory=dict)
    # (block, micro) -> its input on the host (on CUDA with the event of its copy out)
    stashed: dict[tuple[str, int], Loaded] = field(default_factory=dict)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # a backward's block input, back on the device
    # micro-batch -> its auxiliary loss (layers.model.AuxiliaryLoss), from its first block's forward to that
    # block's backward; none where the config asks for none
    auxiliary: dict[int, AuxiliaryLoss] = field(default_factory=dict)
    flowing_grad: tuple[torch.Tensor, int] | None = None  # into the unit whose backward is next; its charge
    pending_offload: PendingOffload | None = None
    final_grads: dict[str, torch.Tensor | None] = field(default_factory=dict)  # fused: awaiting their update
    backward_grads: dict[str, BackwardGradient] = field(default_factory=dict)  # fused, taken from the backward
    # Fused, on a store whose loads cast the fp32 master: the master each unit's last weights load read, which
    # its update takes and updates in place (read once per step).
    kept_masters: dict[str, torch.Tensor] = field(default_factory=dict)
    writers: dict[str, StateWriter] = field(default_factory=dict)  # units whose new state is being written
    write_backs: list[cf.Future[None]] = field(default_factory=list)

    def wait_for_writes(self, unfinished: int) -> None:
        """Block until at most `unfinished` write-backs are still running: updates can outrun the disk, and a
        write that waits holds its chunk's new state in host memory (all of the model's, else, at 6B)."""
        running = [f for f in self.write_backs if not f.done()]
        if len(running) > unfinished:
            cf.wait(running[:len(running) - unfinished])

    def discard_writers(self) -> None:
        """Give up the new state of every unit being written (an aborted step; a close part-way)."""
        for writer in self.writers.values():
            writer.discard()
        self.writers.clear()


def clip_coefficient(sq_norms: dict[str, float], max_grad_norm: float, step: int) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient over every unit's gradient, from each unit's squared norm
    (in backward order; `max_grad_norm` 0: no clipping); a NonFiniteError names the first unit whose gradient is
    not finite."""
    for unit, sq in sq_norms.items():
        if not math.isfinite(sq):
            raise NonFiniteError(f"non-finite gradient in {unit} at step {step} (the first unit its backward "
                                 "reached); nothing was committed — lower the lr or check the data")
    if not max_grad_norm:
        return 1.0
    return min(1.0, max_grad_norm / (math.sqrt(sum(sq_norms.values())) + 1e-6))
