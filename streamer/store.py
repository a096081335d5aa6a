"""Host store: each unit's compute weights, fp32 master weights, Adam moments and gradient, in RAM or files.

Commits (docs/STORE.md): a disk-tier step is durable once its gradients are fsynced and the journal names the
step; each unit's new state is written to `<unit>.<step>.state.tmp`, fsynced and renamed, and the old version
deleted. A crash mid-update leaves every unit at step s or s+1, and `open()` reports the journal so the trainer
rolls the remaining units forward from the same gradients: bit-identical to an uninterrupted run.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from layers import GPTJConfig
from streamer.errors import StoreError
from streamer.layout import DTYPES, Placement, UnitLayout, model_layouts
from streamer.slabfile import (
    crc32_of, disk_error, file_crc32, fsync_dir, pread_into, pwrite_from, write_json_atomic,
)

MANIFEST, JOURNAL, FORMAT = "manifest.json", "journal.json", "weight-streaming-store/1"
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
        if not isinstance(self.chunk, int) or self.chunk <= 0:
            raise StoreError(f"chunk must be a positive number of parameters, got {self.chunk!r}")

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

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.__dict__, "compute_dtype": self.compute_dtype,
                "moment_dtype": self.moment_dtype, "placement": self.placement.to_dict(), "chunk": self.chunk}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "StoreSpec":
        return cls(GPTJConfig.from_dict(raw["config"]), raw["compute_dtype"], raw["moment_dtype"],
                   Placement(**raw["placement"]), raw["chunk"])


def chunks(numel: int, size: int) -> list[tuple[int, int]]:
    """(start, count) pieces of a slab, in file order."""
    return [(s, min(size, numel - s)) for s in range(0, numel, size)]


class HostStore:
    """Owns every slab; the runtime asks it for ranges of a unit's slabs and hands back new values."""

    def __init__(self, root: Path, spec: StoreSpec, manifest: dict[str, Any], pin: bool) -> None:
        self.root, self.spec, self.manifest = root, spec, manifest
        self.layouts = {lay.name: lay for lay in model_layouts(spec.config)}
        self.step: int = manifest["step"] if manifest["step"] is not None else 0
        self.versions: dict[str, int] = dict(manifest.get("units", {}))
        self._ram: dict[tuple[str, str], torch.Tensor] = {}
        self._fds: dict[str, int] = {}
        tiers = {"compute": spec.placement.compute, "grad": spec.placement.grad}
        tiers.update({k: spec.placement.state for k in STATE_KINDS})
        for unit, lay in self.layouts.items():
            for kind, tier in tiers.items():
                if tier == "ram" and not (kind == "compute" and spec.compute_is_master):
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
        manifest = {"format": FORMAT, "spec": spec.to_dict(), "step": None, "units": {}, "trainer": {}}
        return cls(root, spec, manifest, pin)

    @classmethod
    def open(cls, root: str | Path, pin: bool = False, verify: bool = True) -> "HostStore":
        root = Path(root)
        path = root / MANIFEST
        if not path.is_file():
            raise StoreError(f"{root} is not a weight-streaming store (no {MANIFEST}); "
                             "pass the run directory a training run created")
        try:
            manifest = json.loads(path.read_text())
            if manifest.get("format") != FORMAT:
                raise ValueError(f"format {manifest.get('format')!r}")
            spec = StoreSpec.from_dict(manifest["spec"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{path} is damaged or from another tool ({exc}); it was left untouched") from None
        if manifest["step"] is None:
            raise StoreError(f"{root} was never saved (a RAM-tier store is written by trainer.save()); "
                             "nothing to continue from")
        store = cls(root, spec, manifest, pin)
        store._load_units(verify)
        return store

    @property
    def journal(self) -> dict[str, Any] | None:
        """The step that was committed but whose update did not finish, if any (see `roll_forward`)."""
        path = self.root / JOURNAL
        return json.loads(path.read_text()) if path.is_file() else None

    def unit_version(self, unit: str) -> int:
        return self.versions[unit]

    def _state_path(self, unit: str, version: int) -> Path:
        return self.root / "slabs" / f"{unit}.{version}.state"

    def _grad_path(self, unit: str) -> Path:
        return self.root / "slabs" / f"{unit}.grad"

    def _load_units(self, verify: bool) -> None:
        journal = self.journal
        crcs = self.manifest.setdefault("crc", {})
        for unit in self.layouts:
            path = self._state_path(unit, self.versions[unit])
            if journal is not None and (rolled := self._state_path(unit, journal["step"])).is_file():
                # This unit's update finished before the crash; its checksum was never in a manifest.
                self.versions[unit], path = journal["step"], rolled
                crcs[rolled.name] = file_crc32(rolled)
            if not path.is_file():
                raise StoreError(f"unit {unit}: slab file {path} is missing; the store is incomplete — "
                                 "restore the run directory from a backup")
            expected = self._state_bytes(unit)
            if path.stat().st_size != expected:
                raise StoreError(f"unit {unit}: {path} has {path.stat().st_size} bytes, expected {expected} "
                                 "(truncated or from another run)")
            if verify and crcs.get(path.name) is not None and file_crc32(path) != crcs[path.name]:
                raise StoreError(f"unit {unit}: checksum mismatch in {path}; the file is corrupted — "
                                 "restore the run directory from a backup")
            self._fill_ram_from_file(unit, path)
        self._cleanup_stray_files()

    def _cleanup_stray_files(self) -> None:
        keep = {self._state_path(u, v).name for u, v in self.versions.items()}
        keep |= {self._grad_path(u).name for u in self.layouts}
        for path in (self.root / "slabs").iterdir():
            if path.name not in keep:
                path.unlink()

    # --- file layout --------------------------------------------------------------------
    def _chunk_bytes(self, count: int) -> int:
        return sum(count * self.spec.kind_dtype(k).itemsize for k in self.spec.file_kinds())

    def _state_bytes(self, unit: str) -> int:
        return sum(self._chunk_bytes(c) for _, c in chunks(self.layouts[unit].numel, self.spec.chunk))

    def _kind_offset(self, unit: str, kind: str, start: int, count: int) -> int:
        """Byte offset of `kind`'s piece of the chunk starting at element `start` (chunk-interleaved file)."""
        if start % self.spec.chunk:
            raise ValueError("state ranges start on chunk boundaries")
        offset = (start // self.spec.chunk) * self._chunk_bytes(self.spec.chunk)
        for k in self.spec.file_kinds():
            if k == kind:
                return offset
            offset += count * self.spec.kind_dtype(k).itemsize
        raise KeyError(kind)

    def _fd(self, path: Path, flags: int = os.O_RDWR) -> int:
        key = str(path)
        if key not in self._fds:
            try:
                self._fds[key] = os.open(path, flags | os.O_CREAT, 0o644)
            except OSError as exc:
                raise disk_error(exc, path) from None
        return self._fds[key]

    def _close(self, path: Path) -> None:
        fd = self._fds.pop(str(path), None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

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
        fd = self._fd(path, os.O_RDONLY)
        master = torch.empty(0)
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
    def accumulate_grad(self, unit: str, grad: torch.Tensor, first: bool, scratch: torch.Tensor | None) -> torch.Tensor:
        """Add a host-side gradient into the unit's fp32 accumulator; returns the accumulated fp32 values.

        `scratch` is an fp32 buffer of the unit's size for the disk tier (reused across calls).
        """
        if (ram := self.ram(unit, "grad")) is not None:
            ram.copy_(grad) if first else ram.add_(grad)
            return ram
        assert scratch is not None, "disk-tier gradients need a scratch buffer"
        path = self._grad_path(unit)
        if first:
            scratch.copy_(grad)
        else:
            pread_into(self._fd(path), scratch, 0, path)
            scratch.add_(grad)
        pwrite_from(self._fd(path), scratch, 0, path)
        return scratch

    def sync_grads(self) -> None:
        """Make this step's gradients durable: the journal that follows may replay the update from them."""
        if self.spec.placement.grad == "disk":
            for unit in self.layouts:
                os.fsync(self._fd(self._grad_path(unit)))

    # --- updates and commits ----------------------------------------------------------------
    def begin_step(self, step: int, record: dict[str, Any]) -> None:
        """Journal step `step` (everything needed to replay its update) once its gradients are durable."""
        if self.spec.placement.state == "disk":
            self.sync_grads()
            write_json_atomic(self.root / JOURNAL, json.dumps({"step": step, **record}))

    def unit_writer(self, unit: str, step: int) -> "UnitWriter":
        """Where an update hands back a unit's new state; disk-tier state is written to a new version file."""
        return UnitWriter(self, unit, step, persist=self.spec.placement.state == "disk")

    def finish_step(self, step: int, trainer_state: dict[str, Any]) -> None:
        """All units are at `step`: the disk tier writes the manifest; the RAM tier just advances."""
        self.step = step
        self.manifest["trainer"] = trainer_state
        if self.spec.placement.state == "disk":
            self._write_manifest()
            (self.root / JOURNAL).unlink(missing_ok=True)

    def save(self, trainer_state: dict[str, Any]) -> None:
        """Persist RAM-tier state at the current step (new version files, manifest, then old files go)."""
        self.manifest["trainer"] = trainer_state
        if self.spec.placement.state == "disk":
            self._write_manifest()
            return
        for unit, lay in self.layouts.items():
            with UnitWriter(self, unit, self.step, persist=True) as writer:
                for start, count in chunks(lay.numel, self.spec.chunk):
                    for kind in self.spec.file_kinds():
                        writer.write(kind, start, self._ram[unit, kind][start:start + count])
        self._write_manifest()
        self._cleanup_stray_files()

    def _write_manifest(self) -> None:
        self.manifest.update(step=self.step, units=dict(self.versions))
        write_json_atomic(self.root / MANIFEST, json.dumps(self.manifest, indent=1))


class UnitWriter:
    """Writes one unit's next state version chunk by chunk; closing makes it durable and retires the old one."""

    def __init__(self, store: HostStore, unit: str, step: int, persist: bool) -> None:
        self.store, self.unit, self.step, self.on_disk = store, unit, step, persist
        self.tmp = store._state_path(unit, step).with_suffix(".state.tmp")
        self._crc, self._next = 0, 0

    def __enter__(self) -> "UnitWriter":
        return self

    def write(self, kind: str, start: int, values: torch.Tensor) -> None:
        """Hand back new values for `kind` of elements [start, start + n); chunks in order, kinds in file order."""
        store = self.store
        if (ram := store._ram.get((self.unit, kind))) is not None:
            target = ram[start:start + values.numel()]
            if target.data_ptr() != values.data_ptr():
                target.copy_(values)
        if not self.on_disk or kind not in store.spec.file_kinds():
            return
        values = values.to(store.spec.kind_dtype(kind)).contiguous()
        offset = store._kind_offset(self.unit, kind, start, values.numel())
        if offset != self._next:
            raise ValueError(f"state file writes must be sequential (got offset {offset}, expected {self._next})")
        pwrite_from(store._fd(self.tmp), values, offset, self.tmp)
        self._crc = crc32_of(values, self._crc)
        self._next = offset + values.numel() * values.element_size()

    def __exit__(self, exc_type: object, *_: object) -> None:
        store = self.store
        if not self.on_disk:
            return
        if exc_type is not None:
            store._close(self.tmp)
            self.tmp.unlink(missing_ok=True)
            return
        final = store._state_path(self.unit, self.step)
        try:
            os.fsync(store._fd(self.tmp))
            store._close(self.tmp)
            os.replace(self.tmp, final)
            fsync_dir(final.parent)
        except OSError as exc:
            raise disk_error(exc, final) from None
        old = store.versions.get(self.unit)
        store.versions[self.unit] = self.step
        store.manifest.setdefault("crc", {})[final.name] = self._crc
        if old is not None and old != self.step:
            old_path = store._state_path(self.unit, old)
            store._close(old_path)
            old_path.unlink(missing_ok=True)
            store.manifest["crc"].pop(old_path.name, None)
