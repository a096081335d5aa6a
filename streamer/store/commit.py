"""How a store commits: its two records, read strictly and written here alone, the commit in progress, and the
run directory's lock.

- `manifest.json`: the last committed step, the generation of every unit's state file, their checksums and
  the trainer's state (config, losses, the caller's data order and RNG).
- `journal.json` (disk tier): a step whose gradients are durable and whose update may be unfinished, with
  what replaying it needs (lr, clip coefficient, gradient checksums, the trainer state after the step).
- `kept/<step>.json`: the manifest of a kept step (`streamer train --keep-last`), restartable and readable.

Records are written with `write_json_atomic` (tmp + fsync + rename + folder fsync), each with the xxh3-64
checksum of its fields, so a changed digit (an lr, a data position, a step) is found before it is used;
anything malformed in them is a StoreError naming the file. See docs/STORE.md.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layers import ModelConfig
from memory_model.tiers import DISK
from streamer.errors import StoreError
from streamer.store.slabfile import checksum_of, fsync_path, open_for_writing, write_json_atomic

MANIFEST, JOURNAL, FORMAT = "manifest.json", "journal.json", "weight-streaming-store/4"
KEPT = "kept"  # kept/<step>.json: the manifest of a kept step, whose state files later commits leave in place
_CRC32_FORMAT = "weight-streaming-store/2"  # crc32 checksums; format 3 has xxh3-64
# Format 3's disk tier also kept a compute-dtype copy in its state files; format 4 casts the fp32 master. Its
# stores without that copy (RAM tier, fp32 compute) have the same files as format 4.
_COMPUTE_COPY_FORMAT = "weight-streaming-store/3"
_RESTORE = "restore the run directory from a backup or start a new run"
CHECKSUM = "checksum"  # a record's own field: the xxh3-64 of the others (records written before it have none)


def state_name(unit: str, generation: int) -> str:
    return f"{unit}.{generation}.state"


def grad_name(unit: str) -> str:
    return f"{unit}.grad"


def _load(path: Path) -> Any:
    """A record's fields, its checksum checked and left out."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StoreError(f"{path} cannot be read ({exc}); it was left untouched — {_RESTORE}") from None
    if isinstance(raw, dict) and CHECKSUM in raw:
        given = raw.pop(CHECKSUM)
        _check(path, given == _record_checksum(raw), "its checksum does not match its contents")
    return raw


def _record_checksum(fields: dict[str, Any]) -> int:
    """The checksum of a record's fields, in a form that does not depend on their order or indentation."""
    return checksum_of(json.dumps(fields, sort_keys=True, separators=(",", ":")))


def _sealed(record: dict[str, Any], indent: int | None = None) -> str:
    """A record's text, its checksum last."""
    fields = {k: v for k, v in record.items() if k != CHECKSUM}
    return json.dumps({**fields, CHECKSUM: _record_checksum(fields)}, indent=indent)


def _check(path: Path, ok: bool, what: str) -> None:
    if not ok:
        raise StoreError(f"{path} is damaged or from another tool ({what}); it was left untouched — {_RESTORE}")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_checksum(value: Any) -> bool:
    return _is_count(value) and value < 2**64


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest's fields, type-checked (the spec itself is checked by StoreSpec.from_dict)."""
    path = root / MANIFEST
    if not path.is_file():
        if kept_steps(root):  # committed once: the kept steps remain (HostStore.open goes back to one)
            raise StoreError(f"{path} is missing")
        if (root / "slabs").is_dir():
            raise StoreError(f"{root} has no {MANIFEST}: nothing was committed (the run stopped before its first "
                             "step, or a RAM-tier run was never saved); delete the folder and start again")
        raise StoreError(f"{root} is not a weight-streaming store (no {MANIFEST}); "
                         "pass the run directory a training run created")
    return _checked_manifest(root, path)


def kept_steps(root: Path) -> list[int]:
    """The steps whose commits are kept (`keep_step`), oldest first."""
    folder = root / KEPT
    names = [p.stem for p in folder.glob("*.json")] if folder.is_dir() else []
    return sorted(int(n) for n in names if n.isdigit())


def read_kept(root: Path, step: int) -> dict[str, Any]:
    """A kept step's manifest, checked as the manifest is; a step not kept is refused naming those that are."""
    path = root / KEPT / f"{step}.json"
    if not path.is_file():
        kept = ", ".join(map(str, kept_steps(root))) or "none"
        raise StoreError(f"step {step} of {root} was not kept (kept steps: {kept}); pass one of them, or no step "
                         "for the last")
    manifest = _checked_manifest(root, path)
    _check(path, manifest["step"] == step, f"it holds step {manifest['step']}")
    return manifest


def keep_step(root: Path, manifest: dict[str, Any], note: dict[str, Any]) -> None:
    """Keep a committed step: its manifest (and `note`, what ranks it: its eval loss) under kept/, which names
    its state files to every later commit, so none deletes them."""
    (root / KEPT).mkdir(exist_ok=True)
    write_json_atomic(root / KEPT / f"{manifest['step']}.json", _sealed({**manifest, "note": note}, indent=1))


def drop_kept(root: Path, step: int) -> None:
    """Forget a kept step; its state files are then strays (streamer.store.files.StateFiles.remove_strays)."""
    (root / KEPT / f"{step}.json").unlink(missing_ok=True)
    fsync_path(root / KEPT)  # before its files go: a record never outlives them


def _checked_manifest(root: Path, path: Path) -> dict[str, Any]:
    raw = _load(path)
    _check(path, isinstance(raw, dict), "not a JSON object")
    if raw.get("format") == _CRC32_FORMAT:
        raise StoreError(f"{root} was written by an earlier weight-streaming ({_CRC32_FORMAT}, crc32 checksums); "
                         "export it to a Hugging Face checkpoint with that version and start a new run from it")
    if raw.get("format") == _COMPUTE_COPY_FORMAT:
        _upgrade_format_3(root, raw)
    _check(path, raw.get("format") == FORMAT, f"format {raw.get('format')!r}, expected {FORMAT!r}")
    for key in ("spec", "trainer", "units", "checksums"):
        _check(path, isinstance(raw.get(key), dict), f"'{key}' must be an object")
    _check(path, _is_count(raw.get("step")), "'step' must be a non-negative integer")
    _check(path, _is_count(raw.get("generation")), "'generation' must be a non-negative integer")
    _check(path, all(_is_count(g) and g <= raw["generation"] for g in raw["units"].values()),
           "'units' must map units to generations")
    _check(path, all(_is_checksum(c) for c in raw["checksums"].values()),
           "'checksums' must map files to xxh3-64 values")
    return raw


def new_manifest(spec: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a new store (`spec`: StoreSpec.to_dict()): nothing committed yet, not even step 0."""
    return {"format": FORMAT, "spec": spec, "step": None, "generation": 0, "units": {}, "checksums": {},
            "trainer": {}}


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Commit `manifest`: once this returns, a crash reopens the store at its step."""
    write_json_atomic(root / MANIFEST, _sealed(manifest, indent=1))


def write_journal(root: Path, record: dict[str, Any]) -> None:
    """Journal a step whose gradients are durable (`record`: step, generation, grad_checksums and what
    replaying its update needs); a crash from here on rolls the step forward."""
    write_json_atomic(root / JOURNAL, _sealed(record))


def _upgrade_format_3(root: Path, raw: dict[str, Any]) -> None:
    """A format-3 manifest is read as format 4 where its state files are the same, and refused where they
    hold the disk tier's compute-dtype copy (nothing on disk is changed either way)."""
    spec = raw.get("spec")
    placement = spec.get("placement") if isinstance(spec, dict) else None
    if isinstance(spec, dict) and isinstance(placement, dict) and placement.get("compute") == DISK \
            and spec.get("compute_dtype") != "fp32":
        raise StoreError(f"{root} was written by an earlier weight-streaming whose disk tier kept a compute copy "
                         f"in its state files ({_COMPUTE_COPY_FORMAT}); export it to a Hugging Face checkpoint "
                         "with that version (`streamer export`) and start a new run from it")
    raw["format"] = FORMAT


def check_units(root: Path, manifest: dict[str, Any], config: ModelConfig) -> None:
    """The manifest names a state generation for exactly the model's units. A model deeper than the manifest
    has units is refused before its units are listed: a damaged depth of millions would take minutes."""
    depth, stored = config.num_hidden_layers, len(manifest["units"])
    _check(root / MANIFEST, depth < stored, f"{stored} units for a model of {depth} layers")
    units = config.unit_names()
    missing, extra = sorted(set(units) - set(manifest["units"])), sorted(set(manifest["units"]) - set(units))
    _check(root / MANIFEST, not missing and not extra, f"units missing {missing}, unexpected {extra}")


def read_journal(root: Path, manifest: dict[str, Any], units: list[str]) -> dict[str, Any] | None:
    """The journaled step that follows the manifest's, or None (no journal, or one already committed)."""
    path = root / JOURNAL
    if not path.is_file():
        return None
    raw = _load(path)
    _check(path, isinstance(raw, dict), "not a JSON object")
    _check(path, _is_count(raw.get("step")) and _is_count(raw.get("generation")), "'step'/'generation'")
    if raw["step"] <= manifest["step"]:
        return None  # finish_step committed it; only the journal's removal did not reach the disk
    _check(path, raw["step"] == manifest["step"] + 1 and raw["generation"] == manifest["generation"] + 1,
           f"journal step {raw['step']} does not follow manifest step {manifest['step']}")
    _check(path, _is_number(raw.get("lr")) and _is_number(raw.get("clip_coef")), "'lr'/'clip_coef'")
    _check(path, isinstance(raw.get("trainer"), dict), "'trainer' must be an object")
    sums = raw.get("grad_checksums")
    _check(path, isinstance(sums, dict) and set(sums) == set(units) and all(map(_is_checksum, sums.values())),
           "'grad_checksums' must give an xxh3-64 checksum for every unit")
    return raw


@dataclass(frozen=True)
class Commit:
    """A commit in progress: `step`'s state goes to `generation`. A journaled one survives a crash; a
    speculative one (the fused update) may still be rolled back to the previous generation, which it keeps."""

    step: int
    generation: int
    journaled: bool
    speculative: bool = False


def lock_run_dir(root: Path) -> int:
    """An exclusive lock on the run directory for this process's lifetime (released by the kernel on exit)."""
    return lock_file(root / "lock", StoreError(f"{root} is in use by another training or tool process; wait for "
                                               "it to finish (two writers would corrupt the store)"))


def lock_for_reading(root: Path) -> int:
    """A shared lock on the run directory, which readers hold together and a writer's exclusive lock excludes;
    -1 (no lock) where the lock file is missing and cannot be created (a read-only folder or mount).

    The lock file is opened read-only, so a folder nobody may write to (archived, shared, mounted read-only)
    can still be read: every store that was ever written has one, and it is created only where it is missing.
    """
    path = root / "lock"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or path.exists():
            raise StoreError(f"cannot open {path}: {exc.strerror or exc}") from None
        return -1  # no writer holds it: a writer creates the file before it writes anything
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StoreError(f"{root} is being trained by another process; wait for it to finish and read it "
                         "then") from None
    return fd


def lock_file(path: Path, busy: Exception) -> int:
    """The descriptor of `path` (created if need be), flocked exclusively; `busy` is raised if another has it."""
    fd = open_for_writing(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise busy from None
    return fd
