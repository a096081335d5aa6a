"""`HostReader` and `HostStore`: the `StoreReader` and `StoreWriter` over RAM slabs and state files, the
writer with the commit protocol.

Each kind of slab lives where the spec's `Placement` puts it: in RAM slabs (`streamer.store.ram`) or in
the state and gradient files (`streamer.store.files`); the records that say what is committed are in
`streamer.store.commit`. Call order: `streamer.store.interface`.

Commits (docs/STORE.md): every commit writes a new *generation* of each unit's state file. A disk-tier step
is durable once its gradients are fsynced and `journal.json` names it; then each unit's next generation is
written to a tmp file, fsynced and renamed, and its old generation deleted. A crash mid-update leaves every
unit at step s or s+1, and `open()` reports the journal so the trainer rolls the rest forward from the same
gradients: bit-identical to an uninterrupted run. Other commits (the first write, loading weights, a RAM-tier
save) keep the old generation until the manifest names the new one.

Long because the reader and the writer share one set of checks (sizes, trailers, checksums, the files beside a
step), and the writer's way back from a damaged commit to an intact step, alone or with the other torchrun
processes, is those checks applied to each candidate step.
"""
from __future__ import annotations

import json
import os
import shutil
import weakref
from abc import abstractmethod
from pathlib import Path
from typing import Any, Callable, Self, Sequence

import torch

from memory_model.schedule import chunks
from streamer.errors import StoreError
from streamer.store.commit import (
    JOURNAL, MANIFEST, Commit, check_units, drop_kept, keep_step, kept_steps, lock_for_reading, lock_run_dir,
    new_manifest, read_journal, read_kept, read_manifest, state_name, write_journal, write_manifest,
)
from streamer.store.files import GenerationWriter, StateFiles
from streamer.store.interface import SlabBackend, StateWriter, StoreReader, StoreWriter
from streamer.store.layout import fold_into, squared_norm
from streamer.store.quant import restored, stored
from streamer.store.ram import RamSlabs
from streamer.store.slabfile import Checksum, Scratch, fsync_path, verify_checksums
from streamer.store.spec import PIN_MODES, StoreSpec


# Checks the files a step commits beside the store's (the store's folder, the step), raising a StoreError where one
# is damaged: a LoRA run's adapters (`streamer.runtime.lora.Adapters.check`).
Companions = Callable[[Path, int], None]


class DamagedStep(StoreError):
    """A writer's last commit is damaged where it may not go back on its own (`HostStore.open(fall_back=False)`,
    one torchrun process): the processes choose the step to go back to together (`HostStore.intact_steps`)."""


class _HostSlabs(StoreReader):
    """What reading and writing a host store share: its files and RAM slabs, opened at the last commit and
    checked, and the reads. `_read_only`: the files are opened for reading alone, under a shared lock."""

    _read_only: bool

    def __init__(self, root: Path, spec: StoreSpec, manifest: dict[str, Any], pin_memory: str, lock: int) -> None:
        if pin_memory not in PIN_MODES:
            raise StoreError(f"pin_memory must be one of {', '.join(PIN_MODES)}, got {pin_memory!r}")
        self.root, self.spec, self.manifest, self._lock = root, spec, manifest, lock
        self.pin_memory = pin_memory
        self.layouts = {lay.name: lay for lay in spec.layouts()}
        self.step: int = manifest["step"] if manifest["step"] is not None else 0
        self.generation: int = manifest["generation"]
        self.versions: dict[str, int] = dict(manifest["units"])  # unit -> generation of its state file
        # Every slab holds the unit's stored elements: the whole unit, or this rank's slice of a sharded state.
        self.numels = {unit: spec.stored_numel(lay.numel) for unit, lay in self.layouts.items()}
        self._files = StateFiles(root / "slabs", spec, self.numels, self._read_only)
        self._slabs: SlabBackend  # allocated by create, and by open once every state file checks out
        # step -> manifest of each kept step, its state files left in place; and the damage of each record that
        # cannot be read. Which files such a record names is unknown: while one is there, every state file found
        # at open stays (`_kept_names`).
        self._kept, self._unreadable = _readable_kept(root)
        self._held = self._files.names() if self._unreadable else set()
        self._damage: StoreError | None = None  # a missing or damaged manifest (`_open` read a kept step's)
        self._at_kept = False  # opened at a kept step other than the last commit (a reader's `step`)
        self._may_fall_back = False  # a writer's open may go back to a kept step where the last commit is damaged
        self._to_step: int | None = None  # a writer's open goes back to this step (the torchrun processes' choice)
        # What checks the files a step commits beside the store's (a LoRA run's adapters), raising a StoreError
        self._companions: Companions | None = None
        self._removal: weakref.finalize[..., Any] | None = None  # a temporary folder's, at close or exit

    def _allocate_ram(self) -> None:
        """The zero-copy tiers' slabs (RAM's). An opened store allocates them only after its files match its
        manifest, so a manifest naming another (maybe far larger) model is refused, not allocated first."""
        self._slabs = RamSlabs(self.spec, self.numels, pin=self.pin_memory)

    @classmethod
    def _open(cls, root: str | Path, pin_memory: str, verify: bool, step: int | None = None,
              fall_back: bool = False, to_step: int | None = None, companions: Companions | None = None) -> Self:
        """Open a store at its last commit, or at the kept `step`. `verify`: check every state file's checksum
        (a full read). A writer's `to_step`: go back to that step, the last commit's or a kept one. `companions`:
        checks the files a step commits beside the state files, as they are checked."""
        root = Path(root)
        try:
            manifest, damage = read_manifest(root), None
        except StoreError as exc:
            manifest, damage = _newest_kept(root, exc), exc
        at_kept = step is not None and (damage is not None or step != manifest["step"])
        if at_kept and step is not None:  # (at_kept says it is not None)
            manifest = {k: v for k, v in read_kept(root, step).items() if k != "note"}
        try:
            spec = StoreSpec.from_dict(manifest["spec"])
        except StoreError as exc:
            raise StoreError(f"{root / MANIFEST}: {exc}; it was left untouched") from None
        lock, store = lock_for_reading(root) if cls._read_only else lock_run_dir(root), None
        try:
            if damage is not None and step is None and not fall_back and to_step is None:
                if not cls._read_only:  # one torchrun process: the processes choose a step together
                    raise DamagedStep(str(damage))
                store = cls(root, spec, manifest, pin_memory, lock)  # a kept step is read only when asked for
                store._companions = companions
                raise store._refusal(first_clause(damage), list(store._kept))
            check_units(root, manifest, spec.config)  # before the units' layouts are built
            store = cls(root, spec, manifest, pin_memory, lock)
            store._at_kept, store._may_fall_back, store._damage = at_kept, fall_back, damage
            store._to_step, store._companions = to_step, companions
            store._load_units(verify)
        except BaseException:
            if store is not None:
                store.close()
            elif lock >= 0:
                os.close(lock)
            raise
        return store

    @abstractmethod
    def _load_units(self, verify: bool) -> None:
        """Check the opened store's files against its manifest (and journal) and fill the RAM tier."""

    def close(self) -> None:
        self._files.close()
        if hasattr(self, "_slabs"):  # allocated (an open may fail first)
            self._slabs.close()
        if self._lock >= 0:
            os.close(self._lock)  # releases the flock
            self._lock = -1
        if self._removal is not None:
            self._removal()

    def remove_when_closed(self, folder: Path) -> None:
        """Delete `folder` (a temporary one holding the store) when the store closes, or at the latest when it
        is collected or the process exits: a RAM-tier store made without a run folder leaves nothing behind."""
        self._removal = weakref.finalize(self, shutil.rmtree, folder, True)

    def _interrupted_step(self) -> dict[str, Any] | None:
        """The journaled step after the manifest's, whose update a crash may have interrupted (disk tier)."""
        if not self.spec.placement.state.journaled or self._at_kept:
            return None
        return read_journal(self.root, self.manifest, list(self.layouts))

    @property
    def trainer_state(self) -> dict[str, Any]:
        return self.manifest["trainer"]

    def kept(self) -> dict[int, dict[str, Any]]:
        return {step: dict(record.get("note", {})) for step, record in sorted(self._kept.items())}

    def _kept_names(self) -> set[str]:
        """The state files of the kept steps (and, while a kept step's record cannot be read, every one found at
        open)."""
        return self._held | {state_name(u, g) for record in self._kept.values() for u, g in record["units"].items()}

    def _check_and_fill(self, verify: bool, journal: dict[str, Any] | None) -> None:
        """Check every unit's state file (size, trailer, checksum) and, with a journal, the gradients to replay;
        then fill the RAM tier. Nothing is written or deleted here."""
        checks = []
        for unit in self.layouts:
            expected = self.manifest["checksums"].get(state_name(unit, self.versions[unit]))
            if journal is not None and self._files.state_path(unit, journal["generation"]).is_file():
                self.versions[unit], expected = journal["generation"], None  # updated before the crash
            elif journal is not None:  # still to update: the roll-forward replays its journaled gradient
                checks.append(self._files.grad_check(unit, journal["grad_checksums"][unit], journal["step"]))
            checks.append(self._state_check(unit, self.versions[unit], expected))
        if verify:
            verify_checksums(checks)
        if self._companions is not None:
            self._companions(self.root, self.step)
        self._allocate_ram()
        for unit in self.layouts:
            self._fill_ram_from_file(unit)

    def _state_check(self, unit: str, generation: int, expected: int | None) -> Checksum:
        """A unit's state file's size and trailer checked now, and its checksum to verify (the record's too)."""
        trailer = self._files.check(unit, generation)
        wanted = {trailer.checksum} | ({expected} if expected is not None else set())
        return Checksum(unit, self._files.state_path(unit, generation), trailer.data_bytes, frozenset(wanted))

    def _intact(self, record: dict[str, Any]) -> bool:
        """Whether every state file a step's record names checks out, as opening that step checks them."""
        try:
            check_units(self.root, record, self.spec.config)
            verify_checksums([self._state_check(unit, generation, record["checksums"].get(state_name(unit, generation)))
                              for unit, generation in record["units"].items()])
            if self._companions is not None:
                self._companions(self.root, record["step"])
        except StoreError:
            return False
        return True

    def _refusal(self, damaged: str, steps: list[int]) -> StoreError:
        """The one line refusing a damaged step (`damaged` says what is wrong) where the run keeps `steps`: the
        intact ones are offered, and where none is, what is left to do."""
        intact = [step for step in sorted(steps) if self._intact(self._kept[step])]
        broken = [step for step in sorted(steps) if step not in intact]
        if not intact:
            return StoreError(f"{damaged}, as {'is' if len(broken) == 1 else 'are'} its kept step(s) "
                              f"{', '.join(map(str, broken))}: no step of the run is intact; restore {self.root} from "
                              "a backup, or start a new run")
        also = (f", as {'is' if len(broken) == 1 else 'are'} kept step(s) {', '.join(map(str, broken))}" if broken
                else "")
        return StoreError(f"{damaged}{also}; the run keeps intact step(s) {', '.join(map(str, intact))}: `streamer "
                          f"export` with --step {intact[-1]} exports the newest, and training the run on (`streamer "
                          "train --resume`) goes back to it")

    def _fill_ram_from_file(self, unit: str) -> None:
        """Load RAM-tier kinds from a unit's state file; RAM compute weights are rebuilt from the masters."""
        file_kinds = self.spec.file_kinds()
        # A RAM copy, cast from the masters (a frozen base's files hold its compute weights themselves).
        rebuild_compute = self._slabs.holds(unit, "compute") and "compute" not in file_kinds
        wanted = [k for k in file_kinds if self._slabs.holds(unit, k)]
        if not wanted and not rebuild_compute:
            return
        generation = self.versions[unit]
        for start, count in chunks(self.numels[unit], self.spec.chunk):
            for kind in wanted:
                self._files.read(unit, generation, kind, start, self._raw(unit, kind, start, count))
            if rebuild_compute:
                master = self._slabs.get(unit, "master")
                if master is not None:
                    master = master[start:start + count]
                else:
                    master = torch.empty(count, dtype=self.spec.kind_dtype("master"))  # as stored
                    self._files.read(unit, generation, "master", start, master)
                compute = self._slabs.get(unit, "compute")
                assert compute is not None  # the compute copy this branch refreshes is in RAM
                compute[start:start + count].copy_(master)
        self._files.release(self._files.state_path(unit, generation))

    def _raw(self, unit: str, kind: str, start: int, count: int) -> torch.Tensor:
        """The RAM slab's piece holding elements [start, start + count) of `kind`, as stored."""
        lo, hi = self.spec.kind_range(kind, start, count)
        slab = self._slabs.get(unit, kind)
        assert slab is not None, f"{kind} of {unit} is not in RAM"
        return slab[lo:hi]

    # --- reads ----------------------------------------------------------------------------
    def slab(self, unit: str, kind: str) -> torch.Tensor | None:
        return None if self.spec.quantized(kind) else self._slabs.get(unit, kind)

    def read_master(self, unit: str, out: torch.Tensor) -> None:
        for start, count in chunks(self.numels[unit], self.spec.chunk):
            self.read_state(unit, "master", start, out[start:start + count])

    def read_state(self, unit: str, kind: str, start: int, out: torch.Tensor) -> None:
        kind = self.spec.held_kind(kind)
        if self._slabs.get(unit, kind) is not None:
            restored(self.spec, kind, self._raw(unit, kind, start, out.numel()), out)
            return
        dtype = self.spec.kind_dtype(kind)
        target = out if out.dtype == dtype else \
            self._files.reads.take(self.spec.kind_range(kind, 0, out.numel())[1], dtype)
        if kind == "grad":
            self._files.read_grad(unit, start, target)
        else:
            self._files.read(unit, self.versions[unit], kind, start, target)
        if target is not out:
            restored(self.spec, kind, target, out)

    def bytes_moved(self) -> tuple[int, int]:
        return self._files.bytes_read, self._files.bytes_written


class HostReader(_HostSlabs):
    """A store's last commit, read (generate, eval, export): under a shared lock, so several readers go
    together; nothing in the folder is created, changed or deleted, so it may be read-only."""

    _read_only = True

    @classmethod
    def open(cls, root: str | Path, pin_memory: str = "none", verify: bool = True,
             step: int | None = None, companions: Companions | None = None) -> "HostReader":
        """`verify`: check every state file's checksum (a full read). A step still to roll forward is refused.
        `step`: a kept step (`HostStore.keep`) instead of the last commit. `companions`: as `HostStore.open`."""
        return cls._open(root, pin_memory, verify, step, companions=companions)

    @property
    def read_only_reason(self) -> str:
        return f"{self.root} was opened for reading; open it without read_only to change it"

    def _load_units(self, verify: bool) -> None:
        """Reading leaves a stale journal and the strays of a crash to the next writer."""
        try:
            journal = self._interrupted_step()
        except StoreError as damage:
            raise StoreError(f"{first_clause(damage)}: the step after step {self.step} cannot be read; first resume "
                             "the run (`streamer train --resume`), which goes back to its last intact step") from None
        if journal is not None:
            raise StoreError(f"{self.root}: step {journal['step']} was interrupted before its update finished, "
                             "which reading the run cannot do; first resume the run as it was trained "
                             "(`streamer train --resume`, under torchrun if it ran so)")
        try:
            self._check_and_fill(verify, None)
        except StoreError as damage:
            kept = [step for step in self._kept if step != self.step]
            if self._at_kept or not kept:
                raise
            raise self._refusal(f"{first_clause(damage)}: step {self.step} is damaged", kept) from None


class HostStore(_HostSlabs, StoreWriter):
    """Owns every slab; the runtime asks it for ranges of a unit's slabs and hands back new values. One process
    holds it, under an exclusive lock on its folder."""

    _read_only = False

    def __init__(self, root: Path, spec: StoreSpec, manifest: dict[str, Any], pin_memory: str, lock: int) -> None:
        super().__init__(root, spec, manifest, pin_memory, lock)
        self.fell_back: str | None = None  # the one line saying which kept step a damaged store went back to
        self.kept_damage: str | None = None  # the one line naming the kept steps whose records cannot be read
        if self._unreadable:
            steps = ", ".join(map(str, self._unreadable))
            self.kept_damage = (f"{'; '.join(map(first_clause, self._unreadable.values()))}: kept step(s) {steps} "
                                "cannot be gone back to or exported, and no state file is deleted while their "
                                "records are there (restore them, or delete them to let those steps go)")
        self.commit: Commit | None = None
        self._grad_checksums: dict[str, int] = {}
        self._unsaved: set[str] = set()  # units whose RAM-tier state changed since their state file was written

    # --- lifecycle ----------------------------------------------------------------------
    @classmethod
    def create(cls, root: str | Path, spec: StoreSpec, pin_memory: str = "none") -> "HostStore":
        root = Path(root)
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise StoreError(f"{root} exists and is not empty; choose a new run directory "
                             "(or continue an existing run with --resume)")
        (root / "slabs").mkdir(parents=True, exist_ok=True)
        for folder in (root.parent, root):  # the run directory's own entries survive a power loss too
            fsync_path(folder)
        store = cls(root, spec, new_manifest(spec.to_dict()), pin_memory, lock_run_dir(root))
        store._allocate_ram()
        return store

    @classmethod
    def open(cls, root: str | Path, pin_memory: str = "none", verify: bool = True,
             fall_back: bool = True, to_step: int | None = None, companions: Companions | None = None) -> "HostStore":
        """Open a store at its last commit to train it. `verify`: check every state file's checksum (a full
        read). A journaled step's units already updated are taken at that step (`journal`, `unit_version`).
        `fall_back`: where the last commit is damaged, go back to the newest intact kept step (`fell_back`), else
        raise `DamagedStep`. `to_step`: go back to that step (one of `intact_steps`), damaged or not. `companions`:
        checks a step's files beside the store's (a LoRA run's adapters), which a step needs intact too."""
        return cls._open(root, pin_memory, verify, fall_back=fall_back, to_step=to_step, companions=companions)

    @classmethod
    def intact_steps(cls, root: str | Path, pin_memory: str = "none",
                     companions: Companions | None = None) -> list[int]:
        """The steps an open could go back to, oldest first: the last commit's and each kept step's whose state
        files all check out (a full read). Nothing is written; where nothing can be read, none."""
        root = Path(root)
        records = dict(_readable_kept(root)[0])
        try:
            manifest = read_manifest(root)
            records[manifest["step"]] = manifest
        except StoreError:
            pass
        if not records:
            return []
        newest = records[max(records)]
        try:
            spec = StoreSpec.from_dict(newest["spec"])
        except StoreError:
            return []
        store = cls(root, spec, newest, pin_memory, lock_run_dir(root))
        store._companions = companions
        try:
            return [step for step in sorted(records) if store._intact(records[step])]
        finally:
            store.close()

    @property
    def journal(self) -> dict[str, Any] | None:
        return self._interrupted_step()

    def discard_journal(self) -> None:
        (self.root / JOURNAL).unlink(missing_ok=True)

    def unit_version(self, unit: str) -> int:
        return self.step + 1 if self.versions[unit] > self.generation else self.step

    def _load_units(self, verify: bool) -> None:
        """Nothing is written or deleted unless every file checks out, or those of a step to go back to."""
        if self._to_step is not None:
            step = self._to_step
            record = self.manifest if self._damage is None and step == self.step else self._kept.get(step)
            if record is None:
                raise StoreError(f"{self.root} does not keep step {step}; restore the run directory from a backup")
            self._go_back([(step, record)], verify, StoreError(f"step {step} of {self.root} is not intact; restore "
                                                               "the run directory from a backup"))
            self.fell_back = f"the run goes back to step {step}"
            return
        if self._damage is not None:  # no manifest to check: `_open` took the newest kept step's
            self._fall_back(self._damage, verify, own=False)
            return
        try:
            journal = self.journal
        except StoreError as damage:  # the step after the manifest's cannot be rolled forward
            self._fall_back(damage, verify, own=True)
            return
        try:
            self._check_and_fill(verify, journal)
        except StoreError as damage:
            self._fall_back(damage, verify, own=False)
            return
        if journal is None:
            self.discard_journal()  # one whose step the manifest already has
        self._remove_strays()

    def _fall_back(self, damage: StoreError, verify: bool, own: bool) -> None:
        """The last commit (or the step journaled after it) is damaged: go back to the newest step whose files all
        check out, the manifest's own where `own` (only its journal is damaged), else a kept one, and commit it as
        the store's step. The kept steps after it share the damaged files (or are damaged themselves) and are
        dropped; the steps after it are lost."""
        if not self._may_fall_back:
            raise DamagedStep(str(damage)) from None
        if not (own or self._kept):
            raise damage
        newest = None if self._damage is not None else self.step
        records = ([(self.step, self.manifest)] if own else []) + \
            [(step, self._kept[step]) for step in sorted(self._kept, reverse=True)]
        step = self._go_back(records, verify, damage)
        if own and step == newest:
            self.fell_back = (f"{first_clause(damage)}: the step after step {step} cannot be finished, so the run "
                              f"goes back to step {step}, its last commit (the step after it is trained again)")
        else:
            self.fell_back = (f"{first_clause(damage)}{'' if newest is None else f': step {newest} is damaged'}, "
                              f"so the run goes back to step {step}, the newest intact kept step (the steps after "
                              "it are trained again)")

    def _go_back(self, records: list[tuple[int, dict[str, Any]]], verify: bool, damage: StoreError) -> int:
        """Commit the first of `records` (step, its manifest) whose files all check out as the store's step, and
        return it; the kept steps after it are dropped. `damage` is raised where none checks out."""
        # Past every generation a commit of the damaged steps may have written: no new file takes such a name.
        generation = max(self.generation, self._files.last_generation(),
                         *(record["generation"] for record in self._kept.values())) + 1
        for step, record in records:
            self.manifest = {k: v for k, v in json.loads(json.dumps(record)).items() if k != "note"}
            self.step, self.versions = step, dict(record["units"])
            try:
                check_units(self.root, self.manifest, self.spec.config)
                self._check_and_fill(verify, None)
            except StoreError:
                continue
            break
        else:
            if not self._kept or len(records) == 1:
                raise damage
            raise StoreError(f"{damage}; no kept step is intact either") from None
        self.discard_journal()
        for later in [s for s in self._kept if s > step]:  # before the manifest: no record outlives its files
            drop_kept(self.root, later)
            del self._kept[later]
        self.generation = generation
        self._write_manifest()
        self._remove_strays()
        return step

    def _remove_strays(self) -> None:
        self._files.remove_strays({state_name(u, g) for u, g in self.versions.items()} | self._kept_names())
        for name in (MANIFEST, JOURNAL):
            (self.root / (name + ".tmp")).unlink(missing_ok=True)

    # --- gradients -------------------------------------------------------------------------
    def accumulate_grad(self, unit: str, grads: Sequence[torch.Tensor], first: bool,
                        scratch: torch.Tensor | None, persist: bool = True,
                        norm: bool = False) -> tuple[torch.Tensor | None, float]:
        self.check_consistent()  # an open commit may replay these gradients: never overwrite them
        if (ram := self._slabs.get(unit, "grad")) is not None:
            return fold_into(ram, grads, first), squared_norm(ram) if norm else 0.0
        assert scratch is not None, "disk-tier gradients need a scratch buffer"
        numel = self.numels[unit]
        if scratch.numel() >= numel:
            scratch = scratch[:numel]
            if not first:
                self._files.read_grad(unit, 0, scratch)
            fold_into(scratch, grads, first)
            if persist:
                self._files.write_grad(unit, scratch)
            return scratch, squared_norm(scratch) if norm else 0.0
        # A unit larger than the scratch buffer: folded through its file a block of the buffer's size at a time.
        sq_norm = 0.0
        for start in range(0, numel, scratch.numel()):
            block = scratch[:min(scratch.numel(), numel - start)]
            if not first:
                self._files.read_grad(unit, start, block)
            fold_into(block, grads, first, start=start)
            sq_norm += squared_norm(block) if norm else 0.0
            if persist:
                self._files.write_grad(unit, block, start)
        return None, sq_norm

    def sync_grads(self) -> None:
        """Make this step's gradients durable, and checksum them: the journal may replay the update from them."""
        if self.spec.placement.grad.durable:
            for unit in self.layouts:
                self._grad_checksums[unit] = self._files.sync_grad(unit)

    # --- updates and commits ----------------------------------------------------------------
    def check_consistent(self) -> None:
        if self.commit is None or self.commit.speculative:
            return
        if self.commit.journaled:
            raise StoreError(f"step {self.commit.step} is committed but its update was interrupted; reopen the "
                             "run (StreamingTrainer.open or `streamer train --resume`) to finish it")
        raise StoreError(f"writing step {self.commit.step}'s state was interrupted, so this process holds a mix "
                         "of two steps; reopen the run from its last commit")

    def begin_step(self, step: int, record: dict[str, Any]) -> None:
        self.check_consistent()
        journaled = self.spec.placement.state.journaled
        if journaled:
            self.sync_grads()
            grad_checksums = {unit: self._grad_checksums[unit] for unit in self.layouts}
            write_journal(self.root, {"step": step, "generation": self.generation + 1,
                                      "grad_checksums": grad_checksums, **record})
        self.commit = Commit(step, self.generation + 1, journaled)

    def begin_speculative_step(self, step: int) -> None:
        self.check_consistent()
        assert self.spec.placement.state.durable, "a speculative step returns to the previous state files"
        self.commit = Commit(step, self.generation + 1, journaled=False, speculative=True)

    def rollback(self) -> None:
        committed = self.manifest["units"]
        for unit in self.layouts:
            if self.versions[unit] != committed[unit]:
                self._files.delete(self._files.state_path(unit, self.versions[unit]))
                self.versions[unit] = committed[unit]
                self._fill_ram_from_file(unit)  # RAM kinds (compute, say) were updated in place
        self.commit = None

    def unit_writer(self, unit: str, step: int) -> "UnitWriter":
        """Disk-tier state is written to a new generation; RAM-tier state goes straight into its slabs."""
        if self.commit is None:  # rolling a journaled step forward, or the first write or loaded weights
            journal = self.journal
            self.commit = Commit(step, self.generation + 1, journal is not None and journal["step"] == step)
        persist = self.spec.placement.state.durable
        if not persist:
            self._unsaved.add(unit)
        return self._writer(unit, self.commit, persist)

    def _writer(self, unit: str, commit: Commit, persist: bool) -> "UnitWriter":
        file = self._files.new_generation(unit, commit.generation, self.versions.get(unit)) if persist else None
        return UnitWriter(unit, self.spec, self._slabs, file, lambda checksum: self._installed(unit, commit, checksum),
                          self._files.writes)

    def _installed(self, unit: str, commit: Commit, checksum: int) -> None:
        """A unit's new generation is in place. Within a journaled commit the old one is deleted at once (the
        journal can rebuild it, so disk holds one unit's extra copy at a time); otherwise it stays until the
        manifest names the new one."""
        old = self.versions.get(unit)
        self.versions[unit] = commit.generation
        self.manifest["checksums"][state_name(unit, commit.generation)] = checksum
        if old is not None and old != commit.generation and commit.journaled and \
                state_name(unit, old) not in self._kept_names():
            self._files.delete(self._files.state_path(unit, old))

    def finish_step(self, step: int, trainer_state: dict[str, Any]) -> None:
        if self.spec.placement.state.durable:  # a roll-forward may find every unit already written
            self.generation = max([self.generation, *self.versions.values()])
        self.step = step
        self.manifest["trainer"] = trainer_state
        if self.spec.placement.state.durable:
            self._write_manifest()
            self.discard_journal()  # a stale journal is recognised by its step on open
            self._remove_strays()
        self.commit = None

    def save(self, trainer_state: dict[str, Any]) -> None:
        self.check_consistent()
        self.manifest["trainer"] = trainer_state
        if self.spec.placement.state.durable:
            self._write_manifest()
            return
        commit = Commit(self.step, self.generation + 1, journaled=False)
        for unit, numel in self.numels.items():
            if self.spec.frozen and unit not in self._unsaved:
                continue  # a frozen base changes only when new weights are written: its state file holds it
            with self._writer(unit, commit, persist=True) as writer:
                for start, count in chunks(numel, self.spec.chunk):
                    for kind in self.spec.file_kinds():
                        writer.write(kind, start, self._raw(unit, kind, start, count))
        self.generation = commit.generation
        self._unsaved.clear()
        self._write_manifest()
        self._remove_strays()

    def keep(self, note: dict[str, Any]) -> None:
        """Keep the last commit (saved, on the RAM tier): no later commit deletes its state files."""
        self.check_consistent()
        if self.commit is not None or self.manifest["step"] != self.step or self._unsaved:
            raise StoreError(f"step {self.step} is not committed to disk yet; save() it before keeping it")
        keep_step(self.root, self.manifest, note)
        self._kept[self.step] = {**json.loads(json.dumps(self.manifest)), "note": note}
        self._unreadable.pop(self.step, None)  # a damaged record of the step, replaced

    def drop_kept(self, step: int) -> None:
        """Forget a kept step and delete its state files (those the last commit or another kept step names stay)."""
        drop_kept(self.root, step)
        del self._kept[step]
        self._remove_strays()

    def _write_manifest(self) -> None:
        current = {state_name(u, g) for u, g in self.versions.items()}
        self.manifest.update(step=self.step, generation=self.generation, units=dict(self.versions),
                             checksums={k: v for k, v in self.manifest["checksums"].items() if k in current})
        write_manifest(self.root, self.manifest)


class UnitWriter(StateWriter):
    """One unit's new state: RAM-tier kinds go into their slabs at once; with `file`, the file kinds also go,
    in order, to the unit's next state file, and closing installs it (`installed(checksum)`)."""

    def __init__(self, unit: str, spec: StoreSpec, slabs: SlabBackend, file: GenerationWriter | None,
                 installed: Callable[[int], None], scratch: Scratch) -> None:
        self.unit, self._spec, self._slabs, self._file, self._installed = unit, spec, slabs, file, installed
        self._scratch = scratch
        self._file_kinds = spec.file_kinds()

    def write(self, kind: str, start: int, values: torch.Tensor) -> None:
        if self._spec.quantized(kind):
            # once, for the slab and the file alike (others cast on copy)
            values = stored(self._spec, kind, values, self._scratch)
        self._slabs.write(self.unit, kind, start, values)
        if self._file is not None and kind in self._file_kinds:
            self._file.write(kind, start, values)

    def close(self) -> None:
        if self._file is not None:
            self._installed(self._file.finish())

    def discard(self) -> None:
        if self._file is not None:
            self._file.discard()


def _readable_kept(root: Path) -> tuple[dict[int, dict[str, Any]], dict[int, StoreError]]:
    """The kept steps' manifests, and the damage of each record that cannot be read: it is left where it is and
    not offered."""
    kept, unreadable = {}, {}
    for step in kept_steps(root):
        try:
            kept[step] = read_kept(root, step)
        except StoreError as exc:
            unreadable[step] = exc
    return kept, unreadable


def _newest_kept(root: Path, damage: StoreError) -> dict[str, Any]:
    """Where the manifest is missing or damaged: the newest kept step's manifest, which a writer that may
    `fall_back` goes back from (`HostStore._fall_back`) and a reader of a kept step reads past; others are refused
    (`_HostSlabs._open`) with one line naming the intact kept steps. Without a kept step to read, `damage` is raised."""
    kept = _readable_kept(root)[0]
    if not kept:
        raise damage
    return {k: v for k, v in kept[max(kept)].items() if k != "note"}


def first_clause(error: StoreError | str) -> str:
    """What is wrong, without the advice after it (`unit block.0: checksum mismatch in FILE`)."""
    return str(error).split("; ")[0]
