"""Elementwise kernels that torch.compile fuses into one loop, for the opt-in precisions' work off the CPU, and
on it where their C++ (streamer/store/quant.cpp, streamer/runtime/rounding.cpp) cannot be built.

Eager torch runs an int8 moment's quantization as a dozen passes over memory, each with its own temporary; on
this project's 2-core CPU that took 9.5 ns an element against 1.0 compiled (decoding 5.2 against 0.4, the
bf16 master's stochastic rounding 3.1 against 0.3). Compiled and eager kernels run the same function, so they
give the same bits (tests/test_compiled.py holds them equal).

A kernel is compiled on its first call with at least `COMPILE_MIN_NUMEL` elements: compiling takes seconds,
which only a large tensor repays. Smaller calls, and every call once compiling has failed (no C++ compiler,
say), run the function eagerly; the failure is reported once, as a warning.
"""
from __future__ import annotations

import inspect
import os
import threading
import warnings
from typing import Callable, Generic, ParamSpec, TypeVar

import torch

from memory_model.host import COMPILE_MIN_NUMEL

P = ParamSpec("P")
R = TypeVar("R")


class Kernel(Generic[P, R]):
    """`fn`, compiled with dynamic shapes on its first large call; `fn` itself for small calls or where
    compiling fails.

    `static` names the arguments whose sizes never change (look-up tables). They are compiled at their sizes:
    with every size dynamic, a chunk of as many rows as a table has entries was taken for the same size, and the
    next chunk recompiled."""

    def __init__(self, fn: Callable[P, R], static: tuple[str, ...] = ()) -> None:
        self.fn = fn
        self._static = static
        self._signature = inspect.signature(fn)
        self._compiled: Callable[P, R] | None = None
        self._failed = False
        self._lock = threading.Lock()  # the I/O worker and the compute thread can make the first call together

    def compiles(self, numel: int) -> bool:
        """Whether a call that touches `numel` elements runs compiled (until compiling it has failed)."""
        return numel >= COMPILE_MIN_NUMEL and not self._failed

    def __call__(self, numel: int, *args: P.args, **kwargs: P.kwargs) -> R:
        """`fn(*args, **kwargs)`, on a call that touches `numel` elements."""
        if not self.compiles(numel):
            return self.fn(*args, **kwargs)
        if self._compiled is not None:
            self._mark_static(args, kwargs)
            return self._compiled(*args, **kwargs)
        with self._lock:
            if self._compiled is None and not self._failed:
                separate_cache_per_isa()
                compiled = torch.compile(self.fn, dynamic=True)
                self._mark_static(args, kwargs)
                try:
                    result = compiled(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001 (a compiler that fails leaves the same function, eager)
                    self._failed = True
                    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    warnings.warn(f"torch.compile failed for {self.fn.__qualname__} ({reason}); it runs eagerly, "
                                  f"several times slower", RuntimeWarning, stacklevel=2)
                else:
                    self._compiled = compiled
                    return result
        return self(numel, *args, **kwargs)

    def _mark_static(self, args: tuple, kwargs: dict) -> None:
        """Mark the `static` arguments' sizes fixed for the compiler (which only a compiled call imports)."""
        if self._static:
            bound = self._signature.bind(*args, **kwargs)
            for name in self._static:
                torch._dynamo.mark_static(bound.arguments[name])


def separate_cache_per_isa() -> None:
    """Point inductor's cache at a folder of its own for the CPU capability ATen dispatches to.

    Inductor's cache keys leave that capability out: a kernel cached by a process on AVX512 crashed (SIGSEGV)
    when a process capped to AVX2 (`ATEN_CPU_CAPABILITY=avx2`) loaded it. A folder the user names is theirs; one
    inside the default folder was chosen here, by this process or the one that started it, and is chosen again."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given is None or default in (os.path.abspath(given), os.path.dirname(os.path.abspath(given))):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default, torch.backends.cpu.get_cpu_capability())


def kernel(static: tuple[str, ...] = ()) -> Callable[[Callable[P, R]], Kernel[P, R]]:
    """Decorator: the function as a `Kernel` with these `static` arguments; its calls name first the elements
    they touch."""
    return lambda fn: Kernel(fn, static)
