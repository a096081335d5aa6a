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
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_cache.cpp")
# Requests below it go to torch's own allocation (glibc's heaps keep them): glibc's mmap threshold as `streamer`
# fixes it.
KEPT_FROM_BYTES = 2**20
COMPILE_TIMEOUT_S = 300

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
                library = ctypes.CDLL(str(_built()))
                library.ws_install(ctypes.c_size_t(KEPT_FROM_BYTES))
            except (OSError, subprocess.SubprocessError) as exc:
                _failed = True
                reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                warnings.warn(f"the CPU buffer cache could not be built ({reason}); torch's own allocator stays, "
                              f"and steps fault in their freed buffers afresh (slower)", RuntimeWarning, stacklevel=2)
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


def _built() -> Path:
    """The cache's shared library for this torch and source, compiled into the user's cache folder if it is not
    there yet (atomically: processes that start together each compile and the last rename wins)."""
    import torch
    include, lib = Path(torch.__file__).parent / "include", Path(torch.__file__).parent / "lib"
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + torch.__version__.encode() + str(lib).encode()).hexdigest()[:16]
    folder = _cache_folder()
    target = folder / f"cpu_cache-{key}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler: install one (g++) or set CXX")
    abi = int(torch.compiled_with_cxx11_abi())
    with tempfile.NamedTemporaryFile(dir=folder, prefix=target.stem, suffix=".so", delete=False) as out:
        partial = Path(out.name)
    try:
        done = subprocess.run([compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                               f"-I{include}", str(SOURCE), f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}", "-o",
                               str(partial)], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode:
            raise OSError(f"{compiler} failed: {done.stderr.strip() or done.returncode}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _cache_folder() -> Path:
    """$XDG_CACHE_HOME/weight-streaming (~/.cache by default), or the temporary folder where that is not
    writable."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    for folder in (base / "weight-streaming", Path(tempfile.gettempdir()) / f"weight-streaming-{os.getuid()}"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise OSError("no writable folder for the CPU buffer cache's library (set XDG_CACHE_HOME)")
