"""The file back end: each unit's chunk-interleaved state files (one per generation) and its gradient file.

    slabs/<unit>.<generation>.state   master | exp_avg | exp_avg_sq [| compute] per chunk, then a trailer
    slabs/<unit>.grad                 the fp32 gradient of the step in progress

A generation is written once, to a tmp file renamed into place when complete (`GenerationWriter`), and
never rewritten. Which generation is current, and when an old one may go, is the store's business
(streamer.store.host); this module only reads, writes, checks and deletes the files it is told to.
"""
from __future__ import annotations

import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from streamer.errors import StoreError
from streamer.store.commit import grad_name, state_name
from streamer.store.direct import AlignedBuffers, SequentialFile, direct_span, open_for_direct_reads, pread_direct
from streamer.store.slabfile import (
    Checksum, Scratch, Trailer, bytes_view, check_size, check_state_file, checksum_while_syncing, disk_error,
    fsync_path, open_for_writing, pread_into, pwrite_from,
)
from streamer.store.quant import stored
from streamer.store.spec import StoreSpec


class StateFiles:
    """Positional reads and writes of a store's files through cached descriptors (the runtime's main thread and
    its read and write workers share them), and the checksums of what is written."""

    def __init__(self, folder: Path, spec: StoreSpec, numels: dict[str, int], read_only: bool = False) -> None:
        self.folder, self.spec, self.numels = folder, spec, numels
        self._mode = os.O_RDONLY if read_only else os.O_RDWR  # a read-only store opens no file for writing
        self._fds: dict[str, int] = {}
        # A state file's second descriptor, its reads past the page cache (streamer.store.direct); None where
        # the filesystem has no direct reads, or refused one
        self._direct_fds: dict[str, int | None] = {}
        self._refused: list[int] = []
        self._fd_lock = threading.Lock()
        self._checksums: ThreadPoolExecutor | None = None
        self._cleanup: ThreadPoolExecutor | None = None
        self._removing: Future[None] | None = None  # the strays of the last commit, being deleted
        self.bytes_read = self.bytes_written = 0  # data bytes, for the step's I/O report
        self.staging = AlignedBuffers()  # for the state files' writers (one at a time, on the write worker)
        # A chunk's state in its stored form, as it is read and as it is written (the RAM tier's quantized kinds too)
        self.reads, self.writes = Scratch(), Scratch()

    def count_bytes(self, read: int = 0, written: int = 0) -> None:
        with self._fd_lock:  # the main thread and both I/O workers count bytes
            self.bytes_read += read
            self.bytes_written += written

    def state_path(self, unit: str, generation: int) -> Path:
        return self.folder / state_name(unit, generation)

    def grad_path(self, unit: str) -> Path:
        return self.folder / grad_name(unit)

    def state_bytes(self, unit: str) -> int:
        """Data bytes of the unit's state file (the trailer follows them)."""
        return self.spec.state_bytes(self.numels[unit])

    # --- descriptors ------------------------------------------------------------------------
    def descriptor(self, path: Path, create: bool = False) -> int:
        """A cached descriptor; only writers create files, so a missing file read is an error naming it."""
        key = str(path)
        with self._fd_lock:
            if key not in self._fds:
                flags = self._mode | (os.O_CREAT if create else 0)
                try:
                    self._fds[key] = os.open(path, flags) if self._mode == os.O_RDONLY else \
                        open_for_writing(path, flags)
                except FileNotFoundError:
                    raise StoreError(f"{path} is missing; the store is incomplete — restore the run folder") from None
                except OSError as exc:
                    raise disk_error(exc, path) from None
            return self._fds[key]

    def direct_descriptor(self, path: Path) -> int | None:
        """A cached O_DIRECT descriptor to read `path` with, or None where its filesystem reads none direct."""
        key = str(path)
        with self._fd_lock:
            if key not in self._direct_fds:
                self._direct_fds[key] = open_for_direct_reads(path)
            return self._direct_fds[key]

    def _refuse_direct(self, path: Path) -> None:
        """Read `path` through the page cache from now on. Its direct descriptor is closed with the others: another
        thread may be reading through it."""
        with self._fd_lock:
            fd = self._direct_fds.get(str(path))
            self._direct_fds[str(path)] = None
            if fd is not None:
                self._refused.append(fd)

    def release(self, path: Path) -> None:
        """Close the cached descriptors of `path`, if any (before it is renamed or deleted)."""
        with self._fd_lock:
            fds = (self._fds.pop(str(path), None), self._direct_fds.pop(str(path), None))
        for fd in fds:
            if fd is not None:
                os.close(fd)

    def delete(self, path: Path) -> None:
        self.release(path)
        path.unlink(missing_ok=True)

    def close(self) -> None:
        self.staging.close()
        try:
            self.settle()
        finally:  # a failed deletion is raised, with every thread stopped and descriptor closed
            for pool in (self._checksums, self._cleanup):
                if pool is not None:
                    pool.shutdown()
            self._checksums = self._cleanup = None
            with self._fd_lock:
                fds = [*self._fds.values(), *(fd for fd in self._direct_fds.values() if fd is not None),
                       *self._refused]
                self._fds, self._direct_fds, self._refused = {}, {}, []
            for fd in fds:
                os.close(fd)

    # --- state files ------------------------------------------------------------------------
    def chunk_count(self, unit: str, start: int) -> int:
        """Elements of the unit's chunk starting at element `start`: the file's reads and writes are whole chunks."""
        return min(self.spec.chunk, self.numels[unit] - start)

    def read(self, unit: str, generation: int, kind: str, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + out.numel()) of `kind`, as stored (`StoreSpec.kind_dtype`), within one chunk:
        a chunk's piece, or part of it (a group of a block's experts starts anywhere). Its whole blocks are read
        past the page cache where they are aligned and the filesystem allows it (streamer.store.direct)."""
        path, first = self.state_path(unit, generation), start - start % self.spec.chunk
        offset = self.spec.kind_offset(kind, first, self.chunk_count(unit, first)) + \
            self.spec.kind_bytes(kind, start - first)
        fd = self.descriptor(path)
        direct = self.direct_descriptor(path) if direct_span(out, offset) else None
        if direct is None:
            pread_into(fd, out, offset, path)
        elif not pread_direct(direct, fd, out, offset, path):
            self._refuse_direct(path)
        self.count_bytes(read=out.numel() * out.element_size())

    def check(self, unit: str, generation: int) -> Trailer:
        """The trailer of a state file whose size and trailer say it is that unit's generation."""
        return check_state_file(unit, self.state_path(unit, generation), generation, self.state_bytes(unit))

    def new_generation(self, unit: str, generation: int, replaces: int | None) -> "GenerationWriter":
        """A writer of the unit's `generation`, which replaces generation `replaces` (None: the unit has none)."""
        self.settle()  # the disk never holds a third generation, nor a name being deleted
        return GenerationWriter(self, unit, generation, None if replaces is None else self.state_path(unit, replaces))

    def forget(self, path: Path, offset: int, length: int) -> None:
        """Drop `length` bytes of `path` at `offset` from the page cache, where this process reads the file.

        A step reads each unit's state once more than it writes it: a range of the generation being replaced is
        not read again once its new values are written. Left in the cache, a store larger than the free memory
        fills it, and every later read first has the kernel reclaim pages, on the read worker's CPU, which the
        compute shares."""
        with self._fd_lock:
            fd = self._fds.get(str(path))
        if fd is not None and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def remove_strays(self, keep: set[str]) -> None:
        """Delete the store's units' state files not named in `keep` (the current generations and those of kept
        steps), and tmp files: the generation a commit replaced, or what a crash or an unfinished commit left
        behind (files of any other name are not ours, and stay).

        The files are chosen now and deleted on a helper thread: unlinking a large file frees its extents,
        and a commit's deletions on the trainer's thread left a 0.2 s gap between the steps of a 100M model
        (14 files; 1.6 s steps) in its Chrome trace. `settle` waits for them; a crash before they finish leaves
        strays the next open deletes."""
        self.settle()  # the last commit's strays are gone before the folder is listed again
        strays = [path for path, _ in self._state_files() if path.name not in keep]
        for path in strays:
            self.release(path)  # its descriptor now: the process holds none of a replaced generation
        if strays:
            if self._cleanup is None:
                self._cleanup = ThreadPoolExecutor(1, thread_name_prefix="store-cleanup")
            self._removing = self._cleanup.submit(self._delete_all, strays)

    def _state_files(self) -> list[tuple[Path, int]]:
        """The store's units' state files in the folder, tmp files included, with their generations."""
        found = []
        for path in self.folder.iterdir():
            ours = re.fullmatch(r"(.+)\.(\d+)\.state(\.tmp)?", path.name)
            if ours and ours.group(1) in self.numels and path.is_file():
                found.append((path, int(ours.group(2))))
        return found

    def names(self) -> set[str]:
        """The names of the state files in the folder (not tmp files)."""
        return {path.name for path, _ in self._state_files() if path.suffix == ".state"}

    def last_generation(self) -> int:
        """The highest generation of any state file in the folder (0 for none): a new generation goes past it."""
        return max((generation for _, generation in self._state_files()), default=0)

    @staticmethod
    def _delete_all(paths: list[Path]) -> None:
        for path in paths:
            path.unlink(missing_ok=True)

    def settle(self) -> None:
        """Wait until the strays `remove_strays` chose are deleted (raising what deleting them raised)."""
        removing, self._removing = self._removing, None
        if removing is not None:
            removing.result()

    # --- gradient files ---------------------------------------------------------------------
    def read_grad(self, unit: str, start: int, out: torch.Tensor) -> None:
        """fp32 gradient elements [start, start + out.numel())."""
        path = self.grad_path(unit)
        pread_into(self.descriptor(path), out, start * 4, path)
        self.count_bytes(read=out.numel() * 4)

    def write_grad(self, unit: str, values: torch.Tensor, start: int = 0) -> None:
        """fp32 gradient elements [start, start + values.numel()) (the file is created on the first write)."""
        path = self.grad_path(unit)
        pwrite_from(self.descriptor(path, create=True), values, start * 4, path)
        self.count_bytes(written=values.numel() * 4)

    def grad_check(self, unit: str, checksum: int, step: int) -> Checksum:
        """What verifying the gradient a journaled step `step` replays reads: the file must have that checksum."""
        path, length = self.grad_path(unit), self.numels[unit] * 4
        check_size(unit, path, length, f"gradient file (needed to finish step {step})")
        return Checksum(unit, path, length, frozenset({checksum}))

    def sync_grad(self, unit: str) -> int:
        """Make the unit's gradient durable; returns its checksum."""
        path = self.grad_path(unit)
        return self.sync_and_checksum(path, self.numels[unit] * 4)

    def sync_and_checksum(self, path: Path, length: int) -> int:
        """Flush a file written through the page cache; returns the checksum of its first `length` bytes."""
        if self._checksums is None:
            self._checksums = ThreadPoolExecutor(1, thread_name_prefix="store-checksum")
        return checksum_while_syncing(self.descriptor(path), path, length, self._checksums)


class GenerationWriter:
    """Writes one unit's state file of a new generation, front to back, to a tmp file (past the page cache
    where the filesystem allows it, streamer.store.direct); `finish` seals it (flush, trailer, fsync) and
    renames it into place, `discard` deletes it."""

    def __init__(self, files: StateFiles, unit: str, generation: int, replaced: Path | None) -> None:
        self.files, self.unit, self.generation, self.replaced = files, unit, generation, replaced
        self.final = files.state_path(unit, generation)
        self.tmp = self.final.with_suffix(".state.tmp")
        self._next = 0
        self._out: SequentialFile | None = None

    def write(self, kind: str, start: int, values: torch.Tensor) -> None:
        """`kind`'s piece of the chunk starting at element `start`, in its stored form (`quant.stored`)."""
        spec = self.files.spec
        values = stored(spec, kind, values, self.files.writes).contiguous()
        offset = spec.kind_offset(kind, start, self.files.chunk_count(self.unit, start))
        if offset != self._next:
            raise ValueError(f"state file writes must be sequential (got offset {offset}, expected {self._next})")
        if self._out is None:
            self._out = SequentialFile(self.tmp, self.files.staging)
        self._out.write(bytes_view(values))
        length = values.numel() * values.element_size()
        self.files.count_bytes(written=length)
        if self.replaced is not None:  # the same range of the generation this one replaces is read no more
            self.files.forget(self.replaced, offset, length)
        self._next = offset + length

    def finish(self) -> int:
        """Seal and rename the file; returns the checksum of its data."""
        size = self.files.state_bytes(self.unit)
        if self._next != size or self._out is None:
            raise ValueError(f"unit {self.unit}: {self._next} of {size} state bytes were written")
        try:
            checksum = self._out.finish()
            trailer = Trailer(self.unit, self.generation, size, checksum).pack()
            pwrite_from(self._out.fd, trailer, size, self.tmp)
            os.fsync(self._out.fd)
            self._out.close()
            os.replace(self.tmp, self.final)
            fsync_path(self.final.parent)
        except (OSError, StoreError) as exc:
            self.discard()
            raise exc if isinstance(exc, StoreError) else disk_error(exc, self.final) from None
        return checksum

    def discard(self) -> None:
        if self._out is not None:
            self._out.close()
        self.files.delete(self.tmp)
