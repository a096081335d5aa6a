"""The `streamer` command's entry point (and `python -m streamer`'s): a Ctrl-C while the libraries load stops
the command at once, as Ctrl-C should.

Left to Python's own handler, a KeyboardInterrupt raised inside numpy's or torch's import can leave a
half-loaded module that then fails with an unrelated error (an ImportError or a RecursionError, exit status
1). Nothing has been read or written before the libraries have loaded, so there is nothing to finish.

A torchrun process that stops on an error (its one line printed) leaves at once (`leave_after_error`)."""
from __future__ import annotations

import ctypes
import os
import platform
import signal
import sys
from importlib.metadata import version
from types import FrameType

from streamer import cpu_cache


def _pinned_blocks_keep_their_size() -> dict[str, str]:
    """torch's caching host allocator rounds a pinned block up to a power of two: GPT-J-6B's 805 MB fp32 slabs
    would take 1 GiB each, 105 GiB of pinned RAM for a 79 GiB store. Above 64 MiB, blocks keep their size. The
    key exists from torch 2.13; an older torch refuses the whole setting when CUDA starts."""
    if tuple(int(part) for part in version("torch").split(".")[:2]) < (2, 13):
        return {}
    return {"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:64"}


# Set for the command's process before torch loads; a user's own setting wins. PASSIVE: torch's OpenMP threads
# sleep while they wait for each other instead of spinning. Where another process holds a core, a spinning
# thread takes the time of one that is descheduled, and every parallel op waits for it (the step took 1.4x
# that of one thread); sleeping, two threads step as fast as one there and as fast as before on an idle box.
PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE", **_pinned_blocks_keep_their_size()}


# glibc's malloc serves a request above its mmap threshold with a mapping of its own, returned to the kernel when
# freed; below it, from heaps that keep what is freed. The threshold starts at 128 KiB and rises to the size of
# each mapped block freed (up to 32 MiB), so after a step's first frees every buffer of a few MiB (a block's
# activations, an update chunk's temporaries) is served from the heaps, and the next step's differently placed
# ones add to what the heaps keep: a 2-layer mixture's run peaked 12% above its planned host memory, and within
# 1% with the threshold fixed. Fixed at 1 MiB, a freed buffer that size or larger leaves the process, as the
# planner prices it (memory_model.host). A user's MALLOC_MMAP_THRESHOLD_ wins. So that a step's buffers are not
# each fresh memory to fault in, torch's CPU allocator keeps them instead, within the same peak (`cpu_cache`).
MMAP_THRESHOLD = cpu_cache.KEPT_FROM_BYTES
M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
# The same for a process this one starts (glibc reads it as the process starts): `streamer bench`'s workers.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}


def _fix_mmap_threshold() -> None:
    if platform.libc_ver()[0] != "glibc" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):  # no mallopt to call: the allocator's own policy stands
        return


def main() -> int:
    _fix_mmap_threshold()
    for name, value in PROCESS_ENV.items():
        os.environ.setdefault(name, value)
    previous = signal.signal(signal.SIGINT, _interrupted_while_loading)
    from streamer.cli.main import main as run_command
    signal.signal(signal.SIGINT, previous)
    cpu_cache.install()
    status = run_command()
    if status and "torch.distributed" in sys.modules:  # loaded by a command that may have joined a torchrun group
        from streamer.runtime.distributed import leave_after_error
        leave_after_error(status)
    return status


def _interrupted_while_loading(signum: int, frame: FrameType | None) -> None:
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)
