"""The child side of tests/test_reliability.py: a small disk-tier run that SIGKILLs itself at a chosen point.

`train(job)` trains gptj-debug for `job.steps` optimizer steps in `job.store`, continuing with
`StreamingTrainer.open` when the store exists. Its data order comes from a torch.Generator whose state it
records in `trainer.extra_state` before each step, so a resumed run draws the batches an uninterrupted one
would. A `Kill` patches one function inside this process only (no hooks in the product) and kills the
process at its n-th call during a given step. The test forks these children from a forkserver that has
already imported torch, so a trial costs milliseconds instead of a new interpreter.
"""
from __future__ import annotations

import base64
import json
import os
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from layers import GPTJConfig
from streamer import Placement, StreamingTrainer, TrainerConfig
from streamer.runtime.passes import Passes
from streamer.runtime.update import Updater

CFG = GPTJConfig.preset("gptj-debug")
TARGETS = ("forward", "backward", "update", "pwritev", "fdatasync", "fsync", "replace")
OS_TARGETS = ("pwritev", "fdatasync", "fsync", "replace")
RUNTIME_TARGETS = {"forward": Passes, "backward": Passes, "update": Updater}  # each event's method, by its owner


@dataclass(frozen=True)
class Kill:
    """SIGKILL at the n-th call of `target` made while step `step` runs (step None: counted from the start,
    so the open and its roll-forward too). `pwritev` writes half its bytes first, `replace` renames first;
    the others die before the call."""

    target: str
    n: int
    step: int | None = None


@dataclass(frozen=True)
class Job:
    store: str
    steps: int
    dtype: str
    compute: str = "disk"  # the compute weights' tier ("ram": rebuilt from the masters on open)
    # The update fused into the backward, "after-backward" (journaled), or "norm-first": every step clips
    # and is made as a norm pass, then the fused step clipped.
    timing: str = "fused"
    kill: Kill | None = None
    record: str | None = None  # a folder: the state after every step and each step's call counts (reference run)
    out: str | None = None  # where the finished run leaves its final weights and losses
    moments: str = "fp32"  # the Adam moments' dtype in the store
    master: str = "fp32"  # the master weights' dtype in the store


def trainer_config(dtype: str, compute: str, timing: str, moments: str = "fp32", master: str = "fp32") -> TrainerConfig:
    # Several chunks per unit, two micro-batches: a kill can land between any two writes of a step.
    # Fused: no clipping, so that every step is fused (a step that clips is made again after the backward).
    if timing == "norm-first":  # one micro-batch, as norm-first needs; a threshold every step crosses
        return TrainerConfig.of(store=Placement(compute, "disk", "disk"), dtype=dtype, update_chunk=8192, lr=3e-3,
                                seed=7, clipped_steps="norm-first", moment_dtype=moments, master_dtype=master,
                                max_grad_norm=1e-3)
    return TrainerConfig.of(store=Placement(compute, "disk", "disk"), dtype=dtype, grad_accum=2,
                            update_chunk=8192, lr=3e-3, seed=7, update_timing=timing, moment_dtype=moments,
                            master_dtype=master,
                            max_grad_norm=0 if timing == "fused" else 1.0)


class _Tripwire:
    """Counts the calls of every target during the current step and fires the kill."""

    def __init__(self, kill: Kill | None) -> None:
        self.kill, self.step, self.calls = kill, None, Counter()
        self.per_step: dict[int, Counter] = {}

    def begin(self, step: int) -> None:
        self.step, self.calls = step, Counter()
        self.per_step[step] = self.calls

    def wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            kill = self.kill
            if kill is None or kill.target != name or kill.step != self.step or self.calls[name] != kill.n:
                return original(*args, **kwargs)
            if name == "pwritev":  # a torn write: half the bytes reach the file
                fd, buffers, offset = args
                original(fd, [memoryview(buffers[0])[:len(buffers[0]) // 2]], offset)
            elif name == "replace":
                original(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        return wrapper

    def install(self) -> None:
        for name in TARGETS:
            owner: Any = os if name in OS_TARGETS else RUNTIME_TARGETS[name]
            setattr(owner, name, self.wrap(name, getattr(owner, name)))


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def train(job: Job) -> None:
    torch.set_num_threads(1)  # the same arithmetic in every child, whatever the machine
    tripwire = _Tripwire(job.kill)
    tripwire.install()
    store = Path(job.store)
    dataset = torch.randint(0, CFG.vocab_size, (16, 32), generator=torch.Generator().manual_seed(0))
    if (store / "manifest.json").exists():
        trainer = StreamingTrainer.open(store)
    else:
        tc = trainer_config(job.dtype, job.compute, job.timing, job.moments, job.master)
        trainer = StreamingTrainer(CFG, tc, store_dir=store)
    with trainer:
        rng = torch.Generator()
        if "rng" in trainer.extra_state:
            rng.set_state(_decode(trainer.extra_state["rng"]))
        else:
            rng.manual_seed(1234)
        record = Path(job.record) if job.record else None
        if record is not None and trainer.step_count == 0:
            torch.save(trainer.state_dict(), record / "state.0.pt")
        while trainer.step_count < job.steps:
            tripwire.begin(trainer.step_count + 1)
            batch = dataset[torch.randint(0, len(dataset), (4,), generator=rng)]
            # The data position after this batch: committed with the step, so a resume continues from it.
            trainer.extra_state = {"rng": _encode(rng.get_state()), "batches_seen": trainer.step_count + 1}
            trainer.step(batch)
            if record is not None:
                torch.save(trainer.state_dict(), record / f"state.{trainer.step_count}.pt")
        if record is not None:
            counts = {step: dict(c) for step, c in tripwire.per_step.items()}
            (record / "calls.json").write_text(json.dumps(counts))
        if job.out is not None:
            torch.save({"state": trainer.state_dict(), "losses": trainer.losses, "extra": trainer.extra_state},
                       job.out)
