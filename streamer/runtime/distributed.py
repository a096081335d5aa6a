"""Data parallel over torch.distributed (gloo on CPU, nccl on CUDA), launched by torchrun.

Every rank streams the same layers from its own copy of the store and computes on its rows of the global
batch; each unit's weight gradient is all-reduced as soon as that unit's backward produces it, while the
next unit's backward runs. All ranks then apply the same update, so their stores stay identical.

Sharded (`sharded`, `--data-parallel sharded`): each rank's store holds only its slice of every unit's flat
state (`memory_model.schedule.shard_numel`: master, moments, compute copy and gradient accumulator), so host
RAM and disk per rank are 1/N. A unit's weights load as the rank's slice and are all-gathered into the whole
unit on the device; its gradient is reduce-scattered (summed in fp32) so each rank receives only its slice, and
each rank updates only its slice. The squared gradient norms are summed over the ranks, so every rank clips by
the same global norm and sees the same non-finite gradient. (gloo in the pinned torch has both
all_gather_single and reduce_scatter_single, as nccl has.)

Commits: a rank journals step s, then waits for every rank to have journaled it before touching any weight.
So after a crash either all ranks hold the journal (every rank rolls forward) or some do not (then no rank
has updated anything yet, and the journals are dropped): no rank ever commits a step the others have not.

Several machines: torchrun's c10d rendezvous (`--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT`) makes
the same group over the network. A process that stops answering (its node died, or the network between them)
fails the others' next exchange: at once where the connection closes, else after the group's timeout
(`--dist-timeout`); each then stops with one line (`LostProcess`), and the run keeps its last committed step.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from memory_model.schedule import shard_numel
from streamer.errors import StoreError, StreamerError
from streamer.store.interface import StoreReader
from streamer.store.layout import fold_into


class LostProcess(StreamerError):
    """An exchange with the other processes failed: one of them (or its machine, or the network) is gone."""


@contextlib.contextmanager
def _exchange() -> Iterator[None]:
    """Turn a failed collective into one line: gloo raises a RuntimeError that names the peer that closed its
    connection or the wait that timed out; nccl a DistBackendError (a RuntimeError too)."""
    try:
        yield
    except torch.OutOfMemoryError:  # a RuntimeError too, but this process's own
        raise
    except RuntimeError as exc:
        # gloo's first sentence, without its source location: "Connection closed by peer [10.0.0.2]:41234".
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split("] ", 1)[-1].split(". ")[0]
        raise LostProcess(f"another process of this run stopped answering ({said}); this one "
                          "stops too and the run keeps its last committed step: start the same torchrun command "
                          "again on every node to continue (--dist-timeout: how long a process waits for the others)"
                          ) from None


@dataclass(frozen=True)
class Reduction:
    tensor: torch.Tensor  # the summed gradient (this rank's slice of it, sharded)
    work: Any  # torch.distributed Work handle
    source: torch.Tensor | None = None  # a reduce-scatter's input, kept alive until the work is done


@dataclass(frozen=True)
class DataParallel:
    rank: int
    world: int
    sharded: bool = False  # each rank stores and updates only its slice of every unit's state

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise StreamerError(f"rank {self.rank} is outside a world of {self.world} processes")

    @classmethod
    def from_environment(cls, device: str, sharded: bool = False,
                         timeout_s: float | None = None) -> "DataParallel | None":
        """The process group torchrun describes in the environment (WORLD_SIZE > 1), else None. `timeout_s`: how
        long any exchange waits for the other processes (torch's default where None)."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        if device == "cuda":  # torchrun's processes on one machine: one GPU each, not all of them on the first
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            # nccl for device tensors; gloo beside it for the host's (a loss, the squared norms, a host slice).
            with _exchange():
                dist.init_process_group("cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo",
                                        timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size(), sharded)

    # --- the sharded state ---------------------------------------------------------------------------
    @property
    def shards(self) -> int:
        """The slices each unit's state is stored in: one per rank, sharded; else 1 (every rank stores it whole)."""
        return self.world if self.sharded else 1

    def stored_numel(self, unit_numel: int) -> int:
        """Elements of a unit this rank's store holds and updates: all of them, or its slice."""
        return shard_numel(unit_numel, self.shards)

    def slice_start(self, unit_numel: int) -> int:
        """Where this rank's slice starts in the unit's flat state (0 when it holds the whole unit)."""
        return self.rank * self.stored_numel(unit_numel) if self.sharded else 0

    def own_slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a unit's whole flat tensor, zero-padded at the unit's end (a copy)."""
        size = self.stored_numel(flat.numel())
        out = torch.zeros(size, dtype=flat.dtype, device=flat.device)
        piece = flat[self.rank * size:(self.rank + 1) * size]
        out[:piece.numel()].copy_(piece)
        return out

    def gather_slices(self, out: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of a unit, in rank order, into `out` (world x the slice; the padding last)."""
        with _exchange():
            dist.all_gather_single(out, piece)
        return out

    def sum_squares(self, sq_norms: dict[str, float]) -> dict[str, float]:
        """Per-unit squared gradient norms of every rank's slices, summed: the norms of the whole gradients.
        Every rank holds the same units in the same (backward) order."""
        t = torch.tensor(list(sq_norms.values()), dtype=torch.float64)
        with _exchange():
            dist.all_reduce(t)
        return dict(zip(sq_norms, t.tolist(), strict=True))

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the global batch."""
        if batch.shape[0] % self.world:
            raise StreamerError(f"global batch {batch.shape[0]} is not divisible by the {self.world} processes; "
                                f"use a multiple of {self.world}")
        return batch.chunk(self.world)[self.rank]

    def start_reduce(self, pieces: Sequence[torch.Tensor], whole: bool = False) -> Reduction:
        """All-reduce a gradient given as tensors laid end to end, as one flat tensor; sharded, reduce-scatter
        it (zero-padded to world x the slice) so this rank receives the sum of its slice only. `whole`: every
        rank receives the whole sum even when sharded (LoRA's adapters, which every rank keeps whole)."""
        # Summed in fp32: a bf16 sum over ranks would round every partial sum.
        numel = sum(p.numel() for p in pieces)
        scatter = self.sharded and not whole
        size = shard_numel(numel, self.world) * self.world if scatter else numel
        flat = torch.empty(size, dtype=torch.float32, device=pieces[0].device)
        fold_into(flat[:numel], pieces, first=True)
        if not scatter:
            with _exchange():
                return Reduction(flat, dist.all_reduce(flat, async_op=True))
        flat[numel:].zero_()
        mine = torch.empty(size // self.world, dtype=torch.float32, device=flat.device)
        with _exchange():
            return Reduction(mine, dist.reduce_scatter_single(mine, flat, async_op=True), flat)

    def finish_reduce(self, reduction: Reduction) -> torch.Tensor:
        with _exchange():
            reduction.work.wait()
        return reduction.tensor.div_(self.world)

    def mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        with _exchange():
            dist.all_reduce(t)
        return float(t) / self.world

    def barrier(self) -> None:
        with _exchange():
            dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        with _exchange():
            dist.all_gather_object(out, value)
        return out


def launcher(parallel: DataParallel | None) -> tuple[str, str]:
    """The command that starts `streamer` as this process was started, and what its placeholders stand for:
    `streamer` itself, or torchrun with this group's shape (torchrun tells each process its nodes,
    GROUP_WORLD_SIZE, and processes per node, LOCAL_WORLD_SIZE). On several machines each node's rank and the
    rendezvous address are the user's own: R and HOST:PORT."""
    if parallel is None:
        return "streamer", ""
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(parallel.world // nodes)))
    if nodes == 1:
        return f"torchrun --standalone --nproc-per-node {per_node} -m streamer", ""
    return (f"torchrun --nnodes {nodes} --node-rank R --nproc-per-node {per_node} --rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT -m streamer", "on every node, R its rank, HOST:PORT the rendezvous it was "
                                                      "launched with")


def leave_process_group() -> None:
    """Wait for every rank, then destroy the process group: the last thing a data-parallel process does.
    A gloo worker thread drops a finished collective's tensors just after the caller has moved on, and when
    it drops a tensor's last reference it needs the GIL; a process whose interpreter shuts down meanwhile
    aborts (SIGABRT, "terminate called without an active exception", about once in ten 2-rank runs). The
    group's threads outlive destroy_process_group (torch.distributed.nn, imported with torch._dynamo, keeps
    the group in default arguments), so after the barrier this thread sleeps, the GIL free, while they do."""
    if dist.is_initialized():
        with _exchange():
            dist.barrier()
        time.sleep(0.1)
        dist.destroy_process_group()


def leave_after_error(status: int) -> None:
    """The last call of a data-parallel process that stops on an error, its one line printed: exit with `status`
    at once. Waiting for the others could hang (they may never reach another exchange), and an interpreter that
    shuts down under gloo's threads aborts (SIGABRT, see `leave_process_group`) after that line. The others' next
    exchange with this process fails, and each says so in one line (`LostProcess`); every store is safe against a
    kill at any instant, and the files this process wrote are closed by then."""
    if dist.is_available() and dist.is_initialized():
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(status)


def check_sharding(store: StoreReader, mode: str, parallel: DataParallel | None) -> None:
    """A store of one rank's slices opens only in that many processes, under the mode it was written with."""
    shards, world = store.spec.shards, 1 if parallel is None else parallel.world
    if shards > 1 and shards != world:
        raise StoreError(f"{store.root} holds 1/{shards} of a run's state (--data-parallel sharded over {shards} "
                         f"processes) and this is {world}; open {store.root.parent} (every slice, to read it) or "
                         f"train with torchrun --nproc-per-node {shards}")
    if (mode == "sharded") != (shards > 1) and world > 1:
        was = "sharded" if shards > 1 else "replicated"
        raise StoreError(f"{store.root} was written with --data-parallel {was}; resume it with --data-parallel {was}")


def agree_on_journal(data_parallel: DataParallel, committed: int,
                     journal: dict[str, Any] | None) -> dict[str, Any] | None:
    """The journaled step to roll forward (this rank's store committed step `committed`): `journal` only if every rank
    journaled it or already committed it (a rank that finished its update before another crashed); otherwise
    None, and no rank has updated anything of it yet, so the caller forgets it."""
    views = data_parallel.gather((committed, None if journal is None else journal["step"]))

    def everyone_reached(step: int) -> bool:
        return all(j == step or committed >= step for committed, j in views)

    if journal is not None and not everyone_reached(journal["step"]):
        journal = None
    steps = {j if j is not None and everyone_reached(j) else committed for committed, j in views}
    if len(steps) != 1:
        raise StoreError(f"the ranks' stores are at different steps {sorted(steps)}; restore them from one backup")
    return journal
