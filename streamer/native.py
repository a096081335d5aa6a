"""C++ sources of this package built into shared libraries on first use, with the system's C++ compiler against
torch's headers, and kept in the user's cache folder.

A library's name holds a hash of its source, torch's version and location, and its compiler flags; one built
for this CPU's instructions (`-march=native`) also holds the CPU's feature flags, so a cache folder shared by
machines of different CPUs never loads another's. `Library` loads one with ctypes on its first use; where it
cannot be built (no compiler, say) its caller keeps a torch path, and a warning says so once.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Sequence

COMPILE_TIMEOUT_S = 300
# Elementwise kernels: vectorized for this CPU, their blocks split over OpenMP threads.
KERNEL_FLAGS = ("-O3", "-march=native", "-fopenmp")
# The failures a build or load raises.
BUILD_ERRORS = (OSError, subprocess.SubprocessError)


def built(source: Path, flags: Sequence[str] = ()) -> Path:
    """The shared library of `source` for this torch, compiled with `flags` into the user's cache folder if it is
    not there yet (atomically: processes that start together each compile and the last rename wins)."""
    import torch
    include, lib = Path(torch.__file__).parent / "include", Path(torch.__file__).parent / "lib"
    machine = _cpu_features() if "-march=native" in flags else ""
    key = hashlib.sha256(source.read_bytes() + torch.__version__.encode() + str(lib).encode()
                         + " ".join(flags).encode() + machine.encode()).hexdigest()[:16]
    folder = cache_folder()
    target = folder / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler: install one (g++) or set CXX")
    abi = int(torch.compiled_with_cxx11_abi())
    with tempfile.NamedTemporaryFile(dir=folder, prefix=target.stem, suffix=".so", delete=False) as out:
        partial = Path(out.name)
    try:
        done = subprocess.run([compiler, "-O2", *flags, "-std=c++17", "-shared", "-fPIC",
                               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}", str(source), f"-L{lib}", "-lc10",
                               f"-Wl,-rpath,{lib}", "-o", str(partial)],
                              capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode:
            raise OSError(f"{compiler} failed: {done.stderr.strip() or done.returncode}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def failure(exc: BaseException) -> str:
    """A build or load failure in one line: its last."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def cache_folder() -> Path:
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
    raise OSError("no writable folder for the native libraries (set XDG_CACHE_HOME)")


def _cpu_features() -> str:
    """The CPU's model and feature flags as the kernel lists them (Linux), else the platform's name."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("flags", "model name", "Features"))]
    return "\n".join(dict.fromkeys(lines))


class Library:
    """A C++ source of this package loaded on first use: `get()` gives the library with its functions' argument
    types set, or None where it cannot be built or loaded, which is warned once (`what` names the library,
    `instead` says what runs in its place)."""

    def __init__(self, source: Path, flags: Sequence[str], argtypes: dict[str, list[type]], what: str,
                 instead: str) -> None:
        self.source, self.flags, self.argtypes, self.what, self.instead = source, tuple(flags), argtypes, what, instead
        self._lock = threading.Lock()  # the I/O threads and the compute thread can make the first call together
        self._loaded: list[ctypes.CDLL | None] = []  # the library, or None where it failed, once asked for

    def get(self) -> ctypes.CDLL | None:
        with self._lock:
            if not self._loaded:
                self._loaded.append(self._load())
            return self._loaded[0]

    def _load(self) -> ctypes.CDLL | None:
        try:
            library = ctypes.CDLL(str(built(self.source, self.flags)))
        except BUILD_ERRORS as exc:
            warnings.warn(f"{self.what} could not be built ({failure(exc)}); {self.instead}", RuntimeWarning,
                          stacklevel=4)
            return None
        for name, types in self.argtypes.items():
            getattr(library, name).argtypes = types
        return library
