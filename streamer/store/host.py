"""Host store: each unit's compute weights, fp32 master weights, Adam moments and gradient, in RAM or files.

Commits (docs/STORE.md): every commit writes a new *generation* of each unit's state file. A disk-tier step
is durable once its gradients are fsynced and `journal.json` names it; then each unit's next generation is
written to a tmp file, fsynced and renamed, and its old generation deleted. A crash mid-update leaves every
unit at step s or s+1, and `open()` reports the journal so the trainer rolls the rest forward from the same
gradients: bit-identical to an uninterrupted run. Other commits (the first write, loading weights, a RAM-tier
save) keep the old generation until the manifest names the new one.
"""
from __future__ import annotations

import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from layers import GPTJConfig, unit_names
from memory_model.schedule import chunks
from streamer.store.commit import (
    FORMAT, JOURNAL, MANIFEST, Commit, UnitWriter, check_units, grad_name, lock_run_dir, read_journal, read_manifest,
    state_name,
)
from streamer.errors import StoreError
from streamer.store.layout import DTYPES, Placement, UnitLayout, fold_into, model_layouts
from streamer.store.slabfile import (
    TRAILER_BYTES, Checksum, check_size, check_state_file, checksum_while_syncing, disk_error, fsync_dir, pread_into,
    pwrite_from, verify_checksums, write_json_atomic,
)

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class StoreSpec:
    config: GPTJConfig
    compute_dtype: str = "bf16"
    moment_dtype: str = "fp32"
    placement: Placement = field(default_factory=Placement)
    chunk: int = 16 * 2**20  # params per update chunk; also the interleave unit of state files

    def __post_init__(self) -> None:
        for name in ("compute_dtype", "moment_dtype"):
            if getattr(self, name) not in DTYPES:
                raise StoreError(f"{name} must be one of {list(DTYPES)}, got {getattr(self, name)!r}")
        if not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk <= 0:
            raise StoreError(f"chunk must be a positive number of parameters, got {self.chunk!r}")
        if self.placement.compute == "disk" and self.placement.state != "disk":
            # Disk compute weights live in the state files, which a RAM-state store writes only on save().
            raise StoreError("placement compute='disk' needs state='disk' (compute weights are stored in the "
                             "state files); use store='disk' or keep compute in RAM")

    @property
    def compute_is_master(self) -> bool:
        """fp32 compute weights are the master weights themselves: no second copy."""
        return self.compute_dtype == "fp32"

    def kind_dtype(self, kind: str) -> torch.dtype:
        if kind == "master" or kind == "grad":
            return torch.float32
        if kind == "compute":
            return DTYPES[self.compute_dtype]
        return DTYPES[self.moment_dtype]

    def file_kinds(self) -> tuple[str, ...]:
        """Kinds stored, chunk-interleaved, in a unit's state file."""
        with_compute = self.placement.compute == "disk" and not self.compute_is_master
        return STATE_KINDS + (("compute",) if with_compute else ())

    def ram_kinds(self) -> tuple[str, ...]:
        """Kinds held in RAM slabs (pinned on CUDA); fp32 compute weights are the master weights, not a copy."""
        tiers = {"compute": self.placement.compute, "grad": self.placement.grad,
                 **{k: self.placement.state for k in STATE_KINDS}}
        return tuple(k for k, tier in tiers.items()
                     if tier == "ram" and not (k == "compute" and self.compute_is_master))

    def chunk_bytes(self, count: int) -> int:
        """Bytes of one chunk of `count` parameters in a state file (every file kind, interleaved)."""
        return sum(count * self.kind_dtype(k).itemsize for k in self.file_kinds())

    def state_bytes(self, numel: int) -> int:
        """Data bytes of a state file of a unit of `numel` parameters (the trailer follows them)."""
        return sum(self.chunk_bytes(c) for _, c in chunks(numel, self.chunk))

    def host_bytes(self) -> tuple[int, int]:
        """(RAM, disk) bytes of the whole store at its largest. State files are written on every commit (the RAM
        tier's on a save), and while one is committed a unit has two generations on disk: the old one is
        deleted only once the new one is in place. Disk-tier gradients have a file of their own."""
        ram = disk = 0
        numels: dict[str, int] = {}  # per unit type: every block has the same shapes, and laying one out takes ~1 ms
        for unit in unit_names(self.config):
            kind = unit.split(".")[0]
            if kind not in numels:
                numels[kind] = UnitLayout.of(self.config, unit).numel
            numel = numels[kind]
            ram += sum(numel * self.kind_dtype(k).itemsize for k in self.ram_kinds())
            disk += 2 * (self.state_bytes(numel) + TRAILER_BYTES)
            disk += numel * self.kind_dtype("grad").itemsize if self.placement.grad == "disk" else 0
        return ram, disk

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.__dict__, "compute_dtype": self.compute_dtype,
                "moment_dtype": self.moment_dtype, "placement": self.placement.to_dict(), "chunk": self.chunk}

    @classmethod
    def from_dict(cls, raw: Any) -> "StoreSpec":
        try:
            if set(raw) != {"config", "compute_dtype", "moment_dtype", "placement", "chunk"}:
                raise ValueError(f"fields {sorted(map(str, raw))}")
            return cls(GPTJConfig.from_dict(raw["config"]), raw["compute_dtype"], raw["moment_dtype"],
                       Placement(**raw["placement"]), raw["chunk"])
        except (ValueError, KeyError, TypeError) as exc:  # layers' ConfigError is a ValueError
            raise StoreError(f"store spec is malformed ({exc})") from None


class HostStore:
    """Owns every slab; the runtime asks it for ranges of a unit's slabs and hands back new values."""

    def __init__(self, root: Path, spec: StoreSpec, manifest: dict[str, Any], pin: bool, lock: int) -> None:
        self.root, self.spec, self.manifest, self._lock = root, spec, manifest, lock
        self.layouts = {lay.name: lay for lay in model_layouts(spec.config)}
        self.step: int = manifest["step"] if manifest["step"] is not None else 0
        self.generation: int = manifest["generation"]
        self.versions: dict[str, int] = dict(manifest["units"])  # unit -> generation of its state file
        self.commit: Commit | None = None
        self._grad_checksums: dict[str, int] = {}
        self._checksums: ThreadPoolExecutor | None = None
        self._ram: dict[tuple[str, str], torch.Tensor] = {}
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        for unit, lay in self.layouts.items():
            for kind in spec.ram_kinds():
                buf = torch.zeros(lay.numel, dtype=spec.kind_dtype(kind))
                self._ram[unit, kind] = buf.pin_memory() if pin else buf

    # --- lifecycle ----------------------------------------------------------------------
    @classmethod
    def create(cls, root: str | Path, spec: StoreSpec, pin: bool = False) -> "HostStore":
        root = Path(root)
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise StoreError(f"{root} exists and is not empty; choose a new run directory "
                             "(or continue an existing run with --resume)")
        (root / "slabs").mkdir(parents=True, exist_ok=True)
        for folder in (root.parent, root):  # the run directory's own entries survive a power loss too
            fsync_dir(folder)
        manifest = {"format": FORMAT, "spec": spec.to_dict(), "step": None, "generation": 0, "units": {},
                    "checksums": {}, "trainer": {}}
        return cls(root, spec, manifest, pin, lock_run_dir(root))

    @classmethod
    def open(cls, root: str | Path, pin: bool = False, verify: bool = True) -> "HostStore":
        """Open a store at its last commit. `verify`: check every state file's checksum (a full read)."""
        root = Path(root)
        manifest = read_manifest(root)
        try:
            spec = StoreSpec.from_dict(manifest["spec"])
        except StoreError as exc:
            raise StoreError(f"{root / MANIFEST}: {exc}; it was left untouched") from None
        lock, store = lock_run_dir(root), None
        try:
            store = cls(root, spec, manifest, pin, lock)
            check_units(root, manifest, list(store.layouts))
            store._load_units(verify)
        except BaseException:
            store.close() if store is not None else os.close(lock)
            raise
        return store

    @property
    def journal(self) -> dict[str, Any] | None:
        """The journaled step after the committed one, if any: after a crash, the trainer rolls it forward."""
        if self.spec.placement.state != "disk":
            return None
        return read_journal(self.root, self.manifest, list(self.layouts))

    def unit_version(self, unit: str) -> int:
        """The step whose state this unit holds (one ahead of the manifest once its update is durable)."""
        return self.step + 1 if self.versions[unit] > self.generation else self.step

    def _state_path(self, unit: str, generation: int) -> Path:
        return self.root / "slabs" / state_name(unit, generation)

    def _grad_path(self, unit: str) -> Path:
        return self.root / "slabs" / grad_name(unit)

    def _load_units(self, verify: bool) -> None:
        """Check every unit's state file (size, trailer, checksum) and, with a journal, the gradients to replay;
        then fill the RAM tier. Nothing is written or deleted unless all of them are sound."""
        journal = self.journal
        checks = []
        for unit, layout in self.layouts.items():
            expected = self.manifest["checksums"].get(state_name(unit, self.versions[unit]))
            if journal is not None and self._state_path(unit, journal["generation"]).is_file():
                self.versions[unit], expected = journal["generation"], None  # updated before the crash
            elif journal is not None:  # still to update: the roll-forward replays its journaled gradient
                grad = self._grad_path(unit)
                check_size(unit, grad, layout.numel * 4, f"gradient file (needed to finish step {journal['step']})")
                checks.append(Checksum(unit, grad, layout.numel * 4, frozenset({journal["grad_checksums"][unit]})))
            path = self._state_path(unit, self.versions[unit])
            trailer = check_state_file(unit, path, self.versions[unit], self._state_bytes(unit))
            wanted = {trailer.checksum} | ({expected} if expected is not None else set())
            checks.append(Checksum(unit, path, trailer.data_bytes, frozenset(wanted)))
        if verify:
            verify_checksums(checks)
        for unit in self.layouts:
            self._fill_ram_from_file(unit, self._state_path(unit, self.versions[unit]))
        if journal is None:
            (self.root / JOURNAL).unlink(missing_ok=True)  # one whose step the manifest already has
        self._cleanup_stray_files()

    def _cleanup_stray_files(self) -> None:
        """Other generations and tmp files: what a crash or an unfinished commit left behind (files of any
        other name are not ours, and stay)."""
        keep = {self._state_path(u, v).name for u, v in self.versions.items()}
        for path in (self.root / "slabs").iterdir():
            ours = re.fullmatch(r"(.+)\.\d+\.state(\.tmp)?", path.name)
            if ours and ours.group(1) in self.layouts and path.name not in keep and path.is_file():
                self._close(path)
                path.unlink()
        for name in (MANIFEST, JOURNAL):
            (self.root / (name + ".tmp")).unlink(missing_ok=True)

    # --- file layout --------------------------------------------------------------------
    def _state_bytes(self, unit: str) -> int:
        return self.spec.state_bytes(self.layouts[unit].numel)

    def _kind_offset(self, unit: str, kind: str, start: int, count: int) -> int:
        """Byte offset of `kind`'s piece of the chunk starting at element `start` (chunk-interleaved file)."""
        if start % self.spec.chunk:
            raise ValueError("state ranges start on chunk boundaries")
        offset = (start // self.spec.chunk) * self.spec.chunk_bytes(self.spec.chunk)
        for k in self.spec.file_kinds():
            if k == kind:
                return offset
            offset += count * self.spec.kind_dtype(k).itemsize
        raise KeyError(kind)

    def _fd(self, path: Path, create: bool = False) -> int:
        """A cached descriptor; only writers create files, so a missing file read is an error naming it."""
        key = str(path)
        with self._fd_lock:  # the I/O thread and the main thread both open files
            if key not in self._fds:
                try:
                    self._fds[key] = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
                except FileNotFoundError:
                    raise StoreError(f"{path} is missing; the store is incomplete — restore the run folder") from None
                except OSError as exc:
                    raise disk_error(exc, path) from None
            return self._fds[key]

    def _close(self, path: Path) -> None:
        with self._fd_lock:
            fd = self._fds.pop(str(path), None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        if self._checksums is not None:
            self._checksums.shutdown()
            self._checksums = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._lock >= 0:
            os.close(self._lock)  # releases the flock
            self._lock = -1

    # --- reads ----------------------------------------------------------------------------
    def ram(self, unit: str, kind: str) -> torch.Tensor | None:
        """The RAM slab itself (for zero-copy use where host and device share memory), or None if on disk."""
        if kind == "compute" and self.spec.compute_is_master:
            kind = "master"
        return self._ram.get((unit, kind))

    def read_compute(self, unit: str, out: torch.Tensor) -> None:
        kind = "master" if self.spec.compute_is_master else "compute"
        if (ram := self.ram(unit, kind)) is not None:
            out.copy_(ram)
            return
        path = self._state_path(unit, self.versions[unit])
        for start, count in chunks(self.layouts[unit].numel, self.spec.chunk):
            pread_into(self._fd(path), out[start:start + count], self._kind_offset(unit, kind, start, count), path)

    def read_state(self, unit: str, kind: str, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + out.numel()) of a state kind or "grad", converted to out's dtype."""
        stored = self.spec.kind_dtype(kind)
        if (ram := self.ram(unit, kind)) is not None:
            out.copy_(ram[start:start + out.numel()])
            return
        target = out if out.dtype == stored else torch.empty(out.numel(), dtype=stored)
        if kind == "grad":
            path, offset = self._grad_path(unit), start * stored.itemsize
        else:
            path = self._state_path(unit, self.versions[unit])
            offset = self._kind_offset(unit, kind, start, out.numel())
        pread_into(self._fd(path), target, offset, path)
        if target is not out:
            out.copy_(target)

    def _fill_ram_from_file(self, unit: str, path: Path) -> None:
        """Load RAM-tier kinds from a unit's state file; RAM compute weights are rebuilt from the masters."""
        rebuild_compute = (unit, "compute") in self._ram and "compute" not in self.spec.file_kinds()
        wanted = [k for k in self.spec.file_kinds() if (unit, k) in self._ram]
        if not wanted and not rebuild_compute:
            return
        fd = self._fd(path)
        for start, count in chunks(self.layouts[unit].numel, self.spec.chunk):
            for kind in wanted:
                pread_into(fd, self._ram[unit, kind][start:start + count],
                           self._kind_offset(unit, kind, start, count), path)
            if rebuild_compute:
                if (unit, "master") in self._ram:
                    master = self._ram[unit, "master"][start:start + count]
                else:
                    master = torch.empty(count, dtype=torch.float32)
                    pread_into(fd, master, self._kind_offset(unit, "master", start, count), path)
                self._ram[unit, "compute"][start:start + count].copy_(master)
        self._close(path)

    # --- gradients -------------------------------------------------------------------------
    def accumulate_grad(self, unit: str, grads: Sequence[torch.Tensor], first: bool,
                        scratch: torch.Tensor | None) -> torch.Tensor:
        """Add a host-side gradient (tensors laid end to end in layout order: one per parameter, or one flat)
        into the unit's fp32 accumulator; returns the accumulated fp32 values.

        `scratch` is an fp32 buffer of the unit's size for the disk tier (reused across calls).
        """
        self.check_consistent()  # an open commit may replay these gradients: never overwrite them
        if (ram := self.ram(unit, "grad")) is not None:
            return fold_into(ram, grads, first)
        assert scratch is not None, "disk-tier gradients need a scratch buffer"
        path = self._grad_path(unit)
        if not first:
            pread_into(self._fd(path), scratch, 0, path)
        fold_into(scratch, grads, first)
        pwrite_from(self._fd(path, create=True), scratch, 0, path)
        return scratch

    def sync_grads(self) -> None:
        """Make this step's gradients durable, and checksum them: the journal may replay the update from them."""
        if self.spec.placement.grad == "disk":
            for unit, layout in self.layouts.items():
                path = self._grad_path(unit)
                self._grad_checksums[unit] = self.sync_and_checksum(self._fd(path), path, layout.numel * 4)

    def sync_and_checksum(self, fd: int, path: Path, length: int) -> int:
        """Flush a file written through the page cache; returns the checksum of its first `length` bytes."""
        if self._checksums is None:
            self._checksums = ThreadPoolExecutor(1, thread_name_prefix="store-checksum")
        return checksum_while_syncing(fd, path, length, self._checksums)

    # --- updates and commits ----------------------------------------------------------------
    def check_consistent(self) -> None:
        """Raise if an update stopped part-way in this process: units hold two different steps."""
        if self.commit is None:
            return
        if self.commit.journaled:
            raise StoreError(f"step {self.commit.step} is committed but its update was interrupted; reopen the "
                             "run (StreamingTrainer.open or `streamer train --resume`) to finish it")
        raise StoreError(f"writing step {self.commit.step}'s state was interrupted, so this process holds a mix "
                         "of two steps; reopen the run from its last commit")

    def begin_step(self, step: int, record: dict[str, Any]) -> None:
        """Journal step `step` (everything needed to replay its update) once its gradients are durable."""
        self.check_consistent()
        journaled = self.spec.placement.state == "disk"
        if journaled:
            self.sync_grads()
            grad_checksums = {unit: self._grad_checksums[unit] for unit in self.layouts}
            write_json_atomic(self.root / JOURNAL, json.dumps(
                {"step": step, "generation": self.generation + 1, "grad_checksums": grad_checksums, **record}))
        self.commit = Commit(step, self.generation + 1, journaled)

    def unit_writer(self, unit: str, step: int) -> "UnitWriter":
        """Where an update hands back a unit's new state; disk-tier state is written to a new generation."""
        if self.commit is None:  # rolling a journaled step forward, or the first write or loaded weights
            journal = self.journal
            self.commit = Commit(step, self.generation + 1, journal is not None and journal["step"] == step)
        return UnitWriter(self, unit, self.commit, persist=self.spec.placement.state == "disk")

    def finish_step(self, step: int, trainer_state: dict[str, Any]) -> None:
        """All units are at `step`: the disk tier writes the manifest; the RAM tier just advances."""
        if self.spec.placement.state == "disk":  # a roll-forward may find every unit already written
            self.generation = max([self.generation, *self.versions.values()])
        self.step = step
        self.manifest["trainer"] = trainer_state
        if self.spec.placement.state == "disk":
            self._write_manifest()
            (self.root / JOURNAL).unlink(missing_ok=True)  # a stale journal is recognised by its step on open
            self._cleanup_stray_files()
        self.commit = None

    def save(self, trainer_state: dict[str, Any]) -> None:
        """Persist RAM-tier state at the current step (new generation, manifest, then the old files go)."""
        self.check_consistent()
        self.manifest["trainer"] = trainer_state
        if self.spec.placement.state == "disk":
            self._write_manifest()
            return
        commit = Commit(self.step, self.generation + 1, journaled=False)
        for unit, lay in self.layouts.items():
            with UnitWriter(self, unit, commit, persist=True) as writer:
                for start, count in chunks(lay.numel, self.spec.chunk):
                    for kind in self.spec.file_kinds():
                        writer.write(kind, start, self._ram[unit, kind][start:start + count])
        self.generation = commit.generation
        self._write_manifest()
        self._cleanup_stray_files()

    def _write_manifest(self) -> None:
        current = {state_name(u, g) for u, g in self.versions.items()}
        self.manifest.update(step=self.step, generation=self.generation, units=dict(self.versions),
                             checksums={k: v for k, v in self.manifest["checksums"].items() if k in current})
        write_json_atomic(self.root / MANIFEST, json.dumps(self.manifest, indent=1))
