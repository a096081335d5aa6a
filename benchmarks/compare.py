"""The benchmark's comparisons as tables: each turns measured results into a Section and its target verdicts.

Long because it is one concern, a function per table of BENCHMARKS.md (with its target lines), and the tables share
their cells' helpers.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from layers import ModelConfig
from memory_model import BASELINE_BYTES_PER_PARAM, Plan
from memory_model.shapes import forward_flops
from benchmarks.machine import DiskBandwidth, Peaks, ScalePick, UpdateRates
from benchmarks.report import Section, count, params, percent, rate, ratio, seconds, size, verdict
from benchmarks.runs import Result
from streamer.runtime.hardware import DtypeChoice

STREAM_RAM = "ours streamed, RAM tier"
STREAM_DISK = "ours streamed, disk tier"
STREAM_DISK_HALF = "ours streamed, disk tier, bf16 master + int8 moments"
RESIDENT = "ours resident"
HF_FP32 = "HF transformers, fp32"
HF_BF16 = "HF transformers, bf16 autocast"
DS_CPU = "DeepSpeed ZeRO-3, CPU offload"
DS_NVME = "DeepSpeed ZeRO-3, NVMe offload"
SECOND = "ours streamed, RAM tier, second size"
DP_1 = "ours streamed, 1 process"
DP_2 = "ours streamed, 2 processes"
SCALE = "ours streamed, disk tier, scale run"
SCALE_FLOOR = "ours streamed, RAM tier, scale run's width (compute floor)"
GiB = 2**30
OTHERS = "others' load (cores)"
SHARED_NOTE = ("others' load: mean CPU cores that processes outside the bench kept busy during that contender's "
               "blocks (/proc/stat minus the bench's own CPU time); the machine is shared, so a contender timed "
               "under more load is slowed by it.")


@dataclass(frozen=True)
class Context:
    results: dict[str, Result]
    peaks: Peaks
    disk: dict[str, DiskBandwidth]  # result label -> the raw disk measurement nearest to it in time
    plans: dict[str, Plan]  # result label -> the planner's prediction for that run (local device)
    scale: ScalePick | None
    compute: DtypeChoice  # our runs' compute dtype and why (--dtype resolved on this CPU)
    skipped: dict[str, str] = field(default_factory=dict)  # result label -> why it did not run
    update: UpdateRates | None = None  # the update's AdamW against torch's, measured in this run


@dataclass(frozen=True)
class Outcome:
    section: Section
    targets: tuple[str, ...] = ()


def _get(ctx: Context, label: str) -> Result | None:
    result = ctx.results.get(label)
    return result if result is not None and result.ok else None


def _missing(ctx: Context, label: str) -> str:
    if label in ctx.skipped:
        return f"not run: {ctx.skipped[label]}"
    result = ctx.results.get(label)
    return f"failed: {result.error}" if result is not None else "not run"


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _median_or_inf(r: Result) -> float:
    """The faster of several runs by median step; one without timed steps is never it."""
    return math.inf if r.median_s is None else r.median_s


def _target(name: str, value: str, met: bool | None, why: str = "") -> str:
    return f"{name}: {verdict(met)} ({value})" + (f" — {why}" if why else "")


def _timing_row(ctx: Context, label: str, *extra: str) -> tuple[str, ...]:
    r = _get(ctx, label)
    if r is None:
        return (label, _missing(ctx, label), *("—" for _ in range(3 + len(extra))))
    return (label, seconds(r.median_s), r.steps_note, f"{r.tokens_per_s:,.0f}", f"{r.others_cores:.1f}", *extra)


def dtypes(ctx: Context) -> Outcome:
    """Which compute dtype each run used, and why."""
    why = {HF_FP32: "fixed: the fp32 reference a user runs without bf16 hardware",
           HF_BF16: "fixed: torch.autocast bf16, what a user writes for bf16 hardware",
           DS_CPU: "as ours (bf16 mixed precision when bf16)", DS_NVME: "as ours (bf16 mixed precision when bf16)",
           SCALE: "as ours; where bf16 is native, fp32 compute may win for its smaller store (section 6)"}
    rows = tuple((label, r.spec.dtype, why.get(label, ctx.compute.reason)) for label, r in ctx.results.items())
    return Outcome(Section("Compute dtype of each run", ("run", "compute dtype", "why"), rows,
                           ("Ours follow `streamer bench --dtype` (default auto: bf16 where this CPU runs it "
                            "natively and at least as fast as fp32).",)))


def overhead(ctx: Context) -> Outcome:
    resident, stream = _get(ctx, RESIDENT), _get(ctx, STREAM_RAM)
    value = _div(stream.median_s if stream else None, resident.median_s if resident else None)
    met = None if value is None else value <= 1.10
    rows = (_timing_row(ctx, RESIDENT, "1.00x", "", ""),
            _timing_row(ctx, STREAM_RAM, ratio(value), "<= 1.10x", verdict(met)))
    section = Section("1. Streaming overhead: streamed (RAM tier, resident activations) vs our resident training",
                      ("run", "step (median)", "timed steps", "tokens/s", OTHERS, "vs resident", "target", "status"),
                      rows,
                      (f"Same model, dtype ({ctx.compute.dtype} compute, fp32 master and Adam state), batch and "
                       "sequence.",
                       SHARED_NOTE))
    return Outcome(section, (_target("1. streamed / resident step <= 1.10x", ratio(value), met),))


def _rss_cells(r: Result | None, reference: Result | None) -> tuple[str, str, str]:
    if r is None:
        return "—", "—", "—"
    return size(r.rss_peak_bytes), ratio(_div(r.rss_peak_bytes, reference.rss_peak_bytes if reference else None)), \
        size(r.process_rss_peak_bytes)


def _hf_experts_note(hf: list[Result]) -> tuple[str, ...]:
    """How transformers ran a mixture's experts: the implementation its class picked by default, and each run's
    dtype inside them (torch.autocast leaves grouped_mm alone: its experts stay in the weights' fp32)."""
    runs = [f"{r.label}: `{r.experts}`" + (" (fp32 under the autocast)" if r.spec.dtype == "bf16" and
                                          r.experts == "grouped_mm" else "") for r in hf if r.experts]
    return (f"transformers' experts, as its class picks them by default (experts_implementation): "
            f"{'; '.join(runs)}.",) if runs else ()


def versus_hf(ctx: Context) -> Outcome:
    hf = [r for r in (_get(ctx, HF_FP32), _get(ctx, HF_BF16)) if r is not None]
    faster = min(hf, key=_median_or_inf, default=None)
    leaner = min(hf, key=lambda r: r.rss_peak_bytes, default=None)
    rows = []
    for label in (HF_FP32, HF_BF16, STREAM_RAM, STREAM_DISK):
        r = _get(ctx, label)
        time_ratio = _div(r.median_s if r else None, faster.median_s if faster else None)
        rows.append(_timing_row(ctx, label, ratio(time_ratio), *_rss_cells(r, leaner)))
    ram, disk = _get(ctx, STREAM_RAM), _get(ctx, STREAM_DISK)
    step_value = _div(ram.median_s if ram else None, faster.median_s if faster else None)
    rss_value = _div(disk.rss_peak_bytes if disk else None, leaner.rss_peak_bytes if leaner else None)
    notes = (f"Step ratios are against the faster HF run ({faster.label if faster else '—'}); RSS ratios against "
             f"the leaner one ({leaner.label if leaner else '—'}). Peak RSS (steps) is the process's high-water mark "
             "from the first warm-up step on (reset after setup); process peak includes building the model.",
             "Our RSS includes the host store (RAM tier: all weights, gradients and Adam state live in the process).",
             SHARED_NOTE, *_hf_experts_note(hf))
    section = Section("2. vs Hugging Face transformers + torch.optim.AdamW (resident)",
                      ("run", "step (median)", "timed steps", "tokens/s", OTHERS, "step vs faster HF",
                       "peak RSS (steps)",
                       "RSS vs leaner HF", "process peak RSS"), tuple(rows), notes)
    return Outcome(section, (
        _target("2. streamed (RAM) step / faster HF <= 0.7x", ratio(step_value),
                None if step_value is None else step_value <= 0.7),
        _target("2. disk-tier peak RSS / leaner HF <= 0.25x", ratio(rss_value),
                None if rss_value is None else rss_value <= 0.25)))


def versus_deepspeed(ctx: Context) -> Outcome:
    ds = [r for r in (_get(ctx, DS_CPU), _get(ctx, DS_NVME)) if r is not None]
    faster = min(ds, key=_median_or_inf, default=None)
    rows, verdicts = [], []
    for label in (DS_CPU, DS_NVME, STREAM_RAM, STREAM_DISK):
        r = _get(ctx, label)
        speedup = _div(faster.median_s if faster else None, r.median_s if r else None)
        rss = _div(r.rss_peak_bytes if r else None, faster.rss_peak_bytes if faster else None)
        status = ""
        if label in (STREAM_RAM, STREAM_DISK):
            met = None if speedup is None or rss is None else speedup >= 2.0 and rss <= 1.0
            status = verdict(met)
            verdicts.append(_target(f"3. {label}: >= 2x faster than the faster DeepSpeed mode at no more peak RSS",
                                    f"{ratio(speedup)} faster, {ratio(rss)} the RSS", met))
        setup = f"{max(r.setup_s):.0f} s" if r is not None else "—"
        rows.append(_timing_row(ctx, label, ratio(speedup), size(r.rss_peak_bytes) if r else "—", ratio(rss),
                                setup, status))
    notes = (f"Speed-ups and RSS ratios are against the faster DeepSpeed mode ({faster.label if faster else '—'}).",
             "DeepSpeed runs CPU-only (DS_ACCELERATOR=cpu, gloo, one process) in our compute dtype (bf16 mixed "
             "precision when bf16), AdamW with the same hyper-parameters and clipping; its ops compile during "
             "setup, never in a timed step.", SHARED_NOTE)
    section = Section("3. vs DeepSpeed ZeRO-3 with CPU and NVMe offload",
                      ("run", "step (median)", "timed steps", "tokens/s", OTHERS, "faster DS / this",
                       "peak RSS (steps)",
                       "RSS vs faster DS", "setup (max)", "target >= 2x at <= RSS"), tuple(rows), notes)
    return Outcome(section, tuple(verdicts))


def _store_per_param(r: Result | None) -> tuple[float | None, float | None]:
    """(read, written): the bytes our store's files were asked for in a step, per parameter; None unmeasured."""
    if r is None:
        return None, None
    return _div(r.io.get("store_read"), r.params), _div(r.io.get("store_written"), r.params)


def _per_param_cell(per_param: tuple[float | None, float | None]) -> str:
    return " / ".join("—" if b is None else f"{b:.2f}" for b in per_param)


def _disk_floor_s(r: Result, raw: DiskBandwidth) -> float | None:
    """The floor the disk sets: what reached it in a step, at the rate it moves bytes reading and writing at once."""
    return _div(r.io.get("read_bytes", 0) + r.io.get("write_bytes", 0), raw.shared_bytes_per_s)


def _disk_row(ctx: Context, label: str, compute_s: float | None, compute_source: str) -> tuple[tuple[str, ...], str]:
    r, raw = _get(ctx, label), ctx.disk.get(label)
    if r is None or raw is None:
        return (label, _missing(ctx, label), *("—" for _ in range(11))), _target(
            f"4. {label}", "unmeasured", None)
    io_s = r.phases.get("io_busy")
    bound = max(io_s or 0.0, compute_s or 0.0) or None
    overlap = _div(r.median_s, bound)
    overlap_met = None if overlap is None else overlap <= 1.15
    cells, judged = [], []
    for calls, storage, busy, raw_rate in (("rchar", "read_bytes", "load_busy", raw.read_bytes_per_s),
                                           ("wchar", "write_bytes", "offload_busy", raw.write_bytes_per_s)):
        achieved = _div(r.io.get(calls), r.phases.get(busy))
        share = _div(achieved, raw_rate)
        if r.io.get(storage, 0) < 0.5 * r.io.get(calls, 0):
            # Mostly served by the page cache: a memory copy, not the disk; no verdict on the disk's bandwidth.
            cells.append(f"{rate(achieved)} (page cache: not judged)")
        else:
            judged.append(share)
            cells.append(f"{rate(achieved)} ({percent(share)} of {rate(raw_rate)})")
    measured = [j for j in judged if j is not None]
    bw_met = None if not judged or len(measured) < len(judged) else min(measured) >= 0.8
    floor_s = _disk_floor_s(r, raw)
    floor = f"{seconds(floor_s)} ({ratio(_div(r.median_s, floor_s))})"
    row = (f"{label} ({r.update_schedule})", *cells, _per_param_cell(_store_per_param(r)),
           f"{size(r.io.get('rchar'))} / {size(r.io.get('read_bytes'))}",
           f"{size(r.io.get('wchar'))} / {size(r.io.get('write_bytes'))}",
           seconds(r.median_s), seconds(io_s), f"{seconds(compute_s)} ({compute_source})", ratio(overlap), floor,
           verdict(bw_met), verdict(overlap_met))
    line = (f"4. {label}: bandwidth >= 80% of raw: {verdict(bw_met)} (read {cells[0]}, write {cells[1]}); "
            f"step <= 1.15x max(I/O, compute): {verdict(overlap_met)} ({ratio(overlap)}); disk floor (step / "
            f"floor): {floor}")
    return row, line


def disk_tier(ctx: Context) -> Outcome:
    ram = _get(ctx, STREAM_RAM)
    scale = _get(ctx, SCALE)
    rows, lines = [], []
    for label, compute, source in (
            (STREAM_DISK, ram.median_s if ram else None, "RAM-tier step, same model"),
            (SCALE, scale.phases.get("compute_busy") if scale else None, "compute spans")):
        row, line = _disk_row(ctx, label, compute, source)
        rows.append(row)
        lines.append(line)
    notes = ("Store B/param: the data bytes the store's files were asked for in a step, per parameter (trailers "
             "and the checksums' read-back aside): the figure the planner prices (docs/MEMORY_MODEL.md, disk bytes).",
             "Achieved bandwidth = bytes passed to read/write calls in a step (/proc/self/io rchar, wchar) over the "
             "wall time the I/O worker spent in load / offload spans. Raw = sequential buffered write + fsync and "
             "read with the page cache dropped, on the same disk in the same run (best of several tries).",
             "Disk floor: the bytes that reached the block device in a step (read + written) over the rate the "
             "disk moves them reading one file while writing another (the store's own writer), measured in the "
             "same run: no schedule on this disk steps faster, whatever it overlaps.",
             "'read / storage' and 'written / storage' per step: bytes the calls moved vs bytes that reached the "
             "block device (read_bytes, write_bytes): a store smaller than free RAM is read from the page cache.",
             "Compute for the scale run is the union of its forward/backward/update spans, which include waits for "
             "gradient offloads: an upper bound.")
    section = Section("4. Disk tier: bandwidth and overlap",
                      ("run", "read (achieved, % raw)", "write (achieved, % raw)",
                       "store B/param per step (read / written)", "read / storage per step",
                       "written / storage per step", "step", "I/O busy", "compute", "step / max(I/O, compute)",
                       "disk floor (step / floor)", ">= 80% raw", "<= 1.15x"), tuple(rows), notes)
    return Outcome(section, tuple(lines))


def half_the_bytes(ctx: Context) -> Outcome:
    """The opt-in precisions against the default fp32 state, both on the disk tier, and against DeepSpeed's
    NVMe offload, which moves the same kind of state through a disk."""
    full, half, nvme = _get(ctx, STREAM_DISK), _get(ctx, STREAM_DISK_HALF), _get(ctx, DS_NVME)
    rows = []
    for label, r in ((STREAM_DISK, full), (STREAM_DISK_HALF, half), (DS_NVME, nvme)):
        per_param = _store_per_param(None if label == DS_NVME else r)  # DeepSpeed has no store of ours
        rows.append(_timing_row(ctx, label, _per_param_cell(per_param),
                                size(r.rss_peak_bytes) if r else "—", ratio(_div(r.median_s if r else None,
                                                                                  full.median_s if full else None))))
    step = _div(half.median_s if half else None, full.median_s if full else None)
    read, written = _store_per_param(half)
    faster = _div(nvme.median_s if nvme else None, half.median_s if half else None)
    rss = _div(half.rss_peak_bytes if half else None, nvme.rss_peak_bytes if nvme else None)
    targets = (
        _target("disk tier, bf16 master + int8 moments: step <= 0.5x the fp32 state's", ratio(step),
                None if step is None else step <= 0.5),
        _target("disk tier, bf16 master + int8 moments: store <= 7 read and <= 5 written B/param",
                "—" if read is None else f"{read:.2f} / {written:.2f}",
                None if read is None or written is None else read <= 7 and written <= 5),
        _target("disk tier, bf16 master + int8 moments: >= 2x faster than DeepSpeed's NVMe offload at no more "
                "peak RSS", f"{ratio(faster)} faster, {ratio(rss)} the RSS",
                None if faster is None or rss is None else faster >= 2 and rss <= 1))
    notes = ("Store B/param: the data bytes the store's files were asked for in a step, per parameter (section 4).",
             "The same model, batch and clipping as section 4's run; only the optimizer state's precision "
             "differs (`--master-dtype bf16 --moment-dtype int8`). docs/CONVERGENCE.md measures what it costs in "
             "loss.", SHARED_NOTE)
    section = Section("Half the bytes: opt-in precisions on the disk tier",
                      ("run", "step (median)", "timed steps", "tokens/s", OTHERS, "store B/param (read / written)",
                       "peak RSS (steps)", "step / fp32 state's"), tuple(rows), notes)
    return Outcome(section, targets)


def update_speed(ctx: Context) -> Outcome:
    """The update's AdamW against torch's fused AdamW on the same tensors."""
    u = ctx.update
    if u is None:
        return Outcome(Section("The update: AdamW vs torch's fused AdamW", ("run", "status"),
                               (("update", "not measured"),)))
    speed = u.torch_s / u.ours_s
    state = 16 * u.numel  # fp32 master, gradient and both moments
    rows = (("streamer.runtime.optim.adamw_chunk", f"{u.chunk:,}", seconds(u.ours_s), rate(state / u.ours_s),
             ratio(speed)),
            ("torch.optim.AdamW(fused=True)", "whole tensor", seconds(u.torch_s), rate(state / u.torch_s), "1.00x"))
    notes = (f"One fp32 state of {u.numel:,} parameters; best of several steps, the two taken in turn. Both leave "
             f"the weights {'bit for bit equal' if u.same else 'DIFFERENT'}.",)
    section = Section("The update: AdamW vs torch's fused AdamW on the same tensors",
                      ("update", "chunk (params)", "step", "state touched per second", "speed vs torch"), rows, notes)
    # The same fused kernel chunk by chunk: a speed within this timing's noise of torch's is torch's speed.
    return Outcome(section, (_target("the update's AdamW at torch's fused AdamW's speed (within 5%), bit for bit equal",
                                     ratio(speed), speed >= 0.95 and u.same),))


def utilisation(ctx: Context) -> Outcome:
    rows = []
    for label, r in ctx.results.items():
        if not r.ok or r.median_s is None:
            continue
        shape = ModelConfig.from_dict(r.spec.model)
        # The planner's count: 3 x the forward's matmul FLOPs (backward = 2 x forward), no recompute.
        flops = 3 * sum(forward_flops(shape, u, r.spec.batch, r.spec.seq) for u in shape.unit_names())
        achieved = flops / r.median_s
        peak = ctx.peaks.bf16_flops if r.spec.dtype == "bf16" else ctx.peaks.fp32_flops
        rows.append((label, params(r.params), r.spec.dtype, f"{flops / 1e12:.3g}", seconds(r.median_s),
                     f"{achieved / 1e9:,.0f}", percent(achieved / peak)))
    notes = (f"Peak: best of timed {ctx.peaks.n}^3 matmuls in this run: bf16 {ctx.peaks.bf16_flops / 1e9:,.0f} "
             f"GFLOP/s, fp32 {ctx.peaks.fp32_flops / 1e9:,.0f} GFLOP/s. Model FLOPs per step = 3 x the forward's "
             "matmul FLOPs (memory_model.planner), the same count for every contender of a model.",)
    return Outcome(Section("5. Utilisation: model FLOP/s vs this CPU's measured matmul peak in the run's dtype",
                           ("run", "params", "dtype", "model TFLOP/step", "step", "achieved GFLOP/s",
                            "MFU (peak of its dtype)"),
                           tuple(rows), notes))


# The step time and peak RSS each scale model is held to on this 2-core box's disk tier, where one is stated.
SCALE_TARGETS: dict[str, tuple[float, int]] = {"gptj-6b": (120.0, 8 * GiB), "llama-3.1-8b": (150.0, 8 * GiB)}
FLOOR_BOUND = 1.2  # the scale step against the higher of its two floors, measured in the same run
QLORA_SCALE_RSS = 6 * GiB  # a QLoRA scale run's peak RSS on this box's disk tier


def _qlora_rank(pick: ScalePick) -> int:
    return max((c.qlora_rank for c, _ in pick.considered), default=0)


def scale_key(pick: ScalePick) -> str:
    """The scale run's name in its section's title and its targets: the model asked for, and QLoRA where the run
    trains adapters on its 4-bit base (a report holds both, each written by its own run)."""
    rank = _qlora_rank(pick)
    return pick.model + (f", QLoRA r={rank}" if rank else "")


def _run_peak(r: Result) -> int:
    """The run's peak RSS: setup's or the steps', whichever is higher (an OOM kill comes at either)."""
    return max(r.rss_peak_bytes, r.process_rss_peak_bytes)


def _model_target(pick: ScalePick, r: Result | None, why: str) -> list[str]:
    """The scale model's own target, where one is stated: met only when the model itself ran, not a smaller one."""
    if pick.model not in SCALE_TARGETS:
        return []
    limit_s, limit_rss = SCALE_TARGETS[pick.model]
    name = f"6. {pick.model}: step <= {limit_s:g} s at peak RSS <= {size(limit_rss)}"
    if r is None or r.median_s is None or pick.chosen is None:
        return [_target(name, why, None)]
    if pick.chosen.name != pick.model:
        return [_target(name, f"{pick.chosen.name} ran instead: the disk does not hold {pick.model}", False)]
    return [_target(name, f"{seconds(r.median_s)} at {size(_run_peak(r))}",
                    r.median_s <= limit_s and _run_peak(r) <= limit_rss)]


def compute_floor_s(floor: Result | None, model: ModelConfig) -> float | None:
    """The scale model's compute with no disk, from the RAM-tier run of its width with fewer blocks and a smaller
    vocabulary (forward, backward and update spans of the same dtype, precisions and checkpointing): its median
    block times the model's blocks, and its embedding and head, whose matmuls, loss and update are linear in the
    vocabulary, times the model's vocabulary over its own."""
    if floor is None or not floor.unit_compute:
        return None
    blocks = [s for unit, s in floor.unit_compute.items() if unit.startswith("block.")]
    if not blocks:
        return None
    rest = sum(s for unit, s in floor.unit_compute.items() if not unit.startswith("block."))
    vocab = ModelConfig.from_dict(floor.spec.model).vocab_size
    return rest * model.vocab_size / vocab + statistics.median(blocks) * model.num_hidden_layers


def _floor_targets(pick: ScalePick, r: Result, ctx: Context) -> tuple[tuple[str, ...], list[str]]:
    """(cells, targets): the step against max(I/O floor, compute floor) and the run's peak RSS against the plan,
    both from this run; a target is met only by the model asked for itself."""
    raw, chosen = ctx.disk.get(SCALE), pick.chosen
    assert chosen is not None
    io_floor = None if raw is None else _disk_floor_s(r, raw)
    compute_floor = compute_floor_s(_get(ctx, SCALE_FLOOR), chosen.config)
    bound = None if io_floor is None or compute_floor is None else max(io_floor, compute_floor)
    step_ratio = _div(r.median_s, bound)
    host = _div(_run_peak(r), r.planned_host_bytes)
    cells = (seconds(io_floor), seconds(compute_floor), ratio(step_ratio), size(r.planned_host_bytes or None),
             size(_run_peak(r)), ratio(host))
    itself = chosen.name == pick.model
    ran_instead = f"{chosen.name} ran instead: the disk does not hold {pick.model}"
    floors = (f"{ratio(step_ratio)}: I/O floor {seconds(io_floor)}, compute floor {seconds(compute_floor)}"
              if itself else ran_instead)
    # A floor above the step it bounds was not one (the short run, scaled up, cost more than the model's own
    # compute): no verdict on it.
    if step_ratio is not None and r.median_s is not None and max(io_floor or 0.0, compute_floor or 0.0) > r.median_s:
        floors, step_ratio = floors + "; a floor above the step is no floor: not judged", None
    plan = f"{size(_run_peak(r))} measured, {size(r.planned_host_bytes or None)} planned" if itself else ran_instead
    return cells, [
        _target(f"6. {scale_key(pick)}: step <= {FLOOR_BOUND:g}x max(I/O floor, compute floor)", floors,
                None if step_ratio is None else itself and step_ratio <= FLOOR_BOUND),
        _target(f"6. {scale_key(pick)}: peak RSS within {HOST_TOLERANCE:.0%} of the plan", plan,
                None if host is None else itself and abs(host - 1) <= HOST_TOLERANCE)]


def _floor_shape(floor: Result | None) -> str:
    if floor is None:
        return "—"
    cfg = ModelConfig.from_dict(floor.spec.model)
    return f"{cfg.num_hidden_layers} blocks and a vocabulary of {cfg.vocab_size:,}"


SCALE_TITLE = "6. Scale on this machine (disk tier)"


def scale(ctx: Context) -> Outcome:
    pick, r = ctx.scale, _get(ctx, SCALE)
    title = SCALE_TITLE if pick is None else f"{SCALE_TITLE}: {scale_key(pick)}"
    notes = []
    if pick is not None:
        notes.append(f"Free disk {size(pick.free_bytes)}; the run may use {size(pick.budget_bytes)} (the rest is "
                     "left to other users of the disk). Candidates, largest first: " + "; ".join(
                         f"{c.describe()} store {size(c.store_bytes)} (at most {size(c.disk_bytes)} on disk, update "
                         f"{c.update_timing}) {'fits' if fits else 'does not fit'}"
                         for c, fits in pick.considered))
    qlora = pick is not None and bool(_qlora_rank(pick))
    # Full training: >= 3B at <= 8 GiB; QLoRA: the model asked for at <= 6 GiB.
    three_b = (f"6. {scale_key(pick)}: peak RSS <= {size(QLORA_SCALE_RSS)}" if pick is not None and qlora else
               f"6. {pick.model if pick else 'scale'}: >= 3B params at peak RSS <= 8 GiB")
    if r is None or pick is None or pick.chosen is None:
        why = _missing(ctx, SCALE) if pick is None or pick.chosen is not None else "no candidate fits the disk"
        return Outcome(Section(title, ("model", "status"), (("—", why),), tuple(notes)),
                       (_target(three_b, why, None),
                        *(_model_target(pick, None, why) if pick is not None and not qlora else ())))
    chosen, p = pick.chosen, r.phases
    stretch = chosen.name == pick.model  # the model asked for itself; smaller Adam moments are acceptable for it
    if qlora:
        met = stretch and _run_peak(r) <= QLORA_SCALE_RSS
    else:
        met = chosen.params >= 3e9 and (chosen.precision.moments == "fp32" or stretch) and _run_peak(r) <= 8 * GiB
    floor_cells, floor_targets = _floor_targets(pick, r, ctx)
    row = (chosen.describe(), size(chosen.store_bytes), r.steps_note, seconds(r.median_s),
           f"{r.tokens_per_s:,.1f}", f"{r.others_cores:.1f}", *floor_cells, size(r.rss_peak_bytes),
           f"{seconds(p.get('load_busy'))} / {seconds(p.get('offload_busy'))} / {seconds(p.get('io_busy'))}",
           f"{seconds(p.get('forward'))} / {seconds(p.get('backward'))} / {seconds(p.get('update'))}",
           f"{seconds(r.rusage.get('user_s'))} / {seconds(r.rusage.get('system_s'))} / "
           f"{count(r.rusage.get('faults'))}",
           verdict(met), verdict(stretch))
    kept = " (block inputs kept, blocks recomputed in backward)" if r.spec.activations == "checkpoint" else ""
    notes.append(f"Activations: {r.spec.activations}{kept}, batch "
                 f"{r.spec.batch} x {r.spec.seq}, {r.spec.dtype} compute.")
    floor = _get(ctx, SCALE_FLOOR)
    notes.append("I/O floor: the bytes that reached the block device in a step (read + written) over the rate the "
                 "disk moved them reading and writing at once, measured just before the run (section 4's disk "
                 "floor). Compute floor: the same width, dtype, precisions and checkpointing on the RAM tier, in "
                 f"this run, with {_floor_shape(floor)}: its median block's spans times the model's blocks, plus its "
                 "embedding and head spans times the model's vocabulary over its own, in one block before the scale "
                 "run and one after, pooled "
                 f"({_missing(ctx, SCALE_FLOOR) if floor is None else floor.steps_note + ' timed steps'}).")
    notes.append("Host peak: planned = memory_model.host's peak of one process for these settings (`streamer plan`); "
                 "run = the process's VmHWM over setup and steps; steps = over the steps alone. "
                 f"Highest RSS at a span's end in the timed steps: {r.rss_peak_at or '—'}.")
    notes.append("Where the time goes, per step: I/O = load / offload / either busy (wall time of the I/O spans); "
                 "compute = forward / backward / update spans. Fewer than 5 timed steps: each step moves the "
                 "whole store through the disk twice (stated, not hidden).")
    notes.append("CPU per step: the process's user and system CPU seconds, every thread's, and its page faults in a "
                 "timed step (getrusage; medians). The I/O threads' system time is CPU the compute does not get "
                 "where the cores are few.")
    notes.append(SHARED_NOTE)
    section = Section(title,
                      ("model", "store on disk", "timed steps", "step (median)", "tokens/s", OTHERS, "I/O floor",
                       "compute floor", "step / max(floors)", "planned host peak", "peak RSS (run)",
                       "run / planned", "peak RSS (steps)", "I/O: load / offload / busy", "compute: fwd / bwd / update",
                       "CPU: user / system / faults",
                       f"<= {size(QLORA_SCALE_RSS)}" if qlora else ">= 3B at <= 8 GiB", f"stretch: {pick.model}"),
                      (row,), tuple(notes))
    model_targets = () if qlora else (_target(f"6. stretch: {pick.model}", chosen.describe(), stretch),
                                      *_model_target(pick, r, ""))
    return Outcome(section, (_target(three_b, f"{chosen.params / 1e9:.2f}B, {size(_run_peak(r))}", met),
                             *model_targets, *floor_targets))


def memory(ctx: Context) -> Outcome:
    rows = []
    for label, r in ctx.results.items():
        if r.ok and r.spec.contender == "stream":
            baseline = BASELINE_BYTES_PER_PARAM * r.params
            parts = ", ".join(f"{k} {size(v)}" for k, v in r.ledger_peak_breakdown.items() if v)
            rows.append((label, params(r.params), size(baseline), size(r.ledger_peak_bytes),
                         ratio(_div(baseline, r.ledger_peak_bytes)), parts))
    return Outcome(Section("7. Memory: peak device memory (ledger) vs the 16 B/param baseline",
                           ("run", "params", "16 B/param", "ledger peak", "baseline / peak", "peak breakdown"),
                           tuple(rows), ("Only our runs keep a ledger; for the others see peak RSS above.",)))


HOST_TOLERANCE = 0.10  # the plan's host peak against the measured one


def host_memory(ctx: Context) -> Outcome:
    """Each run's peak RSS, the kernel's high-water mark of its process, beside the planner's host peak for ours."""
    rows, within = [], []
    for label, r in ctx.results.items():
        if not r.ok:
            rows.append((label, _missing(ctx, label), "—", "—", "—", "—"))
            continue
        value = _div(r.process_rss_peak_bytes, r.planned_host_bytes)
        ok = None if value is None else abs(value - 1) <= HOST_TOLERANCE
        if ok is not None:
            within.append(ok)
        rows.append((label, size(r.planned_host_bytes) if r.planned_host_bytes else "— (not ours: no plan)",
                     size(r.process_rss_peak_bytes), size(r.rss_peak_bytes), ratio(value), verdict(ok)))
    notes = ("planned: memory_model.host's peak of one process (`streamer plan`'s \"host RAM per process at its "
             "peak\"), for the run's settings; measured: the process's VmHWM (the kernel's high-water mark of its "
             "resident set) over the whole run, setup included, and over the timed steps alone (reset after setup). "
             "Data parallel: the highest of its processes.",
             "The bench's worker is not `streamer train`: it builds no tokenizer or data and draws no memory plot, "
             "which the plan's base (the process itself, measured on `streamer train`) holds; where that base is "
             "most of the plan (--quick's tiny models), the worker stays below it.",
             f"status: measured within {HOST_TOLERANCE:.0%} of planned.")
    section = Section("8. Host memory: planned vs measured peak RSS, per process",
                      ("run", "planned host peak", "peak RSS (run)", "peak RSS (steps)", "measured / planned",
                       f"within {HOST_TOLERANCE:.0%}"), tuple(rows), notes)
    return Outcome(section, (_target(f"host peak RSS within {HOST_TOLERANCE:.0%} of the plan, our runs",
                                     f"{sum(within)}/{len(within)}", None if not within else all(within)),))


def planner(ctx: Context) -> Outcome:
    rows, within = [], []
    for label, plan in ctx.plans.items():
        r = _get(ctx, label)
        if r is None or r.median_s is None:
            continue
        time_err = plan.step_time_s / r.median_s - 1
        peak_err = plan.peak_device_bytes / r.ledger_peak_bytes - 1
        ok = abs(time_err) <= 0.20 and abs(peak_err) <= 0.05
        tier = plan.config.step.store.tier
        if tier is not None and tier.zero_copy:
            within.append(ok)
        rows.append((label, params(plan.params), tier or "mixed", seconds(plan.step_time_s),
                     seconds(r.median_s), f"{time_err:+.0%}", size(plan.peak_device_bytes), size(r.ledger_peak_bytes),
                     f"{peak_err:+.1%}", verdict(ok)))
    met = None if len(within) < 2 else all(within)
    notes = ("memory_model.plan on device_spec('local') calibrated in this run; bar: step within 20% and peak within "
             "5%, for at least two model sizes (RAM tier).",)
    section = Section("Planner vs measured", ("run", "params", "store", "predicted step", "measured step",
                                              "step error", "predicted peak", "ledger peak", "peak error", "status"),
                      tuple(rows), notes)
    return Outcome(section, (_target("planner within 20% (time) and 5% (peak) for two sizes",
                                     f"{sum(within)}/{len(within)} RAM-tier sizes", met),))


def data_parallel(ctx: Context) -> Outcome:
    one, two = _get(ctx, DP_1), _get(ctx, DP_2)
    if one is None and two is None:
        why = _missing(ctx, DP_1)
        return Outcome(Section("Data parallel: tokens/s with 1 and 2 processes", ("run", "status"), ((DP_2, why),)))
    rows = []
    for label, r in ((DP_1, one), (DP_2, two)):
        if r is None:
            rows.append((label, _missing(ctx, label), "—", "—", "—", "—"))
            continue
        threads = r.spec.threads or "default"
        rows.append((label, f"{r.spec.world} x {threads} threads", f"{r.spec.batch} x {r.spec.seq}",
                     seconds(r.median_s), f"{r.tokens_per_s:,.0f}", size(r.rss_peak_bytes)))
    speedup = _div(two.tokens_per_s if two else None, one.tokens_per_s if one else None)
    return Outcome(Section("Data parallel: tokens/s with 1 and 2 processes (torch.distributed, gloo)",
                           ("run", "processes", "global batch", "step (median)", "tokens/s", "peak RSS per process"),
                           tuple(rows), (f"2 processes / 1 process: {ratio(speedup)} the tokens/s, same cores.",)))


def gpu(ctx: Context, device: str) -> Outcome:
    why = ("unmeasured (no GPU in this run; `make gpu-check` measures it on a CUDA machine)" if not device
           else f"unmeasured: this bench runs CPU contenders only ({device}); `make gpu-check` measures it")
    rows = tuple((name, why) for name in (
        "1. streaming overhead on the GPU", "7. ledger peak vs 16 B/param on the GPU",
        "GPT-J-6B (random init) streamed on one GPU, <= 16 GiB budget: tokens/s, TFLOP/s, MFU (target >= 400 "
        "TFLOP/s on an H100)"))
    return Outcome(Section("On a CUDA GPU", ("comparison", "result"), rows),
                   (f"GPU: GPT-J-6B streamed >= 400 TFLOP/s on an H100: {why}",))


def where_time_goes(ctx: Context) -> list[Outcome]:
    phases = [(label, r) for label, r in ctx.results.items() if r.ok and r.phases]
    rows = tuple((label, *(seconds(r.phases.get(k)) for k in ("forward", "backward", "update", "load",
                                                                "offload", "io_busy")), seconds(r.median_s))
                 for label, r in phases)
    out = [Outcome(Section("Where our step time goes (trace spans, median per step)",
                           ("run", "forward", "backward", "update", "load", "offload", "I/O busy", "step"), rows,
                           ("forward/backward/update run on the main thread; load/offload on the I/O worker, "
                            "overlapped with them.",)))]
    for label, r in ctx.results.items():
        if r.ok and r.profile:
            total = sum(p[1] for p in r.profile) or 1.0
            out.append(Outcome(Section(
                f"Profile: {label} — top operators by self CPU time (one extra step after the timed ones)",
                ("operator", "self CPU", "share of listed", "calls"),
                tuple((name, seconds(s), percent(s / total), str(calls)) for name, s, calls in r.profile))))
    return out
