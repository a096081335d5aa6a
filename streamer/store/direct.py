"""A file written once, front to back, past the page cache (O_DIRECT) where the filesystem allows it, and
reads of its aligned ranges past the page cache too.

A state file is written once and not read again by the process that writes it. Through the page cache every
byte is first copied into the cache, written back by the kernel at its own pace, flushed at the commit and
then read back from the cache for its checksum, while the cache holds a second copy of what the store
streams. With O_DIRECT the bytes go from a page-aligned staging buffer to the disk in large sequential
writes, and the checksum (xxh3-64) is summed from that buffer as it goes: the bytes the disk receives.

O_DIRECT needs buffer, file offset and length aligned to the device's block. The staging buffer is page
aligned and written whole; a file's unaligned tail goes through an ordinary descriptor, as does everything
where the filesystem refuses O_DIRECT (tmpfs: EINVAL at open) or a direct write fails alignment (EINVAL).
`finish` flushes the file (fdatasync): a commit's only flush of its data.

A read through the page cache costs the reading core a copy out of the cache, plus the cache's own upkeep:
pages allocated, read ahead, then reclaimed. A read past it lands in the destination from the disk with
neither (nor read-ahead), and the compute that shares the cores keeps its caches. A read's whole
blocks go direct where its buffer and file offset are block aligned (large buffers from the buffer cache,
streamer.cpu_cache, and pinned ones are page aligned, and most pieces of a state file start on a block); the
rest, and every read the filesystem refuses direct, goes through the page cache. The kernel writes back a
range's dirty pages before a direct read of it, so what was written through the page cache is read as written.
"""
from __future__ import annotations

import errno
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash

from memory_model.host import STAGE_BYTES, STAGES_IN_FLIGHT
from streamer.errors import StoreError
from streamer.store.slabfile import bytes_view, disk_error, open_for_writing, pread_into

ALIGN = 4096  # the largest logical block size in use; any smaller one divides it
# A direct write is synchronous. Filling one stage while the previous one is written hides the copy into the
# stage (a third of a 64 MiB file's write time on this project's box) behind the disk's; 8 MiB writes stream
# at the disk's sequential speed there, as 32 MiB ones do. Their size and count (STAGE_BYTES, STAGES_IN_FLIGHT)
# live in memory_model.host, which prices them in host memory.


class AlignedBuffers:
    """Page-aligned staging buffers, reused: a fresh mapping is page-faulted in at every first touch."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []

    def take(self) -> mmap.mmap:
        return self._free.pop() if self._free else mmap.mmap(-1, STAGE_BYTES)

    def give_back(self, stage: mmap.mmap) -> None:
        self._free.append(stage)

    def close(self) -> None:
        # Dropped, not closed: a failed write's traceback may still hold a view of one, and a mapping is
        # unmapped when its last reference goes.
        self._free.clear()


class SequentialFile:
    """One file written front to back from offset 0; `finish` returns the checksum of everything written.

    Full stages are written by a helper thread, at most STAGES_IN_FLIGHT at once, while the caller fills the
    next one; a write's failure is raised by the `write` or `finish` that waits for it."""

    def __init__(self, path: Path, pool: AlignedBuffers) -> None:
        self.path, self._pool = path, pool
        try:
            self.fd = open_for_writing(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except OSError as exc:
            raise disk_error(exc, path) from None
        self._direct = _open_direct(path)
        self._stage = pool.take() if self._direct is not None else None
        self._fill = 0  # bytes staged
        self._offset = 0  # file offset of the staging buffer's first byte
        self._digest = xxhash.xxh3_64()
        self._writer: ThreadPoolExecutor | None = None
        self._in_flight: deque[tuple[Future[None], mmap.mmap, int]] = deque()  # (write, its stage, its offset)

    @property
    def direct(self) -> bool:
        return self._direct is not None

    def write(self, data: memoryview) -> None:
        self._digest.update(data)
        done = 0
        while done < len(data) and self._stage is not None:
            n = min(len(data) - done, STAGE_BYTES - self._fill)
            self._stage[self._fill:self._fill + n] = data[done:done + n]
            self._fill, done = self._fill + n, done + n
            if self._fill == STAGE_BYTES:
                self._submit_stage()
        if done < len(data):  # through the page cache
            self._pwritev(self.fd, data[done:], self._offset)
            self._offset += len(data) - done

    def finish(self) -> int:
        """Write what is staged (its aligned part directly, the tail through the page cache), flush the file's
        data to the disk, and return the checksum of its bytes."""
        self._wait(0)
        if self._stage is not None and self._fill:
            aligned = self._fill - self._fill % ALIGN
            if aligned:
                self._flush_stage(aligned)  # the tail moves to the front of the stage
            if self._stage is not None and self._fill:
                with memoryview(self._stage) as stage:
                    self._pwritev(self.fd, stage[:self._fill], self._offset)
                self._offset += self._fill
                self._fill = 0
        try:
            os.fdatasync(self.fd)  # the file's data, whichever descriptor wrote it
        except OSError as exc:
            raise disk_error(exc, self.path) from None
        return self._digest.intdigest()

    def close(self) -> None:
        for future, stage, _ in self._in_flight:
            future.exception()  # the file is being abandoned: its writes' failures no longer matter
            self._pool.give_back(stage)
        self._in_flight.clear()
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None
        if self._stage is not None:
            self._pool.give_back(self._stage)
            self._stage = None
        for fd in (self._direct, self.fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._direct, self.fd = None, -1

    def _submit_stage(self) -> None:
        """Hand the full stage to the helper thread and take another to fill, once fewer are in flight."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="store-direct-write")
        stage, direct = self._stage, self._direct
        assert stage is not None and direct is not None  # a full stage of a file written direct
        future = self._writer.submit(self._write_stage, stage, direct, self._offset)
        self._in_flight.append((future, stage, self._offset))
        self._offset += STAGE_BYTES
        self._fill = 0
        self._stage = None
        self._wait(STAGES_IN_FLIGHT - 1)
        if self._direct is not None:  # the waits found no refused write
            self._stage = self._pool.take()

    def _write_stage(self, stage: mmap.mmap, fd: int, offset: int) -> None:
        with memoryview(stage) as view:
            self._pwritev(fd, view[:STAGE_BYTES], offset)

    def _wait(self, most: int) -> None:
        """Wait until at most `most` stage writes are in flight, oldest first. A direct write the filesystem
        refused for its alignment is made through the page cache, as is everything after it."""
        while len(self._in_flight) > most:
            future, stage, offset = self._in_flight.popleft()
            try:
                future.result()
            except _Unaligned:
                self._fall_back_to_cache()
                with memoryview(stage) as view:
                    self._pwritev(self.fd, view[:STAGE_BYTES], offset)
            except BaseException:
                self._pool.give_back(stage)
                raise
            self._pool.give_back(stage)

    def _fall_back_to_cache(self) -> None:
        """This file's block is larger than ALIGN: the page cache from here on, for what is staged now and (as
        they are waited for) the stages in flight."""
        if self._direct is not None:
            for future, _, _ in self._in_flight:
                future.exception()  # none may still use the descriptor when it is closed
            os.close(self._direct)
            self._direct = None
        if self._stage is not None:
            self._drain_stage_to_cache()

    def _flush_stage(self, length: int) -> None:
        """Write the first `length` (aligned) staged bytes at the buffer's offset; keep the rest staged. Where the
        direct write is refused, everything staged goes through the page cache."""
        staged, direct = self._stage, self._direct
        assert staged is not None and direct is not None  # flushed only while writing direct
        try:
            with memoryview(staged) as stage:
                self._pwritev(direct, stage[:length], self._offset)
        except _Unaligned:
            self._fall_back_to_cache()  # everything staged, through the page cache
            return
        self._offset += length
        rest = self._fill - length
        if rest:
            staged[:rest] = staged[length:self._fill]
        self._fill = rest

    def _drain_stage_to_cache(self) -> None:
        stage, self._stage = self._stage, None
        assert stage is not None  # drained only while one is staged
        if self._fill:
            with memoryview(stage) as view:
                self._pwritev(self.fd, view[:self._fill], self._offset)
            self._offset += self._fill
            self._fill = 0
        self._pool.give_back(stage)

    def _pwritev(self, fd: int, view: memoryview, offset: int) -> None:
        done = 0
        try:
            while done < len(view):
                done += os.pwritev(fd, [view[done:]], offset + done)
        except OSError as exc:
            if exc.errno == errno.EINVAL and fd == self._direct:
                raise _Unaligned() from None
            raise disk_error(exc, self.path) from None


class _Unaligned(Exception):
    """A direct write the filesystem refused for its alignment."""


def _open_direct(path: Path, flags: int = os.O_WRONLY) -> int | None:
    """A second, O_DIRECT descriptor of `path`, or None where the platform or filesystem has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return open_for_writing(path, flags | flag)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # tmpfs and others: no direct I/O
            return None
        raise disk_error(exc, path) from None


def open_for_direct_reads(path: Path) -> int | None:
    """An O_DIRECT descriptor to read `path` with, or None where the platform or filesystem has none."""
    return _open_direct(path, os.O_RDONLY)


def direct_span(out: torch.Tensor, offset: int) -> int:
    """The bytes at the front of `out`, read from file offset `offset`, that a direct read may fill: its whole
    blocks, where both the buffer and the offset are block aligned (0: none)."""
    if offset % ALIGN or out.data_ptr() % ALIGN:
        return 0
    nbytes = out.numel() * out.element_size()
    return nbytes - nbytes % ALIGN


def pread_direct(direct: int, buffered: int, out: torch.Tensor, offset: int, path: Path) -> bool:
    """Fill `out` from file offset `offset`: its first `direct_span` bytes past the page cache through `direct`,
    the rest through `buffered`. False where the filesystem refused the direct read (EINVAL: a block larger than
    ALIGN), after reading all of `out` through `buffered`."""
    view, span = bytes_view(out), direct_span(out, offset)
    done = 0
    try:
        while done < span:
            n = os.preadv(direct, [view[done:span]], offset + done)
            done += n
            if n == 0 or done % ALIGN:
                break  # the file ends: the buffered read below reads what is left, or says it is truncated
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise StoreError(f"cannot read {path}: {exc.strerror}") from None
        pread_into(buffered, out, offset, path)
        return False
    if done < len(view):
        pread_into(buffered, out.view(torch.uint8).view(-1)[done:], offset + done, path)
    return True
