"""Data parallel over torch.distributed (gloo on CPU, nccl on CUDA), launched by torchrun.

Every rank streams the same layers from its own copy of the store and computes on its rows of the global
batch; each unit's weight gradient is all-reduced as soon as that unit's backward produces it, while the
next unit's backward runs. All ranks then apply the same update, so their stores stay identical.

Commits: a rank journals step s, then waits for every rank to have journaled it before touching any weight.
So after a crash either all ranks hold the journal (every rank rolls forward) or some do not (then no rank
has updated anything yet, and the journals are dropped): no rank ever commits a step the others have not.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from streamer.errors import StreamerError
from streamer.store.layout import fold_into


@dataclass(frozen=True)
class Reduction:
    tensor: torch.Tensor
    work: Any  # torch.distributed Work handle


@dataclass(frozen=True)
class DataParallel:
    rank: int
    world: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise StreamerError(f"rank {self.rank} is outside a world of {self.world} processes")

    @classmethod
    def from_environment(cls, device: str) -> "DataParallel | None":
        """The process group torchrun describes in the environment (WORLD_SIZE > 1), else None."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        return cls(dist.get_rank(), dist.get_world_size())

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the global batch."""
        if batch.shape[0] % self.world:
            raise StreamerError(f"global batch {batch.shape[0]} is not divisible by the {self.world} processes; "
                                f"use a multiple of {self.world}")
        return batch.chunk(self.world)[self.rank]

    def start_reduce(self, pieces: Sequence[torch.Tensor]) -> Reduction:
        """All-reduce a gradient given as tensors laid end to end, as one flat tensor."""
        # Summed in fp32: a bf16 sum over ranks would round every partial sum.
        flat = fold_into(torch.empty(sum(p.numel() for p in pieces), dtype=torch.float32, device=pieces[0].device),
                         pieces, first=True)
        return Reduction(flat, dist.all_reduce(flat, async_op=True))

    def finish_reduce(self, reduction: Reduction) -> torch.Tensor:
        reduction.work.wait()
        return reduction.tensor.div_(self.world)

    def mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / self.world

    def barrier(self) -> None:
        dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out
