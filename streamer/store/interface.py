"""The host store as the runtime sees it: a `StoreReader`, a `StoreWriter` that also commits, and the
`StateWriter` that takes a unit's new state.

As torch.distributed.checkpoint splits StorageReader from StorageWriter, reading a committed step is apart
from changing it. What only reads (the transport; generate, eval and export through a trainer opened with
`read_only`) depends on `StoreReader`; training, new weights and saves (the trainer, the executor's gradient
and update paths) on `StoreWriter`, which is a reader too. `streamer.store.host` implements both over two
back ends, chosen per kind of slab by the tier the spec's `Placement` gives it (`memory_model.tiers.Tier`):
a zero-copy tier's kinds live in a `SlabBackend` (RAM slabs, `streamer.store.ram`); every other kind, and every
kind's durable copy, in the chunk-interleaved files (`streamer.store.files`). `HostReader` reads, `HostStore`
reads and writes. A new zero-copy tier (CXL memory) is a record and a `SlabBackend`; a new durable tier
(GPUDirect Storage, a second NVMe) a record and a files back end with `StateFiles`' reads and writes.
`streamer.store.shards.MergedShards`, a sharded run's stores read by one process, is a reader only.

Call order of a reader (under a shared lock on its folder; several readers may hold it at once):
`HostReader.open(root)` or `MergedShards.open(roots)` (the last commit; a step a crash interrupted is
refused), then any reads (`trainer_state`, `slab`, `read_master`, `read_state`), then `close()`.

Call order of a writer (one process holds it, under an exclusive lock on its folder; calls come from the
runtime's main thread and its two I/O workers, one for reads and one for writes; they share the file
descriptors under a lock of their own. The file back end adds a checksum thread and a cleanup thread):

1. `HostStore.create(root, spec)` (a new, empty store at step 0) or `HostStore.open(root)` (the last
   commit; `journal` then names a step a crash interrupted after it was committed).
2. A new store, or new weights: for every unit, `unit_writer(unit, step)`, `write` its state chunk by chunk,
   close the writer; then `finish_step(step, trainer_state)`.
3. A roll-forward, when `journal` is not None: the update of step `journal["step"]` for every unit whose
   `unit_version` is behind it (reads and `unit_writer` as in a training step), then `finish_step`.
4. Per training step s + 1 with the update after the backward, `check_consistent()` first, then:
   - forward and backward, per unit: `slab(unit, "compute")` (zero-copy) or, where that is None, `read_master`
     (cast on the way to the device), then `accumulate_grad` once per micro-batch (`first` on the first);
   - `begin_step(s + 1, record)`: from here the step is committed (disk tier: journaled);
   - the update, per unit: `read_state` of each chunk (master, moments, grad), and a `unit_writer` taking
     the chunks' new values in order, closed after the unit's last chunk;
   - `finish_step(s + 1, trainer_state)`.
   A step that fails before `begin_step` leaves the store at s, ready for another try; one that fails after
   it leaves the store refusing to go on (`check_consistent` raises) until it is reopened: the disk tier
   then rolls the step forward, the RAM tier returns to its last `save`.
   With the update fused into the backward (the state on disk): `begin_speculative_step(s + 1)`, then per
   unit its reads and `accumulate_grad` (the last one with `persist=False`), and at once its update through a
   `unit_writer` (its chunks' masters are the ones its last `read_master` read, not read again); then
   `finish_step` (the manifest is the commit point), or `rollback()` to return every unit to step s
   (clipping triggered, a value was not finite, or anything failed).
5. `save(trainer_state)` whenever the RAM tier should be made durable (the disk tier already is); then, or
   after `finish_step` on the disk tier, `keep(note)` to keep that step (`kept()`), `drop_kept(step)` to let
   one go.
6. `close()`: releases the files and the lock on the store's folder.

Reads never change the store; ranges of state kinds start on chunk boundaries (`spec.chunk`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from streamer.store.layout import UnitLayout
from streamer.store.spec import StoreSpec


class SlabBackend(Protocol):
    """Where a zero-copy tier's kinds live: one flat host tensor per unit and kind, handed over as it lies. The
    store asks it first for every kind (`get` is None where the kind lives elsewhere) and writes each new value
    through it before the files."""

    def get(self, unit: str, kind: str) -> torch.Tensor | None:
        """The slab itself, or None where this kind is not held here."""

    def holds(self, unit: str, kind: str) -> bool:
        """Whether `kind` has a slab of its own here (fp32 compute weights are the masters')."""

    def write(self, unit: str, kind: str, start: int, values: torch.Tensor) -> None:
        """Copy `values`, as stored, into elements [start, ...) of the slab, if it has one."""

    def close(self) -> None:
        """Release the slabs' memory (unlock what was page-locked)."""


class StateWriter(ABC):
    """Takes one unit's new state for one commit. Chunks arrive in order and, within a chunk, kinds in the
    order master, exp_avg, exp_avg_sq, compute (a RAM copy only). `close` makes the new state durable where
    its tier is on disk; `discard` drops it (the commit then stays unfinished)."""

    @abstractmethod
    def write(self, kind: str, start: int, values: torch.Tensor) -> None:
        """New values of `kind` for elements [start, start + values.numel())."""

    @abstractmethod
    def close(self) -> None:
        """Every chunk is written: make the unit's new state the one the store holds."""

    @abstractmethod
    def discard(self) -> None:
        """Give up this unit's new state (an aborted step): nothing of it is kept on disk."""

    def __enter__(self) -> "StateWriter":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close() if exc_type is None else self.discard()


class StoreReader(ABC):
    """A committed step of every unit's compute weights, fp32 master weights and Adam moments, read.

    `root` is the store's folder (a trainer keeps files of its own beside the store's: LoRA's adapters);
    `spec` what the store holds and where; `layouts` every unit's flat layout; `step` the last committed
    step; `pin_memory` the host memory pinned for a CUDA device (`PIN_MODES`: "all" pins the RAM slabs too;
    the transport's staging buffers are pinned unless it is "none"). The kinds are "compute", "master",
    "exp_avg", "exp_avg_sq" and "grad"; a frozen base (`spec.frozen`, LoRA) holds "compute" alone, which a read
    of "master" returns. `read_only_reason`, on a store that is not a `StoreWriter`: why it takes no writes and
    how to open it for them, the one line a step, a save or new weights raise.
    """

    root: Path
    spec: StoreSpec
    layouts: dict[str, UnitLayout]
    step: int
    pin_memory: str
    if TYPE_CHECKING:  # a property of each store that is not a StoreWriter: read-only to the type checker
        @property
        def read_only_reason(self) -> str: ...
    else:
        read_only_reason: str

    @property
    @abstractmethod
    def trainer_state(self) -> dict[str, Any]:
        """The trainer state given to the last commit (config, losses, the caller's extra state)."""

    def kept(self) -> dict[int, dict[str, Any]]:
        """The kept steps, oldest first, each with the note it was kept with (its eval loss, say)."""
        return {}

    @abstractmethod
    def slab(self, unit: str, kind: str) -> torch.Tensor | None:
        """The host tensor holding all of `kind` for `unit` when its tier is RAM (pinned if `pin_memory` is all),
        for zero-copy use; None when it is on disk, or stored quantized (int8 moments: `read_state` dequantizes
        them). Read it; change it only through a `StateWriter`, which skips the copy when handed a view of the slab
        itself."""

    @abstractmethod
    def read_master(self, unit: str, out: torch.Tensor) -> None:
        """The unit's master weights into `out` (numel of the unit), converted to out's dtype: what a load casts
        to the compute dtype where the store keeps no compute copy (`slab(unit, "compute")` is None)."""

    @abstractmethod
    def read_state(self, unit: str, kind: str, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + out.numel()) of a state kind or "grad", within one chunk (from any element of it;
        a quantized kind from a block's start), converted to out's dtype."""

    @abstractmethod
    def bytes_moved(self) -> tuple[int, int]:
        """(read, written) bytes of the store's files since it was opened: state and gradient data, not the
        trailers or the checksums' read-back."""

    @abstractmethod
    def close(self) -> None:
        """Release the files and the lock on the store's folder; the store object is unusable afterwards."""


class StoreWriter(StoreReader):
    """A store that also takes every unit's new state and fp32 gradient accumulator, and commits steps.
    `fell_back`: where open found the last commit damaged and went back to the newest intact kept step, the one
    line saying so; else None. `kept_damage`: where kept steps' records cannot be read, the one line naming them."""

    fell_back: str | None
    kept_damage: str | None

    # --- the committed state ---------------------------------------------------------------
    @property
    @abstractmethod
    def journal(self) -> dict[str, Any] | None:
        """The step committed after `step` whose update a crash interrupted (its lr, clip_coef, trainer
        state), to be rolled forward; None when there is none."""

    @abstractmethod
    def discard_journal(self) -> None:
        """Forget the journaled step (data parallel: another rank never journaled it, so none updated)."""

    @abstractmethod
    def unit_version(self, unit: str) -> int:
        """The step whose state `unit` holds: `step`, or `step + 1` once a journaled update reached it."""

    # --- writes ----------------------------------------------------------------------------
    @abstractmethod
    def accumulate_grad(self, unit: str, grads: Sequence[torch.Tensor], first: bool,
                        scratch: torch.Tensor | None, persist: bool = True,
                        norm: bool = False) -> tuple[torch.Tensor | None, float]:
        """Copy (`first`) or add a host-side gradient (tensors laid end to end in layout order) into the
        unit's fp32 accumulator; returns the accumulated values and (`norm`) their squared L2 norm. `scratch`: an
        fp32 buffer, needed where gradients are on disk: of the unit's size, or shorter, and the unit is folded
        through its file a block of that size at a time and no values are returned (None). `persist=False`: the
        sum is not stored on disk (a fused update's final gradient, which nothing reads back; a norm pass's)."""

    @abstractmethod
    def check_consistent(self) -> None:
        """Raise if an update stopped part-way in this process, so units hold two different steps."""

    @abstractmethod
    def begin_step(self, step: int, record: dict[str, Any]) -> None:
        """The commit point of `step`, before its first update; `record` (lr, clip_coef, trainer) is what a
        roll-forward needs. The disk tier makes the gradients durable and journals it."""

    @abstractmethod
    def begin_speculative_step(self, step: int) -> None:
        """Start `step` with its update fused into the backward: each unit's new state goes to the next
        generation while the previous one stays until `finish_step`, so `rollback` can return to it."""

    @abstractmethod
    def rollback(self) -> None:
        """Abandon a speculative step: every unit is back at the last committed step, in files and RAM."""

    @abstractmethod
    def unit_writer(self, unit: str, step: int) -> StateWriter:
        """Where `unit`'s state at `step` goes (a training update, a roll-forward or new weights)."""

    @abstractmethod
    def finish_step(self, step: int, trainer_state: dict[str, Any]) -> None:
        """Every unit is at `step`: the commit is complete (the disk tier writes its manifest)."""

    @abstractmethod
    def save(self, trainer_state: dict[str, Any]) -> None:
        """Make the current step durable (the RAM tier writes every unit's state file, then the manifest)."""

    @abstractmethod
    def keep(self, note: dict[str, Any]) -> None:
        """Keep the last commit, saved: no later commit deletes its state files; `kept()` lists it with `note`."""

    @abstractmethod
    def drop_kept(self, step: int) -> None:
        """Forget a kept step; its state files go unless the last commit or another kept step names them."""
