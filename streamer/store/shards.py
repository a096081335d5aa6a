"""A sharded run's stores read as one whole store by one process: how `generate`, `export` and `eval` read a run
trained with `--data-parallel sharded`.

Rank r's store holds elements [r n, (r + 1) n) of every unit's flat slabs (n = `spec.stored_numel`); a read of a
range of the whole unit reads each rank's part of it, chunk by chunk as the rank's files are laid out. It is a
reader only: the step that changes a sharded state needs all of its processes.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import torch

from memory_model.schedule import chunks
from streamer.errors import StoreError
from streamer.store.host import HostReader
from streamer.store.interface import StoreReader


class MergedShards(StoreReader):
    """Every rank's store of a sharded run, read as the whole store it slices."""

    def __init__(self, stores: list[HostReader]) -> None:
        first = stores[0]
        self.stores = stores
        # rank 0's folder: files the trainer keeps beside its store (LoRA's adapters) are the same in every rank's
        self.root, self.layouts, self.step, self.pin_memory = first.root, first.layouts, first.step, "none"
        self.spec = dataclasses.replace(first.spec, shards=1)

    @classmethod
    def open(cls, roots: Sequence[Path]) -> "MergedShards":
        """Open rank 0's, rank 1's, ... stores (`roots`, in rank order), which must be one committed step."""
        stores: list[HostReader] = []
        try:
            for root in roots:
                stores.append(HostReader.open(root))  # a step still to roll forward is refused
            if {s.spec.shards for s in stores} != {len(stores)} or len({s.step for s in stores}) != 1:
                raise StoreError(f"the {len(stores)} stores in {roots[0].parent} are not one committed step of a "
                                 f"sharded run; resume it with torchrun --nproc-per-node {len(stores)} first")
        except BaseException:
            for store in stores:
                store.close()
            raise
        return cls(stores)

    @property
    def read_only_reason(self) -> str:
        return (f"{self.root.parent} holds a run sharded over {len(self.stores)} processes, read here by one; "
                f"train it with torchrun --nproc-per-node {len(self.stores)}")

    def _read(self, unit: str, kind: str, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + out.numel()) of the whole unit's `kind`, each from the rank holding it."""
        size = self.stores[0].numels[unit]
        end = start + out.numel()
        for rank, store in enumerate(self.stores):
            lo, hi = max(start, rank * size) - rank * size, min(end, (rank + 1) * size) - rank * size
            for piece_start, count in chunks(size, self.spec.chunk):  # reads start on the rank's chunks
                a, b = max(lo, piece_start), min(hi, piece_start + count)
                if a < b:
                    piece = torch.empty(count, dtype=out.dtype)
                    store.read_state(unit, kind, piece_start, piece)
                    at = rank * size + a - start
                    out[at:at + b - a].copy_(piece[a - piece_start:b - piece_start])

    # --- reads ---------------------------------------------------------------------------------
    @property
    def trainer_state(self) -> dict[str, Any]:
        return self.stores[0].trainer_state

    def slab(self, unit: str, kind: str) -> torch.Tensor | None:
        return None  # no store holds a whole unit

    def read_master(self, unit: str, out: torch.Tensor) -> None:
        self._read(unit, "master", 0, out)

    def read_state(self, unit: str, kind: str, start: int, out: torch.Tensor) -> None:
        self._read(unit, kind, start, out)

    def bytes_moved(self) -> tuple[int, int]:
        moved = [s.bytes_moved() for s in self.stores]
        return sum(r for r, _ in moved), sum(w for _, w in moved)

    def close(self) -> None:
        for store in self.stores:
            store.close()
