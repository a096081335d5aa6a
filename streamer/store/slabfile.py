"""Slab files: positional reads and writes between files and tensors without staging copies, and checks.

Every state file ends in a fixed-size trailer naming its unit, its generation, its data length and the
checksum (xxh3-64) of its data, so a file can be checked on its own: a torn, truncated, renamed or foreign
file is recognised even when no manifest lists it yet (a unit rolled forward after a crash). Every check
names the unit and the file, and only reads.
"""
from __future__ import annotations

import errno
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import xxhash

from memory_model.host import CHECKSUM_BLOCK_BYTES
from streamer.errors import StoreError

_TRAILER = struct.Struct("<8s40sQQQ")  # magic, unit name, generation, data bytes, xxh3-64 checksum
TRAILER_BYTES = _TRAILER.size
_MAGIC = b"WSSLAB02"
_MAGIC_CRC32 = b"WSSLAB01"  # format 1: crc32 checksums (zlib), which summed at about the disk's speed


@dataclass(frozen=True)
class Trailer:
    unit: str
    generation: int
    data_bytes: int
    checksum: int

    def pack(self) -> bytes:
        name = self.unit.encode()
        if len(name) > 40:
            raise ValueError(f"unit name {self.unit!r} is longer than the trailer's 40 bytes")
        return _TRAILER.pack(_MAGIC, name, self.generation, self.data_bytes, self.checksum)

    @classmethod
    def read(cls, path: Path, unit: str) -> "Trailer":
        """The trailer of `path`, or a StoreError naming the unit and the file if there is none."""
        try:
            with open(path, "rb") as f:
                f.seek(-TRAILER_BYTES, os.SEEK_END)
                raw = f.read(TRAILER_BYTES)
        except OSError as exc:  # also a file shorter than the trailer (seek before the start)
            raise StoreError(f"unit {unit}: cannot read {path} ({exc.strerror or exc}); the store is damaged — "
                             "restore the run directory from a backup") from None
        magic, name, generation, data_bytes, checksum = _TRAILER.unpack(raw)
        if magic == _MAGIC_CRC32:
            raise StoreError(f"unit {unit}: {path} was written by an earlier weight-streaming (crc32 checksums); "
                             "export it to a Hugging Face checkpoint with that version and start a new run from it")
        if magic != _MAGIC:
            raise StoreError(f"unit {unit}: {path} has no slab trailer (truncated, or not written by this tool); "
                             "restore the run directory from a backup")
        return cls(name.rstrip(b"\0").decode(errors="replace"), generation, data_bytes, checksum)


@dataclass(frozen=True)
class Checksum:
    """A file whose first `length` bytes must have a checksum in `expected` (two values: its records disagree)."""

    unit: str
    path: Path
    length: int
    expected: frozenset[int]


def check_size(unit: str, path: Path, size: int, what: str) -> None:
    if not path.is_file():
        raise StoreError(f"unit {unit}: {what} {path} is missing; the store is incomplete — "
                         "restore the run directory from a backup")
    if path.stat().st_size != size:
        raise StoreError(f"unit {unit}: {what} {path} has {path.stat().st_size} bytes, expected {size} "
                         "(truncated or from another run)")


def check_state_file(unit: str, path: Path, generation: int, data_bytes: int) -> Trailer:
    """The trailer of a unit's state file, once the file's size and trailer say it is that unit's generation."""
    check_size(unit, path, data_bytes + TRAILER_BYTES, "state file")
    trailer = Trailer.read(path, unit)
    if (trailer.unit, trailer.generation, trailer.data_bytes) != (unit, generation, data_bytes):
        raise StoreError(f"unit {unit}: {path} holds unit {trailer.unit!r} generation {trailer.generation}; "
                         "the file was renamed or copied from another run")
    return trailer


def verify_checksums(checks: list[Checksum]) -> None:
    """Read every file once, two at a time (xxhash releases the GIL, so reading one overlaps summing another)."""
    with ThreadPoolExecutor(2) as pool:
        sums = list(pool.map(lambda c: file_checksum(c.path, c.length), checks))
    for check, checksum in zip(checks, sums, strict=True):
        if len(check.expected) != 1 or checksum not in check.expected:
            raise StoreError(f"unit {check.unit}: checksum mismatch in {check.path}; the file is corrupted — "
                             "restore the run directory from a backup")


class Scratch(threading.local):
    """One byte buffer per thread, reused for a chunk's state in its stored form as it is read or written. A
    fresh buffer per chunk is mapped by glibc (its mmap threshold is fixed, streamer.cli.launch) and faulted in
    by the kernel page by page, in system time the I/O workers take from the compute. It grows to the largest
    piece its thread asks for: one chunk of one kind (memory_model.host prices each thread's)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `numel` elements of `dtype` over the thread's buffer, valid until its next `take`."""
        nbytes = numel * dtype.itemsize
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(0, dtype=torch.uint8)  # the old one goes before the new one is made
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype)


def bytes_view(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("file I/O needs a contiguous CPU tensor")
    return t.view(torch.uint8).numpy().data.cast("B")


def pread_into(fd: int, out: torch.Tensor, offset: int, path: Path) -> None:
    view, done = bytes_view(out), 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror}") from None
        if n == 0:
            raise StoreError(f"{path} is truncated (wanted {len(view)} bytes at offset {offset}); "
                             "the store is damaged: restore it or start a new run")
        done += n


def pwrite_from(fd: int, src: torch.Tensor | bytes, offset: int, path: Path) -> None:
    view, done = (memoryview(src) if isinstance(src, bytes) else bytes_view(src)), 0
    try:
        while done < len(view):
            done += os.pwritev(fd, [view[done:]], offset + done)
    except OSError as exc:
        raise disk_error(exc, path) from None


class DiskFull(StoreError):
    """A write found no space left; what was committed before it is intact."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"disk full while writing {path}; the last committed step is intact: "
                         "free space and continue with --resume")
        self.path = path


def disk_error(exc: OSError, path: Path) -> StoreError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(path)
    return StoreError(f"cannot write {path}: {exc.strerror or exc}")


_CHECKSUM_BLOCKS = Scratch()


def file_checksum(path: Path, length: int, block: int = CHECKSUM_BLOCK_BYTES) -> int:
    """xxh3-64 of the first `length` bytes of `path`: several times faster than zlib's crc32, which kept a core
    busy for as long as a step's writes took to flush. Read in blocks into one reused buffer per thread."""
    digest, left = xxhash.xxh3_64(), length
    view = bytes_view(_CHECKSUM_BLOCKS.take(min(block, length), torch.uint8))
    with open(path, "rb", buffering=0) as f:
        while left and (n := f.readinto(view[:min(len(view), left)])):
            digest.update(view[:n])
            left -= n
    return digest.intdigest()


def checksum_of(*parts: str | bytes | memoryview) -> int:
    """xxh3-64 of a record (a JSON record, config.toml, a LoRA file), given whole or as the `parts` it is the
    concatenation of: the state files' checksum, for the files that say how to read them."""
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
    return digest.intdigest()


def checksum_while_syncing(fd: int, path: Path, length: int, pool: ThreadPoolExecutor) -> int:
    """fdatasync `fd` while `pool` computes the checksum of the first `length` bytes of `path`, which it reads
    back from the page cache. Both release the GIL, so the checksum hides behind the flush instead of adding
    to the write worker's time; and it checks the bytes the file holds, not the buffers they came from."""
    future = pool.submit(file_checksum, path, length)
    try:
        os.fdatasync(fd)
    except OSError as exc:
        raise disk_error(exc, path) from None
    finally:
        checksum = future.result()
    return checksum


class LinkRefused(StoreError):
    """A file the run writes is a symbolic link: writing would land wherever the link points."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} is a symbolic link, and a run writes its files only in its own folder: remove the "
                         "link (nothing it points to was written) and run the command again")


def open_for_writing(path: Path, flags: int, mode: int = 0o644) -> int:
    """`os.open(path, flags)` that never follows a symbolic link at `path`: a link planted in a run folder would
    otherwise make a write replace whatever file it points to, outside the folder. A link is a LinkRefused."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LinkRefused(path) from None
        raise


def refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise LinkRefused(path)


def replace_file(path: Path, write: Callable[[Path], object]) -> None:
    """Write `path` anew through `write(tmp)` (another library's writer: a trace, a plot) and rename it into place,
    so neither a link at `path` (refused) nor one at the tmp (removed first; its target is untouched) is followed."""
    refuse_link(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise disk_error(exc, path) from None
        raise


def fsync_path(path: Path) -> None:
    """Flush a file, or a folder's entries (a rename is durable only once its folder is flushed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, text: str) -> None:
    """Write, fsync, rename, fsync the folder: a reader sees the old file or the new one, never a mix. Neither
    `path` nor its tmp is written through a link (`replace_file`)."""
    def write(tmp: Path) -> None:
        with os.fdopen(open_for_writing(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    replace_file(path, write)
    try:
        fsync_path(path.parent)
    except OSError as exc:
        raise disk_error(exc, path) from None
