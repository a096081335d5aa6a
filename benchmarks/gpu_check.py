"""`make gpu-check`: GPT-J-6B and Llama-3.1-8B streamed on one CUDA GPU, checked against the targets, then the
CUDA tests; the report is docs/GPU_CHECK.md.

Long because one script must do the whole check on a lent GPU with no network and minutes of time: measure the
machine, run both models, profile a step and break its time down, run the tests, and write the report, each part
within its share of the time.

One script does the whole check within a time budget (--budget-s, 480 s by default: a lent GPU gives 15 minutes,
the machine's start included). Each section has a deadline, a share of the budget (SECTION_ENDS); a part that
would not finish in its section's time is skipped, and the report says what and why.
1. The machine: the bf16 matmul peak, the pinned link each way, the host's copy rate (pageable into pinned, on 1
   thread and on the runtime's staging threads), the host's AdamW, and the intra-op threads an I/O thread gets.
2. Each model (random weights, set up by copying one random block, not by drawing billions of numbers): fp32
   masters, bf16 compute, checkpointed activations, the store in RAM with its slabs registered where they lie
   (--pin-memory register; pinned staging where registering is refused), Adam moments fp32 where the host's RAM
   holds them, else bf16, else int8 (said). At 1 x 2048 the step with the update on the device, against its
   floor (the largest of the link's bytes at the measured rate, the host's update and the compute at the
   measured matmul peak) and the planner's prediction on the measured figures; torch.cuda.max_memory_allocated
   against the planner's peak; the update on the host; the planner's largest batch for model TFLOP/s; for the
   first model, one step under torch.profiler (a Chrome trace) and where its time goes.
3. tests/test_cuda.py, in the time left.
Without CUDA it says so and exits 0. Every part but the CUDA calls runs on a CPU in tests/test_gpu_check.py.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's packages, whatever the venv has installed

from streamer.cli.launch import PROCESS_ENV  # noqa: E402

# `streamer`'s own process settings (OpenMP threads that sleep when idle, pinned blocks kept their size). Set
# before torch loads; the tests' process inherits them.
for _name, _value in PROCESS_ENV.items():
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import xml.etree.ElementTree as ElementTree  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from functools import partial  # noqa: E402
from typing import Callable, Iterable  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402

from layers import PRESETS, ModelConfig  # noqa: E402
from memory_model import DEVICE_PRESETS, DeviceOutOfMemory, DeviceSpec, Link, Plan  # noqa: E402
from memory_model import format_size, plan  # noqa: E402
from memory_model.units import Precision  # noqa: E402
from streamer import StreamingTrainer, TrainerConfig  # noqa: E402
from streamer.errors import StreamerError  # noqa: E402
from streamer.runtime.transport import (  # noqa: E402
    GRADIENT_FOLD, HOST_COPY, HOST_UPDATE, WRITE_BACK, HostCopier, IOQueues, staging_threads,
)
from streamer.store.layout import model_layouts  # noqa: E402
from streamer.store.spec import StoreSpec  # noqa: E402

GiB = 2**30
MODELS = ("gptj-6b", "llama-3.1-8b")
BUDGET_S = 480
# Where each section must end, as a share of the budget from the start: a section that ends early leaves its time
# to the next ones; one that runs late takes it from them.
SECTION_ENDS = {"machine": 0.05, "gptj-6b": 0.50, "llama-3.1-8b": 0.92, "tests": 1.0}
# The targets (docs/GPU_CHECK.md's "Targets").
GOAL_MODEL_FLOPS = 350e12
GOAL_FLOOR_RATIO = 1.25
GOAL_PLAN_ERROR = 0.15
GOAL_PEAK_ERROR = 0.05
RAM_RESERVE = 16 * GiB  # CUDA, Python, the set-up's per-unit tensors, the staging pool
MOMENTS = ("fp32", "bf16", "int8")


# --- the time budget ----------------------------------------------------------------------------------------------
class Budget:
    """The whole check's seconds, each section's deadline within them, and what was skipped for want of time."""

    def __init__(self, total_s: float, ends: dict[str, float], now: Callable[[], float] = time.monotonic) -> None:
        self.total_s, self.ends, self.now = total_s, ends, now
        self.start = now()
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return self.now() - self.start

    def left(self, section: str) -> float:
        """Seconds until `section`'s deadline."""
        return self.total_s * self.ends[section] - self.elapsed()

    def allows(self, section: str, what: str, need_s: float) -> bool:
        """Whether `what`, estimated at `need_s` seconds, ends before `section`'s deadline; if not, it is noted
        as skipped, with why."""
        if need_s <= self.left(section):
            return True
        self.skipped.append(f"{section}: {what}: needs about {need_s:.0f} s, {max(0.0, self.left(section)):.0f} s "
                            f"were left of the section's time")
        return False


# --- the machine --------------------------------------------------------------------------------------------------
@dataclass
class Machine:
    gpu: str = "none"
    memory: int = 0
    cpus: int = 0
    ram: int = 0
    torch_version: str = torch.__version__
    matmul_peak: float = 0.0  # bf16 FLOP/s
    h2d: float = 0.0  # bytes/s, pinned
    d2h: float = 0.0
    host_copy: dict[int, float] = field(default_factory=dict)  # threads -> bytes/s of a pageable -> pinned copy
    host_update: float = 0.0  # bytes of AdamW state touched per second on the host
    io_threads: int = 0  # torch.get_num_threads() on an I/O thread
    preset: str | None = None
    cuda_arch: str | None = None  # "sm90": sizes cuBLAS's workspaces in the plan

    def staging_copy(self) -> float:
        """The host copy rate at the runtime's staging threads."""
        return self.host_copy[max(self.host_copy)]


def _timed(work: Callable[[], object], repeats: int) -> float:
    """Best GPU time (s) of `work` over `repeats` runs after a warm-up, by CUDA events."""
    work()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def best_seconds(work: Callable[[], object], repeats: int) -> float:
    """Best wall time (s) of `work` over `repeats` runs after a warm-up."""
    work()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def host_copy_rates(nbytes: int, threads: Iterable[int], pin: bool) -> dict[int, float]:
    """Bytes/s of a pageable fp32 tensor copied into a (pinned where `pin`) one by HostCopier on each count of
    threads, as a staging copy runs."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty(nbytes // 4, pin_memory=pin)
    rates = {}
    for n in threads:
        copier = HostCopier(n)
        rates[n] = nbytes / best_seconds(partial(copier.copy_, dst, src), 3)
        copier.close()
    return rates


def io_thread_count() -> int:
    """torch.get_num_threads() on an I/O thread, where the gradient fold and the staging copies run."""
    io = IOQueues(threaded=True, inline_fold=False)
    try:
        return io.writes.submit(torch.get_num_threads).result()
    finally:
        io.close()


def measure_machine() -> Machine:
    from streamer.calibration.calibrate import measure_update
    from streamer.calibration.calibrate_device import preset_for
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    peak = 2 * n**3 / _timed(partial(torch.mm, a, b, out=out), 10)
    del a, b, out
    size = 256 * 2**20
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    h2d = size / _timed(partial(device.copy_, host, non_blocking=True), 5)
    d2h = size / _timed(partial(host.copy_, device, non_blocking=True), 5)
    del host, device
    try:
        preset: str | None = preset_for(torch.cuda.get_device_name())
    except StreamerError:
        preset = None
    return Machine(gpu=torch.cuda.get_device_name(), memory=torch.cuda.get_device_properties(0).total_memory,
                   cpus=psutil.cpu_count() or 0, ram=psutil.virtual_memory().total, matmul_peak=peak, h2d=h2d,
                   d2h=d2h, host_copy=host_copy_rates(512 * 2**20, sorted({1, staging_threads()}), pin=True),
                   host_update=measure_update(16 * 2**20, 3), io_threads=io_thread_count(), preset=preset,
                   cuda_arch="sm{}{}".format(*torch.cuda.get_device_capability()))


def gpu_spec(machine: Machine) -> DeviceSpec:
    """The planner's device: the matching preset (else h100-sxm) with this machine's measured link, matmul
    peak, host AdamW and copy rates and GPU memory, already achieved: no catalogue share on top."""
    base = DEVICE_PRESETS[machine.preset or "h100-sxm"]
    return replace(base, name=f"{machine.gpu} (measured)", memory_bytes=machine.memory,
                   h2d=Link(machine.h2d, base.h2d.latency_s), d2h=Link(machine.d2h, base.d2h.latency_s),
                   flops={**base.flops, "bf16": machine.matmul_peak}, host_update_bw=machine.host_update,
                   host_copy_bw=machine.staging_copy(), matmul_efficiency=1.0, bandwidth_efficiency=1.0,
                   cuda_arch=machine.cuda_arch or base.cuda_arch)


# --- a model's runs -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """Timed steps of one batch size and update place (or why there are none)."""

    batch: int
    update_on: str
    step_s: tuple[float, ...] = ()
    ledger_peak: int = 0
    allocator_peak: int = 0
    prediction: Plan | None = None
    error: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def plan(self) -> Plan:
        """The planner's prediction of a run with timed steps (every such run has one)."""
        assert self.prediction is not None, f"the run at batch {self.batch} has no prediction"
        return self.prediction


@dataclass
class ModelResult:
    model: str
    lines: list[str] = field(default_factory=list)  # the store, its set-up, what happened
    runs: list[Run] = field(default_factory=list)
    breakdown: list["Part"] = field(default_factory=list)
    trace_file: str = ""


def store_bytes(cfg: ModelConfig, moments: str) -> int:
    """RAM of a RAM-tier store with bf16 compute weights and `moments` (registered slabs are not rounded up)."""
    return StoreSpec(cfg, Precision("bf16", moments=moments)).host_bytes()[0]


def choose_moments(cfg: ModelConfig, available: int) -> tuple[str | None, str]:
    """(moment dtype, why): the widest of fp32, bf16, int8 whose RAM-tier store fits the available RAM less a
    reserve; None where none does."""
    tried = []
    for moments in MOMENTS:
        need = store_bytes(cfg, moments)
        tried.append(f"{moments} {format_size(need)}")
        if need <= available - RAM_RESERVE:
            return moments, (f"{moments} Adam moments (RAM-tier store with {', '.join(tried)}; "
                             f"{format_size(available)} available, {format_size(RAM_RESERVE)} kept free)")
    return None, (f"no RAM-tier store fits: {', '.join(tried)} against {format_size(available)} available less "
                  f"{format_size(RAM_RESERVE)}")


def random_weights(cfg: ModelConfig, block: int = 2**24) -> dict[str, torch.Tensor]:
    """HF-keyed weights for a timing run, as fast to make as copies: each matrix a view of one block of
    N(0, 0.02) values (repeated where it is larger), each vector (norms, biases) ones or zeros as HF sets them."""
    values = torch.randn(block, generator=torch.Generator().manual_seed(0)) * 0.02
    out = {}
    for lay in model_layouts(cfg):
        for slot in lay.slots:
            n = math.prod(slot.shape)
            if len(slot.shape) == 1:
                out[slot.hf_key] = (torch.zeros if slot.key.endswith("bias") else torch.ones)(slot.shape)
                continue
            flat = values[:n] if n <= block else values.repeat(-(-n // block))[:n]
            out[slot.hf_key] = flat.view(slot.shape)
    return out


def predict(cfg: ModelConfig, spec: DeviceSpec, tc: TrainerConfig, batch: int, seq: int,
            limits: bool = False) -> Plan:
    return plan(cfg, spec, tc.plan_config(batch, seq), limits=limits, pin_memory=tc.device.pin_memory)


def floor_s(p: Plan) -> tuple[float, str]:
    """A step's floor on its device (the plan's, with the measured figures): the largest of the bytes over the
    link (each direction at its rate), the host's update, and the compute (the recompute included) at the matmul
    peak; and which it is."""
    device, cfg = p.device, p.config
    terms = {
        "link": max(p.link_bytes["h2d"] / device.h2d.bandwidth_bytes_per_s,
                    p.link_bytes["d2h"] / device.d2h.bandwidth_bytes_per_s),
        "host update": (cfg.update_touched_bytes(p.params) / device.host_update_bw
                        if cfg.step.update_on == "host" else 0),
        "compute": sum(r.forward_flops + r.backward_flops for r in p.rows) / device.flops_for(cfg.precision.compute),
    }
    name = max(terms, key=terms.__getitem__)
    return terms[name], name


def _on_cuda(trainer: StreamingTrainer) -> bool:
    return trainer.tc.device.device.startswith("cuda")


def measure(trainer: StreamingTrainer, spec: DeviceSpec, batch: int, seq: int, warmup: int, steps: int) -> Run:
    """Timed steps (a CPU trainer too, for the tests: its allocator peak is then 0)."""
    ids = torch.randint(0, trainer.cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(batch))
    prediction = predict(trainer.cfg, spec, trainer.tc, batch, seq)
    cuda = _on_cuda(trainer)
    gc.collect()  # a replaced trainer's device buffers must not count in this one's allocator peak
    if cuda:
        torch.cuda.empty_cache()
    try:
        for _ in range(warmup):
            trainer.step(ids)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        trainer.ledger.reset_peak()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            trainer.step(ids)  # returns the loss as a float: the step's kernels have finished
            times.append(time.perf_counter() - start)
    except (torch.cuda.OutOfMemoryError, DeviceOutOfMemory) as exc:
        if cuda:
            torch.cuda.empty_cache()
        return Run(batch, trainer.tc.step.update_on, prediction=prediction, error=" ".join(str(exc).split())[:200])
    allocator = torch.cuda.max_memory_allocated() if cuda else 0
    return Run(batch, trainer.tc.step.update_on, tuple(times), trainer.ledger.peak, allocator, prediction)


def profile_step(trainer: StreamingTrainer, batch: int, seq: int, path: Path) -> list[dict]:
    """One step under torch.profiler (after the runs before it warmed it up), its Chrome trace written to
    `path`; returns the trace's events."""
    ids = torch.randint(0, trainer.cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(batch))
    cuda = _on_cuda(trainer)
    activities = [torch.profiler.ProfilerActivity.CPU, *([torch.profiler.ProfilerActivity.CUDA] if cuda else [])]
    with torch.profiler.profile(activities=activities) as profile:
        with torch.profiler.record_function(STEP):
            trainer.step(ids)
        if cuda:
            torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.export_chrome_trace(str(path))
    return json.loads(path.read_text())["traceEvents"]


def on_same_store(trainer: StreamingTrainer, **changes: object) -> StreamingTrainer:
    """A trainer with some settings changed (the update's place) on `trainer`'s store, which none of them
    shapes: building a store again would take minutes. `trainer` must not be used after this."""
    trainer.executor.close()
    return StreamingTrainer(trainer.cfg, trainer.tc.replace(**changes), _store=trainer.store)


def open_trainer(cfg: ModelConfig, moments: str, memory: int, root: Path, result: ModelResult,
                 device: str = "cuda") -> StreamingTrainer:
    """The model's trainer on a fresh RAM-tier store, its slabs registered where they lie, else (refused) pinned
    staging; weights from `random_weights`. `device` cpu: the tests' (nothing is pinned)."""
    for pin in ("register", "staging"):
        tc = TrainerConfig.of(dtype="bf16", moment_dtype=moments, store="ram", activations="checkpoint",
                              device=device, budget=memory, seed=0, pin_memory=pin)
        try:
            trainer = StreamingTrainer(cfg, tc, store_dir=root / pin, _initialize=False)
        except StreamerError as exc:
            result.lines.append(f"- --pin-memory {pin} refused: {exc}")
            continue
        trainer.load_state_dict(random_weights(cfg))
        return trainer
    raise StreamerError("no store could be set up")


def check_model(model: str, machine: Machine, spec: DeviceSpec, budget: Budget, trace_dir: Path, seq: int,
                profile: bool, device: str = "cuda", result: ModelResult | None = None) -> ModelResult:
    """Fills `result` as it goes, so that a failure part-way still leaves what was measured. `device` cpu: the
    tests' tiny run of the same path."""
    result, cfg = result or ModelResult(model), PRESETS[model]
    moments, why = choose_moments(cfg, psutil.virtual_memory().available)
    result.lines.append(f"- store: {why}")
    if moments is None:
        return result
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        trainer = open_trainer(cfg, moments, machine.memory, Path(tmp), result, device)
        try:
            result.lines.append(f"- store set up in {time.monotonic() - started:.0f} s, --pin-memory "
                                f"{trainer.tc.device.pin_memory} (random weights)")
            first = measure(trainer, spec, 1, seq, warmup=1, steps=2)
            result.runs.append(first)
            step = first.median_s if first.step_s else 60.0
            if profile and budget.allows(model, "one step under torch.profiler", 2 * step + 20):
                path = trace_dir / f"{model}-step.trace.json"
                result.breakdown = time_breakdown(profile_step(trainer, 1, seq, path))
                result.trace_file = path.name
            if budget.allows(model, f"the update on the host at 1 x {seq}", 3 * step + 10):
                trainer = on_same_store(trainer, update_on="host")
                result.runs.append(measure(trainer, spec, 1, seq, warmup=1, steps=1))
                trainer = on_same_store(trainer, update_on="device")
            largest = predict(cfg, replace(spec, memory_bytes=int(0.9 * machine.memory)), trainer.tc, 1, seq,
                              limits=True).max_batch_seq
            # The planner's largest batch, or the largest half of it whose steps (as much slower than planned as
            # the first) end in the section's time.
            slower = step / first.prediction.step_time_s if first.step_s and first.prediction else 2.0
            batch = largest[0] if largest else 0
            while batch > 1:
                need = 2 * predict(cfg, spec, trainer.tc, batch, seq).step_time_s * max(1.0, slower) + 15
                if need > budget.left(model):
                    batch //= 2
                    continue
                run = measure(trainer, spec, batch, seq, warmup=1, steps=1)
                result.runs.append(run)
                if run.step_s:
                    break
                batch //= 2  # out of memory: half as many
            if largest and not any(r.batch > 1 and r.step_s for r in result.runs):
                budget.skipped.append(f"{model}: no batch above 1 was timed (the planner's largest: {largest[0]}): "
                                      f"{max(0.0, budget.left(model)):.0f} s were left of the section's time")
        finally:
            trainer.close()
            del trainer
            gc.collect()
            if device != "cpu":
                torch.cuda.empty_cache()
    return result


# --- where a step's time goes -------------------------------------------------------------------------------------
STEP = "ws: gpu-check step"
# The host's parts, by the record_function names the runtime gives them (streamer/runtime/transport.py).
HOST_PARTS = (("host copies (staging)", HOST_COPY), ("gradient fold", GRADIENT_FOLD), ("host update", HOST_UPDATE),
              ("write-backs", WRITE_BACK))


@dataclass(frozen=True)
class Part:
    """One part of a step: its seconds (the union of its intervals), and how many of them compute overlapped."""

    name: str
    seconds: float
    overlapped_s: float
    step_s: float


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length where an interval of `a` and one of `b` (each a disjoint sorted union) both run."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def _clip(intervals: list[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    return [(max(s, window[0]), min(e, window[1])) for s, e in intervals if e > window[0] and s < window[1]]


def time_breakdown(events: list[dict]) -> list[Part]:
    """Where a profiled step's time goes, from its Chrome trace events (µs): compute (kernels on the stream
    busiest with them), the H2D and D2H copies, the host's copies, fold, update and write-backs (the runtime's
    record_function ranges on the host), and waits: the step's time the compute stream had no kernel. Each
    part's seconds are the union of its intervals within the step (the STEP range, else the events' extent)."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    step = [(e["ts"], e["ts"] + e["dur"]) for e in spans
            if e.get("name") == STEP and e.get("cat") != "gpu_user_annotation"]
    window = step[0] if step else (min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans))
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    busy: dict[object, float] = {}
    for e in kernels:
        busy[e.get("args", {}).get("stream")] = busy.get(e.get("args", {}).get("stream"), 0.0) + e["dur"]
    stream = max(busy, key=busy.__getitem__) if busy else None

    def within(keep: Callable[[dict], bool]) -> list[tuple[float, float]]:
        return _clip(union((e["ts"], e["ts"] + e["dur"]) for e in spans if keep(e)), window)

    compute = within(lambda e: e.get("cat") == "kernel" and e.get("args", {}).get("stream") == stream)
    parts = [("compute", compute),
             ("H2D", within(lambda e: e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""))),
             ("D2H", within(lambda e: e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")))]

    def named(name: str) -> Callable[[dict], bool]:
        return lambda e: e.get("name") == name and e.get("cat") != "gpu_user_annotation"

    parts += [(label, within(named(name))) for label, name in HOST_PARTS]
    step_s = (window[1] - window[0]) / 1e6
    out = [Part(name, _length(iv) / 1e6, 0.0 if name == "compute" else overlap(iv, compute) / 1e6, step_s)
           for name, iv in parts]
    return out + [Part("waits (no compute kernel)", step_s - _length(compute) / 1e6, 0.0, step_s)]


# --- the CUDA tests -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TestRow:
    name: str
    outcome: str  # passed, failed, error, skipped
    measured: str
    message: str


def run_tests(out_dir: Path, timeout_s: float) -> list[TestRow]:
    report = out_dir / "gpu-check-tests.xml"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_cuda.py"), "-p", "no:cacheprovider",
               f"--junitxml={report}", "-o", "junit_family=xunit1"]
    try:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        subprocess.run(command, cwd=ROOT, env={**os.environ, "GPU_CHECK_DIR": str(out_dir), "PYTHONPATH": path},
                       timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return [TestRow("tests/test_cuda.py", "error", "", f"still running after {timeout_s:.0f} s: stopped")]
    return read_junit(report)


def read_junit(report: Path) -> list[TestRow]:
    if not report.is_file():
        return [TestRow("tests/test_cuda.py", "error", "", "pytest wrote no report")]
    rows = []
    for case in ElementTree.parse(report).iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = name, " ".join((node.get("message") or "").split())[:300]
        measured = "; ".join(f"{p.get('name')}: {p.get('value')}" for p in case.iter("property"))
        rows.append(TestRow(case.get("name", "?"), outcome, measured, message))
    return rows


# --- the report ---------------------------------------------------------------------------------------------------
def _machine_lines(m: Machine, spec: DeviceSpec | None) -> list[str]:
    if not m.matmul_peak:
        return ["- not measured"]
    copies = ", ".join(f"{rate / 1e9:.1f} GB/s on {n} thread{'s' if n > 1 else ''}" for n, rate in m.host_copy.items())
    return [f"- GPU: {m.gpu}, {format_size(m.memory)}; host: {m.cpus} CPUs, {format_size(m.ram)} RAM; torch "
            f"{m.torch_version}",
            f"- measured: bf16 matmul peak {m.matmul_peak / 1e12:,.0f} TFLOP/s (8192^3, best of 10); pinned copies "
            f"{m.h2d / 1e9:.1f} GB/s to the GPU, {m.d2h / 1e9:.1f} GB/s back (256 MiB); host copies pageable -> "
            f"pinned (512 MiB): {copies}; host AdamW {m.host_update / 1e9:.1f} GB/s touched; an I/O thread's "
            f"torch.get_num_threads(): {m.io_threads}",
            f"- planner device: {spec.name if spec else '-'}: preset {m.preset or 'h100-sxm (no match)'}'s figures "
            "with the measured link, matmul peak, host AdamW and host copy rates and GPU memory"]


def _run_row(run: Run, m: Machine, seq: int) -> str:
    if not run.step_s:
        return f"| {run.batch} x {seq} | {run.update_on} | failed: {run.error} |" + " |" * 8
    p = run.plan
    flops = p.model_flops / run.median_s
    floor, binding = floor_s(p)
    return (f"| {run.batch} x {seq} | {run.update_on} | {run.median_s:.2f} s ({len(run.step_s)}) | {floor:.2f} s "
            f"{binding} ({run.median_s / floor:.2f}x) | {flops / 1e12:,.0f} | {flops / m.matmul_peak:.0%} | "
            f"{p.step_time_s:.2f} s ({p.step_time_s / run.median_s - 1:+.0%}) | {format_size(run.ledger_peak)} | "
            f"{format_size(run.allocator_peak)} | {format_size(p.allocated_peak_bytes)} "
            f"({run.allocator_peak / p.allocated_peak_bytes - 1:+.0%}) |")


def breakdown_table(parts: list[Part]) -> list[str]:
    lines = ["| part | seconds | share of the step | overlapped by compute |", "|---|---|---|---|"]
    for part in parts:
        overlapped = "" if part.name.startswith(("compute", "waits")) or not part.seconds else \
            f"{part.overlapped_s / part.seconds:.0%}"
        lines.append(f"| {part.name} | {part.seconds:.3f} | {part.seconds / part.step_s:.0%} | {overlapped} |")
    return lines


def target_rows(results: list[ModelResult], seq: int) -> list[str]:
    """One row per target, one column per model: met, NOT met, or unmeasured (and why)."""
    def first(r: ModelResult, update_on: str, batch: int = 1) -> Run | None:
        return next((x for x in r.runs if x.step_s and x.update_on == update_on and x.batch == batch), None)

    def floor_cell(r: ModelResult) -> str:
        run = first(r, "device")
        if run is None:
            return "unmeasured"
        floor, binding = floor_s(run.plan)
        ratio = run.median_s / floor
        return f"{_verdict(ratio <= GOAL_FLOOR_RATIO)}: {run.median_s:.2f} s, {ratio:.2f}x the floor ({binding})"

    def flops_cell(r: ModelResult) -> str:
        timed = [x for x in r.runs if x.step_s and x.update_on == "device"]
        if not timed:
            return "unmeasured"
        best = max(timed, key=lambda x: x.plan.model_flops / x.median_s)
        flops = best.plan.model_flops / best.median_s
        return f"{_verdict(flops >= GOAL_MODEL_FLOPS)}: {flops / 1e12:,.0f} at {best.batch} x {seq}"

    def plan_cell(r: ModelResult) -> str:
        timed = [x for x in r.runs if x.step_s]
        if not timed:
            return "unmeasured"
        worst = max(timed, key=lambda x: abs(x.plan.step_time_s / x.median_s - 1))
        error = worst.plan.step_time_s / worst.median_s - 1
        return (f"{_verdict(abs(error) <= GOAL_PLAN_ERROR)}: worst {error:+.0%} ({worst.batch} x {seq}, "
                f"{worst.update_on})")

    def peak_cell(r: ModelResult) -> str:
        timed = [x for x in r.runs if x.step_s]
        if not timed:
            return "unmeasured"
        worst = max(timed, key=lambda x: abs(x.allocator_peak / x.plan.allocated_peak_bytes - 1))
        error = worst.allocator_peak / worst.plan.allocated_peak_bytes - 1
        return (f"{_verdict(abs(error) <= GOAL_PEAK_ERROR)}: worst {error:+.0%} ({worst.batch} x {seq}, "
                f"{worst.update_on})")

    def host_cell(r: ModelResult) -> str:
        device, host = first(r, "device"), first(r, "host")
        if device is None or host is None:
            return "unmeasured"
        return f"{_verdict(host.median_s <= device.median_s)}: {host.median_s:.2f} s vs {device.median_s:.2f} s"

    rows = [(f"step at 1 x {seq} <= {GOAL_FLOOR_RATIO} x its floor", floor_cell),
            (f">= {GOAL_MODEL_FLOPS / 1e12:.0f} model TFLOP/s at the best batch", flops_cell),
            (f"planner within {GOAL_PLAN_ERROR:.0%} of every measured step", plan_cell),
            (f"max_memory_allocated within {GOAL_PEAK_ERROR:.0%} of the planner's peak", peak_cell),
            ("update on the host no slower than on the device", host_cell)]
    out = ["| target | " + " | ".join(r.model for r in results) + " |", "|---|" + "---|" * len(results)]
    return out + [f"| {name} | " + " | ".join(cell(r) for r in results) + " |" for name, cell in rows]


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def report(machine: Machine, spec: DeviceSpec | None, results: list[ModelResult], tests: list[TestRow],
           budget: Budget, seq: int, notes: list[str]) -> str:
    out = ["# gpu-check", "", f"`make gpu-check` (benchmarks/gpu_check.py), {time.strftime('%Y-%m-%d %H:%M')}: "
           f"{budget.elapsed():.0f} s of a {budget.total_s:.0f} s budget.", "", "## The machine", "",
           *_machine_lines(machine, spec), ""]
    if results:
        out += ["## Targets", "", "fp32 masters, bf16 compute, checkpointed activations, the store in RAM. The "
                "floor: the largest of the bytes over the link at the measured rates, the host's update at the "
                "measured AdamW rate, and the step's FLOPs (recompute included) at the measured matmul peak.", "",
                *target_rows(results, seq), ""]
    for r in results:
        out += [f"## {r.model}", "", *r.lines, ""]
        if r.runs:
            out += ["Model FLOP/s: 3 x the forward's matmul FLOPs (the planner's count; the recompute not counted); "
                    "MFU over the measured matmul peak. Step: median of the timed steps, after one warm-up step.", "",
                    "| batch | update | step | floor (binding) | model TFLOP/s | MFU | planner step (error) | "
                    "ledger peak | max_memory_allocated | planner peak (allocator's error) |",
                    "|---|---|---|---|---|---|---|---|---|---|", *[_run_row(x, machine, seq) for x in r.runs], ""]
        if r.breakdown:
            out += [f"### Where one step's time goes (1 x {seq}, update on the device; torch.profiler trace "
                    f"`{r.trace_file}`)", "", *breakdown_table(r.breakdown), ""]
    skipped = budget.skipped + notes
    out += ["## Skipped", "", *([f"- {s}" for s in skipped] or ["- nothing"]), ""]
    out += ["## CUDA tests (tests/test_cuda.py)", ""]
    if tests:
        out += ["| test | result | measured |", "|---|---|---|"]
        out += [f"| {t.name} | {t.outcome}{': ' + t.message if t.message else ''} | {t.measured} |" for t in tests]
    else:
        out += ["- not run (see Skipped)"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "GPU_CHECK.md", help="the report (markdown)")
    parser.add_argument("--trace-dir", type=Path, default=ROOT / "runs" / "gpu-check",
                        help="where the profiler trace and the tests' files go")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="wall-clock budget of the whole check")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False): "
              "nothing to check on this machine; run `make gpu-check` where there is an NVIDIA GPU")
        return 0
    budget = Budget(args.budget_s, SECTION_ENDS)
    machine, spec, failed = Machine(), None, False
    results: list[ModelResult] = []
    tests: list[TestRow] = []
    notes: list[str] = []
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def write() -> str:
        """The report so far: written after every section, so that a check stopped from outside leaves one."""
        text = report(machine, spec, results, tests, budget, args.seq, notes)
        args.output.write_text(text)
        return text

    try:
        machine = measure_machine()
        spec = gpu_spec(machine)
    except Exception as exc:
        traceback.print_exc()
        notes.append(f"the machine's measurements failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        failed = True
    write()
    for i, model in enumerate(args.models if spec is not None else ()):
        assert spec is not None  # the models run only where the machine was measured
        if not budget.allows(model, "its store's set-up and one step", 150):
            continue
        results.append(ModelResult(model))
        try:
            check_model(model, machine, spec, budget, args.trace_dir, args.seq, profile=i == 0, result=results[-1])
        except Exception as exc:  # the report still says what the runs so far found
            traceback.print_exc()
            notes.append(f"{model} failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            failed = True
        write()
    if budget.allows("tests", "tests/test_cuda.py", 60):
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        tests = run_tests(args.trace_dir, timeout_s=budget.left("tests") - 5)
    print(write() + f"\nwrote {args.output}")
    return 0 if not failed and all(t.outcome in ("passed", "skipped") for t in tests) else 1


if __name__ == "__main__":
    sys.exit(main())
