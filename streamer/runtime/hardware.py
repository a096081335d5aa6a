"""Which compute dtype the hardware runs fast: bf16 where it is native and at least as fast as fp32, else fp32.

A CUDA GPU has native bf16 matmuls from compute capability 8.0 (Ampere) on. A CPU is asked directly: a short
probe times the same small matmul in both dtypes, because an AVX2-only CPU (most laptops, many cloud VMs)
emulates bf16 at a hundredth of its fp32 rate while one with AVX512-BF16 or AMX runs it twice as fast.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from memory_model import COMPUTE_DTYPES, DEVICE_PRESETS
from memory_model.devices import FIGURE_SETS, Budget, DeviceSpec, budget_bytes, with_sets
from memory_model.settings import Choice, SettingError, Text, check_settings, setting, shown
from streamer.errors import StreamerError
from streamer.store.spec import PIN_MODES

BF16_MIN_CAPABILITY = (8, 0)
# 256^3 separates the cases by 2x either way (measured on AVX512-BF16, natively and capped to AVX2: bf16
# 205 vs fp32 103 GFLOP/s, and 3.2 vs 103) and an emulated bf16 matmul of it still takes only ~10 ms.
PROBE_N = 256
PROBE_REPEATS = 5
PROBE_SECONDS = 0.4  # the timed repeats stop here; the first of each dtype always runs


@dataclass(frozen=True)
class MatmulProbe:
    """Best-of-repeats rates of one n x n matmul in each dtype, on one thread."""

    bf16_flops: float
    fp32_flops: float
    n: int

    @property
    def bf16_is_fast(self) -> bool:
        return self.bf16_flops >= self.fp32_flops

    def rates(self) -> str:
        return f"bf16 matmul {self.bf16_flops / 1e9:,.1f} GFLOP/s vs fp32 {self.fp32_flops / 1e9:,.1f}"


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype a run uses and one line saying why."""

    dtype: str
    reason: str
    emulated: bool = False  # bf16 was asked for on hardware that only emulates it: `reason` is a warning

    def __post_init__(self) -> None:
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {self.dtype!r}")


def probe_cpu(n: int = PROBE_N, repeats: int = PROBE_REPEATS, seconds: float = PROBE_SECONDS) -> MatmulProbe:
    """Time an n x n matmul in bf16 and fp32, alternating, on one thread.

    One thread, because on a busy machine a multi-threaded matmul this small mostly measures how long its
    threads wait to be scheduled (~12 ms per call on a loaded 2-core box, whatever the dtype).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        operands = {dtype: [torch.randn(n, n, generator=generator).to(dtype) for _ in range(2)]
                    for dtype in (torch.bfloat16, torch.float32)}
        best = {dtype: float("inf") for dtype in operands}
        for a, b in operands.values():
            torch.mm(a, b)  # warm-up: kernel selection and first-touch page faults
        deadline = time.perf_counter() + seconds
        for i in range(repeats):
            if i and time.perf_counter() > deadline:
                break
            for dtype, (a, b) in operands.items():
                start = time.perf_counter()
                torch.mm(a, b)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    flops = 2 * n**3
    return MatmulProbe(flops / max(best[torch.bfloat16], 1e-9), flops / max(best[torch.float32], 1e-9), n)


@functools.cache
def cpu_probe() -> MatmulProbe:
    """This process's CPU probe, measured once."""
    return probe_cpu()


def choose_for_cpu(probe: MatmulProbe, requested: str) -> DtypeChoice:
    rates = f"{probe.rates()} on this CPU"
    if requested == "auto":
        if probe.bf16_is_fast:
            return DtypeChoice("bf16", f"compute dtype bf16: {rates}")
        return DtypeChoice("fp32", f"compute dtype fp32: {rates} (no native bf16)")
    if requested == "bf16" and not probe.bf16_is_fast:
        return DtypeChoice("bf16", f"warning: --dtype bf16 is emulated on this CPU ({rates}); "
                                   "--dtype auto would use fp32", emulated=True)
    return DtypeChoice(requested, f"compute dtype {requested} (--dtype {requested})")


def choose_for_cuda(name: str, capability: tuple[int, int], requested: str) -> DtypeChoice:
    gpu = f"{name} (compute capability {capability[0]}.{capability[1]})"
    native = tuple(capability) >= BF16_MIN_CAPABILITY
    if requested == "auto":
        if native:
            return DtypeChoice("bf16", f"compute dtype bf16: {gpu} runs bf16 natively")
        return DtypeChoice("fp32", f"compute dtype fp32: {gpu} has no native bf16 (needs 8.0 or newer)")
    if requested == "bf16" and not native:
        return DtypeChoice("bf16", f"warning: --dtype bf16 is emulated on {gpu}; --dtype auto would use fp32",
                           emulated=True)
    return DtypeChoice(requested, f"compute dtype {requested} (--dtype {requested})")


def resolve_compute_dtype(device: str, requested: str = "auto") -> DtypeChoice:
    """`requested` ("auto", "bf16" or "fp32") on torch device `device` ("cpu", "cuda", "cuda:N", "meta").

    Meta tensors have no speed: auto means bf16 there, the dtype the GPUs a dry run stands for train in.
    """
    if requested not in ("auto", *COMPUTE_DTYPES):
        raise StreamerError(f"--dtype must be auto, bf16 or fp32, got {requested!r}")
    kind = device.split(":")[0]
    if kind == "meta":
        dtype = "bf16" if requested == "auto" else requested
        why = "what GPUs run" if requested == "auto" else f"--dtype {requested}"
        return DtypeChoice(dtype, f"compute dtype {dtype} on meta tensors ({why})")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise StreamerError(f"--device {device} but torch sees no CUDA GPU; use --device cpu")
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        return choose_for_cuda(torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index), requested)
    if requested == "fp32":  # nothing to check: every CPU runs fp32 natively
        return DtypeChoice("fp32", "compute dtype fp32 (--dtype fp32)")
    return choose_for_cpu(cpu_probe(), requested)


@dataclass(frozen=True)
class DeviceConfig:
    """Where a run computes: the torch device, its memory budget, the device its choices are priced on and the
    host memory pinned for it (each a `streamer train` flag; its compute dtype is `StepConfig.precision`'s).
    Wrong values raise memory_model's SettingError, which the run reports as its own. The device may be `meta` (a
    dry run); `streamer train` refuses it."""

    device: str = setting("cpu", "torch device: cpu or cuda", Text(), "DEVICE")
    # The Python API also takes bytes or a DeviceSpec.
    budget: str | int | DeviceSpec | None = setting(None, "device memory budget, e.g. 64MiB or 3GB, or a device "
                                                          "preset (%s); default: unlimited" % ", ".join(DEVICE_PRESETS),
                                                    Budget(), "SIZE")
    set: tuple[str, ...] = setting((), "replace one figure of the run's simulated device (repeatable; `streamer "
                                       "devices` lists the fields): the --price-on and --budget presets', and the "
                                       "calibrated local device's that `streamer plan --compare` replays the run on",
                                   FIGURE_SETS, "FIELD=NUMBER")
    price_on: str | None = setting(
        None, "the device preset the run's run-time choices are priced on (--clipped-steps auto) and its MFU is read "
              "against (%s); default: this cpu's calibrated device, never the --budget preset: --budget is a memory "
              "limit only" % ", ".join(DEVICE_PRESETS),
        Choice(tuple(DEVICE_PRESETS)), "DEVICE")
    pin_memory: str = setting("staging", "host memory pinned for a CUDA device: all (the RAM store too), register "
                                         "(the RAM store too, locked where it lies), staging (a bounded pool of "
                                         "staging buffers) or none", Choice(PIN_MODES), "MODE")

    def __post_init__(self) -> None:
        check_settings(self)
        check_device(self.device, self.budget, sets=self.set, meta=True)

    def budget_bytes(self) -> int | None:
        return budget_bytes(self.budget, SettingError, self.set)

    def priced_on(self, error: Callable[[str, str], Exception] = SettingError) -> DeviceSpec | None:
        """The device --price-on names, with the --set figures; None where it names none. The --budget is a
        memory limit only: its preset prices nothing."""
        if self.price_on is None:
            return None
        return with_sets(DEVICE_PRESETS[self.price_on], self.set, error)

    def cuda_arch(self) -> str:
        """The compute capability ("sm90") of the CUDA device the ledger accounts as torch's caching allocator
        would (memory_model.allocator): this run's GPU, or a GPU preset its --budget simulates; "" for none."""
        if self.device.startswith("cuda"):
            major, minor = torch.cuda.get_device_capability(torch.device(self.device))
            return f"sm{major}{minor}"
        budget = DEVICE_PRESETS.get(self.budget, self.budget) if isinstance(self.budget, str) else self.budget
        return budget.cuda_arch if isinstance(budget, DeviceSpec) else ""


def check_device(device: Any, budget: Any, error: Callable[[str, str], Exception] = SettingError,
                 meta: bool = False, sets: Sequence[str] = ()) -> None:
    """The one check of where a run computes, for the run's settings and the trainer API: a torch device
    (`meta` too where a dry run may ask for it, unsaid as users do not) and a budget that `budget_bytes` reads."""
    kinds = ("cpu", "cuda", "meta") if meta else ("cpu", "cuda")
    if not isinstance(device, str) or device.split(":")[0] not in kinds:
        raise error("device", f"must be cpu, cuda or cuda:N, got {shown(device)}")
    budget_bytes(budget, error, sets)
