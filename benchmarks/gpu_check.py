"""`make gpu-check`: on a machine with a CUDA GPU, the CUDA tests, then GPT-J-6B streamed on that GPU.

1. `pytest tests/test_cuda.py`: streamed = resident on the GPU, pinned side-stream copies overlapping compute
   (in a profiler trace), the ledger's peak against torch.cuda.max_memory_allocated. Each test's verdict and
   what it measured go into the report.
2. GPT-J-6B (random init) streamed on one GPU: bf16 compute, checkpointed activations, the host store in
   RAM (pinned slabs if they fit, else pageable ones through pinned staging) with the Adam-moment dtype
   this host's RAM holds (chosen and said). At 1 x 2048 under a 16 GiB
   budget: device peak (ledger and allocator), tokens/s, model TFLOP/s, MFU against the GPU's measured bf16
   matmul peak (and its datasheet peak), the step against the planner's prediction; the update on the host
   against the update on the device; then a batch sweep up to the largest batch the planner fits in the GPU.

The report goes to stdout and runs/gpu-check.md. Every phase checks the clock (--budget-s, default 9.5 min,
for a 16-core H100 machine with 128 GiB RAM) and says what it left out. Without CUDA: says so, exits 0.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's packages, whatever the venv has installed

from streamer.cli.launch import PROCESS_ENV  # noqa: E402

# The store's slabs are pinned: `streamer`'s own process settings keep pinned blocks their size where torch
# can. Set before torch loads; the tests' process inherits them.
for _name, _value in PROCESS_ENV.items():
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import xml.etree.ElementTree as ElementTree  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from typing import Callable  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402

from layers import GPTJConfig  # noqa: E402
from memory_model import DEVICE_PRESETS, DeviceOutOfMemory, DeviceSpec, Link, Plan, PlanConfig  # noqa: E402
from memory_model import format_size, plan  # noqa: E402
from streamer.errors import StreamerError  # noqa: E402
from streamer.calibration.calibrate import measure_update  # noqa: E402
from streamer.calibration.calibrate_device import preset_for  # noqa: E402
from streamer import StreamingTrainer, TrainerConfig  # noqa: E402
from streamer.runtime.hardware import resolve_compute_dtype  # noqa: E402
from streamer.store.layout import model_layouts  # noqa: E402
from streamer.store.spec import StoreSpec  # noqa: E402

GiB = 2**30
GOAL_PEAK_BYTES = 16 * GiB  # device peak at 1 x 2048
GOAL_MODEL_FLOPS = 400e12  # model FLOP/s at the best batch, on an H100


@dataclass(frozen=True)
class TestRow:
    name: str
    outcome: str  # passed, failed, error, skipped
    measured: str
    message: str


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


@dataclass
class Bench:
    """What the benchmark found: lines about the machine and the store, the runs, and the peaks MFU uses."""

    lines: list[str]
    runs: list[Run]
    matmul_peak: float = 0.0  # measured bf16 FLOP/s
    datasheet: tuple[str, float] | None = None  # (preset, its bf16 FLOP/s) when the GPU is a preset's


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()


# --- 1. the CUDA tests ----------------------------------------------------------------------------------------
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


# --- 2. the machine -------------------------------------------------------------------------------------------
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


def matmul_peak(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / _timed(lambda: torch.mm(a, b, out=out), 10)


def link_bandwidth(nbytes: int = 256 * 2**20) -> tuple[float, float]:
    """Host-to-device and device-to-host bytes/s of a pinned copy."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = _timed(lambda: device.copy_(host, non_blocking=True), 5)
    d2h = _timed(lambda: host.copy_(device, non_blocking=True), 5)
    return nbytes / h2d, nbytes / d2h


def pinned_rounds_up() -> bool:
    """Whether the caching host allocator still rounds a 65 MiB pinned block up to 128 MiB (then the store's
    pinned bytes are counted rounded). Run before any other pinned allocation: a cached block would hide it."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats().get("allocated_bytes.current") if stats else None
    probe = torch.empty(65 * 2**20, dtype=torch.uint8, pin_memory=True)
    after = stats().get("allocated_bytes.current") if stats else None
    del probe
    return before is None or after is None or after - before > 65 * 2**20


def store_bytes(cfg: GPTJConfig, moment_dtype: str, rounded: bool) -> int:
    """RAM of a RAM-tier store with bf16 compute weights: one slab per unit and kind, each a power of two when
    `rounded` (pinned through an allocator that rounds up)."""
    spec = StoreSpec(cfg, "bf16", moment_dtype)
    sizes = [lay.numel * spec.kind_dtype(kind).itemsize for lay in model_layouts(cfg) for kind in spec.ram_kinds()]
    return sum(1 << (s - 1).bit_length() if rounded else s for s in sizes)


def choose_store(cfg: GPTJConfig, available: int, rounded: bool) -> tuple[str | None, str, str]:
    """(moment dtype, --pin-memory, why): the first RAM-tier store that fits the host's available RAM less a
    reserve, in the order pinned slabs with fp32 then bf16 moments, then pageable slabs (pinned staging only)."""
    reserve = max(24 * GiB, available // 5)  # CUDA, Python, the init's per-unit copies, staging buffers
    tried = []
    for pin, moments in (("all", "fp32"), ("all", "bf16"), ("staging", "fp32"), ("staging", "bf16")):
        need = store_bytes(cfg, moments, rounded and pin == "all")
        tried.append(f"{moments} moments {'pinned' if pin == 'all' else 'pageable'} {format_size(need)}")
        if need <= available - reserve:
            return moments, pin, (f"RAM tier, --pin-memory {pin}; {moments} Adam moments ({'; '.join(tried)}; "
                                  f"{format_size(available)} available, {format_size(reserve)} kept free"
                                  f"{'; the host allocator rounds pinned blocks up' if rounded else ''})")
    return None, "", (f"no RAM-tier store fits: {'; '.join(tried)} against {format_size(available)} available "
                      f"less {format_size(reserve)}; the disk tier needs the disk for 8+ B/param")


def gpu_spec(name: str, total: int, h2d: float, d2h: float, peak: float, host_update: float
             ) -> tuple[DeviceSpec, str | None]:
    """The planner's device: the matching preset with this machine's measured link, matmul peak, host AdamW
    rate and memory; (spec, preset name or None when no preset matches)."""
    try:
        preset: str | None = preset_for(name)
    except StreamerError:
        preset = None
    base = DEVICE_PRESETS[preset or "h100-sxm"]
    spec = replace(base, name=f"{name} (measured)", memory_bytes=total, h2d=Link(h2d, base.h2d.latency_s),
                   d2h=Link(d2h, base.d2h.latency_s), flops={**base.flops, "bf16": peak}, host_update_bw=host_update,
                   # The link and matmul rates are measured here, already achieved: no catalogue share on top.
                   matmul_efficiency=1.0, bandwidth_efficiency=1.0,
                   cuda_arch="sm{}{}".format(*torch.cuda.get_device_capability()))  # sizes cuBLAS's workspaces
    return spec, preset


# --- 3. the benchmark ----------------------------------------------------------------------------------------
def predict(cfg: GPTJConfig, spec: DeviceSpec, tc: TrainerConfig, batch: int, seq: int) -> Plan:
    return plan(cfg, spec,
                PlanConfig(batch=batch, seq=seq, activations=tc.step.activations, compute_dtype="bf16",
                           prefetch=tc.step.prefetch, update_on=tc.step.update_on,
                           update_chunk=tc.step.update_chunk, store="ram"))


def measure(trainer: StreamingTrainer, spec: DeviceSpec, batch: int, seq: int, warmup: int, steps: int) -> Run:
    ids = torch.randint(0, trainer.cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(batch))
    prediction = predict(trainer.cfg, spec, trainer.tc, batch, seq)
    gc.collect()  # a replaced trainer's device buffers must not count in this one's allocator peak
    torch.cuda.empty_cache()
    try:
        for _ in range(warmup):
            trainer.step(ids)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer.ledger.reset_peak()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            trainer.step(ids)  # returns the loss as a float: the step's kernels have finished
            times.append(time.perf_counter() - start)
    except (torch.cuda.OutOfMemoryError, DeviceOutOfMemory) as exc:
        torch.cuda.empty_cache()
        return Run(batch, trainer.tc.step.update_on, prediction=prediction, error=" ".join(str(exc).split())[:200])
    return Run(batch, trainer.tc.step.update_on, tuple(times), trainer.ledger.peak, torch.cuda.max_memory_allocated(),
               prediction)


def on_same_store(trainer: StreamingTrainer, **changes: object) -> StreamingTrainer:
    """A trainer with some settings changed (update place, budget) on `trainer`'s store, which none of them
    shapes: building a 6B store again would take minutes. `trainer` must not be used after this."""
    trainer.executor.close()
    return StreamingTrainer(trainer.cfg, trainer.tc.replace(**changes), _store=trainer.store)


def benchmark(model: str, seq: int, clock: Clock, bench: Bench) -> None:
    """Fills `bench` as it goes, so that a failure part-way still leaves what was measured."""
    cfg = GPTJConfig.preset(model)
    name, total = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory
    rounded = pinned_rounds_up()
    moments, pin, store_note = choose_store(cfg, psutil.virtual_memory().available, rounded)
    peak = matmul_peak()
    h2d, d2h = link_bandwidth()
    spec, preset = gpu_spec(name, total, h2d, d2h, peak, measure_update(8 * 2**20, 3))
    bench.matmul_peak = peak
    bench.datasheet = (preset, DEVICE_PRESETS[preset].flops["bf16"]) if preset else None
    bench.lines += [f"- GPU: {name}, {format_size(total)}; host: {psutil.cpu_count()} CPUs, "
                    f"{format_size(psutil.virtual_memory().total)} RAM; torch {torch.__version__}",
                    f"- {resolve_compute_dtype('cuda').reason}",
                    f"- measured: bf16 matmul peak {peak / 1e12:,.0f} TFLOP/s (8192^3, best of 10); pinned copies "
                    f"{h2d / 1e9:.1f} GB/s to the GPU, {d2h / 1e9:.1f} GB/s back (256 MiB); host AdamW "
                    f"{spec.host_update_bw / 1e9:.1f} GB/s touched",
                    f"- planner device: {'preset ' + preset if preset else 'no matching preset: h100-sxm'}'s "
                    "figures with the measured link, matmul peak, host AdamW rate and GPU memory",
                    f"- {model} store: {store_note}"]
    if moments is None:
        return
    # Pinned slabs cross without staging; pageable ones are copied through pinned staging buffers.
    tc = TrainerConfig.of(dtype="bf16", moment_dtype=moments, store="ram", activations="checkpoint",
                          device="cuda", budget=GOAL_PEAK_BYTES, seed=0, pin_memory=pin)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        trainer = StreamingTrainer(cfg, tc, store_dir=Path(tmp) / "store")
        pinned = ", pinned" if pin == "all" else ""
        bench.lines.append(f"- store built (random init{pinned}) in {time.monotonic() - started:.0f} s")
        runs = bench.runs
        try:
            runs.append(measure(trainer, spec, 1, seq, warmup=1, steps=3))
            step = runs[0].median_s if runs[0].step_s else 60.0
            if clock.left() > 6 * step + 60:
                trainer = on_same_store(trainer, update_on="host")
                runs.append(measure(trainer, spec, 1, seq, warmup=1, steps=2))
            trainer = on_same_store(trainer, update_on="device", budget=total)
            largest = predict(cfg, replace(spec, memory_bytes=int(0.85 * total)), trainer.tc, 1, seq).max_batch_seq[0]
            batch, last = 2, runs[0]
            while batch <= largest and last.step_s and not last.error:
                if clock.left() < 3 * last.median_s * batch / last.batch + 20:
                    bench.lines.append(f"- batch sweep stopped before batch {batch} (planner's largest: "
                                       f"{largest}): the time budget")
                    break
                last = measure(trainer, spec, batch, seq, warmup=1, steps=2)
                runs.append(last)
                batch = batch * 2 if batch * 2 <= largest or batch == largest else largest
        finally:
            trainer.close()


# --- 4. the report -------------------------------------------------------------------------------------------
def _row(run: Run, bench: Bench, seq: int) -> str:
    p = run.prediction
    if not run.step_s:
        return f"| {run.batch} x {seq} | {run.update_on} | failed: {run.error} |" + " |" * 7
    flops = p.model_flops / run.median_s
    sheet = f" / {flops / bench.datasheet[1]:.0%}" if bench.datasheet else ""
    return (f"| {run.batch} x {seq} | {run.update_on} | {run.median_s:.2f} s ({len(run.step_s)}) | "
            f"{run.batch * seq / run.median_s:,.0f} | {flops / 1e12:,.0f} | {flops / bench.matmul_peak:.0%}{sheet} | "
            f"{format_size(run.ledger_peak)} | {format_size(run.allocator_peak)} | {p.step_time_s:.2f} s "
            f"({p.step_time_s / run.median_s - 1:+.0%}) | {format_size(p.allocated_peak_bytes)} |")


def report(tests: list[TestRow], bench: Bench, model: str, seq: int, seconds: float) -> str:
    out = ["# gpu-check", "", f"`make gpu-check` (benchmarks/gpu_check.py), {time.strftime('%Y-%m-%d %H:%M')}, "
           f"{seconds:.0f} s.", "", "## CUDA tests (tests/test_cuda.py)", "",
           "| test | result | measured |", "|---|---|---|"]
    out += [f"| {t.name} | {t.outcome}{': ' + t.message if t.message else ''} | {t.measured} |" for t in tests]
    out += ["", f"## {model} streamed on one GPU", "", *bench.lines, ""]
    if bench.runs:
        sheet = bench.datasheet
        out += ["MFU: model FLOP/s (3 x the forward's matmul FLOPs, the planner's count; the checkpoint recompute "
                "not counted) over the measured bf16 matmul peak" + (f" / over {sheet[0]}'s datasheet peak "
                f"{sheet[1] / 1e12:,.0f} TFLOP/s" if sheet else "") + f". Budget 16 GiB at 1 x {seq}; the "
                "sweep runs with the GPU's memory as its budget. Step: median (timed steps), after one "
                "warm-up step.", "",
                "| batch | update | step | tokens/s | model TFLOP/s | MFU | ledger peak | allocator peak | "
                "planner step (error) | planner peak |", "|---|---|---|---|---|---|---|---|---|---|"]
        out += [_row(r, bench, seq) for r in bench.runs]
        out += ["", "## Targets", ""] + targets(bench.runs, seq)
    return "\n".join(out) + "\n"


def targets(runs: list[Run], seq: int) -> list[str]:
    first, device = runs[0], [r for r in runs if r.step_s and r.update_on == "device"]
    peak = max(first.ledger_peak, first.allocator_peak)
    lines = [f"- device peak <= 16 GiB at 1 x {seq}: " + (f"{'met' if peak <= GOAL_PEAK_BYTES else 'NOT met'} "
             f"(ledger {format_size(first.ledger_peak)}, allocator {format_size(first.allocator_peak)})"
             if first.step_s else f"unmeasured ({first.error})")]
    host = next((r for r in runs if r.update_on == "host" and r.step_s), None)
    if host is not None and first.step_s:
        lines.append(f"- update on the host vs on the device at 1 x {seq}: {host.median_s:.2f} s vs "
                     f"{first.median_s:.2f} s per step ({host.median_s / first.median_s:.2f}x)")
    if device:
        best = max(device, key=lambda r: r.prediction.model_flops / r.median_s)
        flops = best.prediction.model_flops / best.median_s
        lines.append(f"- >= 400 model TFLOP/s at the best batch: {'met' if flops >= GOAL_MODEL_FLOPS else 'NOT met'} "
                     f"({flops / 1e12:,.0f} TFLOP/s at batch {best.batch} x {seq})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "gpu-check.md", help="the report (markdown)")
    parser.add_argument("--model", default="gptj-6b", help="a preset (default gptj-6b)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget-s", type=float, default=570, help="wall-clock budget of the whole check")
    parser.add_argument("--no-tests", action="store_true", help="skip tests/test_cuda.py")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False): "
              "nothing to check on this machine; run `make gpu-check` where there is an NVIDIA GPU")
        return 0
    clock, started = Clock(args.budget_s), time.monotonic()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tests = [] if args.no_tests else run_tests(args.output.parent, timeout_s=min(300.0, clock.left() / 2))
    bench, failed = Bench([], []), False
    if clock.left() > 240:
        try:
            benchmark(args.model, args.seq, clock, bench)
        except Exception as exc:  # the report still says what the tests and the runs so far found
            traceback.print_exc()
            bench.lines.append(f"- the benchmark failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            failed = True
    else:
        bench.lines.append(f"- not run: {clock.left():.0f} s of the --budget-s left after the tests")
    text = report(tests, bench, args.model, args.seq, time.monotonic() - started)
    args.output.write_text(text)
    print(text + f"\nwrote {args.output}")
    return 0 if not failed and all(t.outcome in ("passed", "skipped") for t in tests) else 1


if __name__ == "__main__":
    sys.exit(main())
