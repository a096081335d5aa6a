"""A sharded run's stores read as one whole store by one process: how `generate`, `export` and `eval` read a run
trained with `--data-parallel sharded`.

Rank r's store holds elements [r n, (r + 1) n) of every unit's flat slabs (n = `spec.stored_numel`); a read of a
range of the whole unit reads each rank's part of it, chunk by chunk as the rank's files are laid out. Nothing
is written: the step that changes a sharded state needs all of its processes, so every write is refused.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NoReturn, Sequence

import torch

from memory_model.schedule import chunks
from streamer.errors import StoreError
from streamer.store.host import HostStore
from streamer.store.interface import StateWriter, Store


class MergedShards(Store):
    """Every rank's store of a sharded run, read as the whole store it slices."""

    def __init__(self, stores: list[HostStore]) -> None:
        first = stores[0]
        self.stores = stores
        # rank 0's folder: files the trainer keeps beside its store (LoRA's adapters) are the same in every rank's
        self.root, self.layouts, self.step, self.pin_memory = first.root, first.layouts, first.step, "none"
        self.spec = dataclasses.replace(first.spec, shards=1)

    @classmethod
    def open(cls, roots: Sequence[Path]) -> "MergedShards":
        """Open rank 0's, rank 1's, ... stores (`roots`, in rank order), which must be one committed step."""
        stores: list[HostStore] = []
        try:
            for root in roots:
                stores.append(HostStore.open(root, read_only=True))  # a step still to roll forward is refused
            if {s.spec.shards for s in stores} != {len(stores)} or len({s.step for s in stores}) != 1:
                raise StoreError(f"the {len(stores)} stores in {roots[0].parent} are not one committed step of a "
                                 f"sharded run; resume it with torchrun --nproc-per-node {len(stores)} first")
        except BaseException:
            for store in stores:
                store.close()
            raise
        return cls(stores)

    def _refuse(self) -> NoReturn:
        raise StoreError(f"{self.root.parent} holds a run sharded over {len(self.stores)} processes, read here by one; "
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
    def journal(self) -> dict[str, Any] | None:
        return None  # refused at open

    @property
    def trainer_state(self) -> dict[str, Any]:
        return self.stores[0].trainer_state

    def unit_version(self, unit: str) -> int:
        return self.step

    def slab(self, unit: str, kind: str) -> torch.Tensor | None:
        return None  # no store holds a whole unit

    def read_master(self, unit: str, out: torch.Tensor) -> None:
        self._read(unit, "master", 0, out)

    def read_state(self, unit: str, kind: str, start: int, out: torch.Tensor) -> None:
        self._read(unit, kind, start, out)

    def bytes_moved(self) -> tuple[int, int]:
        moved = [s.bytes_moved() for s in self.stores]
        return sum(r for r, _ in moved), sum(w for _, w in moved)

    def check_consistent(self) -> None:
        """Nothing is written here, so nothing can be left part-way."""

    def close(self) -> None:
        for store in self.stores:
            store.close()

    # --- writes: refused --------------------------------------------------------------------------
    def discard_journal(self) -> None:
        self._refuse()

    def accumulate_grad(self, unit: str, grads: Sequence[torch.Tensor], first: bool,
                        scratch: torch.Tensor | None, persist: bool = True) -> torch.Tensor:
        self._refuse()

    def begin_step(self, step: int, record: dict[str, Any]) -> None:
        self._refuse()

    def begin_speculative_step(self, step: int) -> None:
        self._refuse()

    def rollback(self) -> None:
        self._refuse()

    def unit_writer(self, unit: str, step: int) -> StateWriter:
        self._refuse()

    def finish_step(self, step: int, trainer_state: dict[str, Any]) -> None:
        self._refuse()

    def save(self, trainer_state: dict[str, Any]) -> None:
        self._refuse()
