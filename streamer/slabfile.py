"""Positional reads and writes between files and tensors, without staging copies."""
from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path

import torch

from streamer.errors import StoreError


def _bytes_view(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("file I/O needs a contiguous CPU tensor")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def pread_into(fd: int, out: torch.Tensor, offset: int, path: Path) -> None:
    view, done = _bytes_view(out), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise StoreError(f"{path} is truncated (wanted {len(view)} bytes at offset {offset}); "
                             "the store is damaged: restore it or start a new run")
        done += n


def pwrite_from(fd: int, src: torch.Tensor, offset: int, path: Path) -> None:
    view, done = _bytes_view(src), 0
    try:
        while done < len(view):
            done += os.pwritev(fd, [view[done:]], offset + done)
    except OSError as exc:
        raise disk_error(exc, path) from None


def disk_error(exc: OSError, path: Path) -> StoreError:
    if exc.errno == errno.ENOSPC:
        return StoreError(f"disk full while writing {path}; the last committed step is intact: "
                          "free space and continue with --resume")
    return StoreError(f"cannot write {path}: {exc.strerror}")


def crc32_of(t: torch.Tensor, crc: int = 0) -> int:
    return zlib.crc32(_bytes_view(t), crc)


def file_crc32(path: Path, block: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(block):
            crc = zlib.crc32(chunk, crc)
    return crc


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, text: str) -> None:
    """Write, fsync, rename, fsync the folder: a reader sees the old file or the new one, never a mix."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        raise disk_error(exc, path) from None
