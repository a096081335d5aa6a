"""torch's CPU allocator with the buffers a step frees kept for the next request of their size (`cpu_cache.cpp`).

`streamer` fixes glibc's mmap threshold at 1 MiB, so a freed buffer that large leaves the process, as the planner
prices host memory. On its own that makes every such buffer fresh memory the kernel maps and zeroes, and system
time a large share of a small model's step. This allocator keeps those buffers while the bytes kept and in use stay
within the most that were in use at once, so the resident set peaks where it did and a step asks the kernel for
little. A request that finds no kept buffer of its size, where that peak leaves no room, is made of kept pages:
the head of a larger kept buffer (its tail unmapped, so that the resident set falls with the request), or kept
buffers moved into one range (mremap). The pages it takes stay resident. BENCHMARKS.md's QLoRA section measures
both allocators on the same run.

The library is built on first use with the system's C++ compiler against torch's headers and kept in the user's
cache folder. Where it cannot be built or loaded (no compiler, say), torch's own allocator stays, and a warning
says so once.
"""
from __future__ import annotations

import ctypes
import dataclasses
import threading
import warnings
from pathlib import Path

from streamer import native

SOURCE = Path(__file__).with_name("cpu_cache.cpp")
# Requests below it go to torch's own allocation (glibc's heaps keep them): glibc's mmap threshold as `streamer`
# fixes it.
KEPT_FROM_BYTES = 2**20

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failed = False


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """What the cache holds and has done since the process installed it. Bytes are size classes': a request rounds
    up to a sixteenth of its power of two."""
    in_use_bytes: int  # buffers given out and not yet freed
    kept_bytes: int  # freed buffers kept for the next request of their size, or to make others of
    peak_bytes: int  # the most in use and kept at once, since the last trim: what kept + in use never exceed
    released_bytes: int  # freed buffers unmapped (given back to the kernel), in all
    remapped_bytes: int  # kept bytes a request of another size was made of (a head, or moved by mremap), in all
    hits: int  # requests served by a kept buffer
    misses: int  # requests no kept buffer of their size served: fresh memory, or made of kept pages


def install() -> bool:
    """Make the cache torch's CPU allocator for the rest of the process; False where it could not be built or
    loaded (warned once). Tensors allocated before keep their own allocator. Safe to call more than once."""
    global _library, _failed
    with _lock:
        if _library is None and not _failed:
            try:
                library = ctypes.CDLL(str(native.built(SOURCE)))
                library.ws_install(ctypes.c_size_t(KEPT_FROM_BYTES))
            except native.BUILD_ERRORS as exc:
                _failed = True
                warnings.warn(f"the CPU buffer cache could not be built ({native.failure(exc)}); torch's own "
                              f"allocator stays, and steps fault in their freed buffers afresh (slower)",
                              RuntimeWarning, stacklevel=2)
            else:
                _library = library
    return _library is not None


def trim() -> None:
    """Give back every kept buffer and count the peak from what is in use now: where a run's set-up ends, so its
    steps' resident set is theirs alone. Nothing where the cache is not installed."""
    if _library is not None:
        _library.ws_trim()


def stats() -> CacheStats | None:
    """The cache's counters; None where it is not installed."""
    if _library is None:
        return None
    values = (ctypes.c_size_t * len(dataclasses.fields(CacheStats)))()
    _library.ws_stats(values)
    return CacheStats(*values)
