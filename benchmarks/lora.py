"""LoRA against full fine-tuning in `streamer bench`: measured on the bench model, planned at GPT-J-6B; and QLoRA
against transformers + bitsandbytes + PEFT on a Llama-family model.

The measured pair is our streamed trainer on the RAM tier, once training every weight and once training rank-8
adapters on the frozen base, run in the same ABBA blocks. The planned pair prices GPT-J-6B's step both ways
with the planner (memory_model.plan) on an H100: no run of it here. The QLoRA pair trains rank-8 adapters on a
4-bit base (nf4, double quant) both ways, in the same ABBA blocks: ours streamed on the RAM tier, and the
transformers model bitsandbytes loads 4-bit with PEFT's LoRA; beside the step time, each step's page faults and
CPU time split between user space and the kernel, where how each process's allocator treats freed buffers shows.
Ours runs twice: as `streamer` runs it, and with torch's own CPU allocator in place of its buffer cache.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from layers import ModelConfig
from memory_model import PlanConfig, device_spec, plan
from memory_model.lora import LoraConfig
from benchmarks.compare import Context, Outcome
from benchmarks.report import Section, count, params, ratio, seconds, size, verdict
from benchmarks.runs import Result
from benchmarks.worker import RunSpec
from streamer.cli.launch import MALLOC_ENV, MMAP_THRESHOLD
from streamer.config import TrainerConfig

LORA_RANK = 8
FULL = "ours streamed, RAM tier, full"
LORA = f"ours streamed, RAM tier, LoRA r={LORA_RANK}"
# The planned pair: README's GPT-J-6B step (batch 1 x 2048, bf16, checkpointed activations) on one H100.
PLANNED_MODEL, PLANNED_DEVICE = "gptj-6b", "h100-sxm"
PLANNED = PlanConfig.of(batch=1, seq=2048, compute_dtype="bf16", activations="checkpoint")
COLUMNS = ("run", "step (median)", "host peak RSS", "device peak (ledger)", "host store", "source")
# QLoRA: the pair's model is Llama-family (--model where it is Llama, else the preset of gptj-350m's size).
QLORA_MODEL, QLORA_QUICK_MODEL = "llama-350m", "llama-debug"
QLORA_OURS = f"ours streamed, RAM tier, QLoRA r={LORA_RANK} (nf4, double quant)"
QLORA_HF = f"transformers + bitsandbytes + PEFT, QLoRA r={LORA_RANK} (nf4, double quant)"
QLORA_OURS_UNCACHED = f"{QLORA_OURS}, torch's own CPU allocator"
QLORA_TARGET = 0.8  # our step at most this much of theirs
# The operators both sides' steps run alike, the same torch kernels on the same shapes: the matmuls and attention.
SHARED_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product")
QLORA_COLUMNS = ("run", "model", "step (median)", "page faults / step", "user CPU / step", "system CPU / step",
                 "peak RSS (steps)", "peak RSS (run)", "planned host peak", "run / planned", "source")


def lora_pair(full: RunSpec) -> list[RunSpec]:
    """The measured pair from our streamed RAM-tier contender's spec: as it is, and with LoRA adapters."""
    return [dataclasses.replace(full, label=FULL, lora_rank=0),
            dataclasses.replace(full, label=LORA, lora_rank=LORA_RANK)]


def store_bytes(spec: RunSpec) -> int:
    """Bytes of RAM the contender's store allocates (the pair runs on the RAM tier): its layout, which
    tests/test_lora_store.py holds equal to what a store writes."""
    tc = TrainerConfig.of(dtype=spec.dtype, store=spec.tier, moment_dtype=spec.moment_dtype,
                          lora_rank=spec.lora_rank)
    return tc.store_spec(ModelConfig.from_dict(spec.model)).host_bytes()[0]


def _result(ctx: Context, label: str) -> Result | None:
    result = ctx.results.get(label)
    return result if result is not None and result.ok else None


def _measured_row(ctx: Context, label: str) -> tuple[str, ...]:
    r = _result(ctx, label)
    if r is None:
        failed = ctx.results.get(label)
        why = f"failed: {failed.error}" if failed is not None else f"not run: {ctx.skipped.get(label, 'not asked')}"
        return (label, why, "—", "—", "—", "measured")
    return (label, seconds(r.median_s), size(r.rss_peak_bytes), size(r.ledger_peak_bytes), size(store_bytes(r.spec)),
            f"measured, {r.steps_note} steps")


def planned_rows() -> tuple[tuple[str, ...], ...]:
    """GPT-J-6B's step, full and LoRA, from the planner: device peak, host store and step time."""
    shape, device = ModelConfig.preset(PLANNED_MODEL), device_spec(PLANNED_DEVICE)
    rows = []
    for name, lora in (("full", LoraConfig()), (f"LoRA r={LORA_RANK}", LoraConfig(rank=LORA_RANK))):
        p = plan(shape, device, dataclasses.replace(PLANNED, lora=lora), limits=False)
        rows.append((f"GPT-J-6B, {name}", f"{seconds(p.step_time_s)} (planned)", "—",
                     f"{size(p.peak_device_bytes)} (planned)", f"{size(p.host_store_bytes)} (planned)",
                     f"planned on {PLANNED_DEVICE}, batch {PLANNED.batch} x {PLANNED.seq}, "
                     f"{PLANNED.precision.compute}, {PLANNED.step.activations}"))
    return tuple(rows)


def _ratio(reference: Result | None, run: Result | None, of: Callable[[Result], float | None]) -> str:
    """`of(run) / of(reference)`, or "—" where either is missing."""
    if reference is None or run is None:
        return ratio(None)
    base, value = of(reference), of(run)
    return ratio(None if not base or value is None else value / base)


def lora_versus_full(ctx: Context) -> Outcome:
    full, lora = _result(ctx, FULL), _result(ctx, LORA)
    ratios = ("LoRA / full", _ratio(full, lora, lambda r: r.median_s), _ratio(full, lora, lambda r: r.rss_peak_bytes),
              _ratio(full, lora, lambda r: r.ledger_peak_bytes), _ratio(full, lora, lambda r: store_bytes(r.spec)),
              "measured: the rows above, divided")
    rows = (_measured_row(ctx, FULL), _measured_row(ctx, LORA), ratios, *planned_rows())
    notes = (f"LoRA: rank-{LORA_RANK} adapters on q_proj and v_proj (the default targets), their AdamW state on the "
             "device; the frozen base is stored as its compute weights alone and only read.",
             "host store: what the store allocates for the run's layout (RAM slabs here); host peak RSS: the "
             "process's high-water mark over the timed steps, the store included.",
             "Planned rows are the planner's prediction, not a run.")
    return Outcome(Section("LoRA vs full fine-tuning: step time, host and device memory", COLUMNS, rows, notes))


def qlora_pair(ours: RunSpec) -> list[RunSpec]:
    """The QLoRA pair from our streamed RAM-tier spec of the pair's model: ours with a 4-bit base, and
    transformers + bitsandbytes + PEFT on the same model, batch, rank and quantization. And ours again with torch's
    own CPU allocator, without the buffer cache `streamer` installs: what the cache saves."""
    four_bit = dataclasses.replace(ours, lora_rank=LORA_RANK, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_use_double_quant=True)
    streamed = dataclasses.replace(four_bit, label=QLORA_OURS, contender="stream", tier="ram")
    return [streamed, dataclasses.replace(four_bit, label=QLORA_HF, contender="hf-qlora"),
            dataclasses.replace(streamed, label=QLORA_OURS_UNCACHED, cpu_cache=False)]


def _allocator_note(runs: dict[str, Result | None]) -> tuple[str, ...]:
    """What each run's process does with a freed buffer: its page faults and system CPU follow from it."""
    def how(r: Result) -> str:
        if r.malloc_env == MALLOC_ENV:
            threshold = (f"glibc's mmap threshold fixed at {size(MMAP_THRESHOLD)} as `streamer` fixes it "
                         f"({', '.join(f'{k}={v}' for k, v in MALLOC_ENV.items())})")
            if r.cpu_cache:
                return (f"{threshold}, and torch's CPU allocator the buffer cache `streamer` installs "
                        f"(streamer.cpu_cache): a freed buffer of {size(MMAP_THRESHOLD)} or more is kept for the next "
                        "of its size while the kept and used bytes stay within their peak")
            return (f"{threshold}, torch's own CPU allocator: every freed buffer of {size(MMAP_THRESHOLD)} or more "
                    "leaves the process, and the next is faulted in afresh")
        if not r.malloc_env:
            return "glibc's default (its threshold rises to the largest mapped block freed), torch's own allocator"
        return ", ".join(f"{k}={v}" for k, v in r.malloc_env.items()) + " from the environment"
    told = [f"{who}: {how(r)}" for who, r in runs.items() if r is not None]
    return (f"freed buffers: {'; '.join(told)}.",) if told else ()


def _shared_kernels_note(runs: dict[str, Result | None], theirs: Result | None) -> tuple[str, ...]:
    """The time each run's profiled step spent in the kernels both sides share, beside the step the target
    allows: no step is shorter than its own matmuls and attention."""
    spent = {who: sum(s for op, s, _ in r.profile if op.startswith(SHARED_KERNELS))
             for who, r in runs.items() if r is not None and r.profile}
    if not spent:
        return ()
    allowed = "" if theirs is None or theirs.median_s is None else \
        f"; {QLORA_TARGET}x their step is {seconds(QLORA_TARGET * theirs.median_s)}"
    return (f"matmuls and attention ({', '.join(SHARED_KERNELS)}...: self CPU time in one profiled step after the "
            f"timed ones): {'; '.join(f'{who} {seconds(s)}' for who, s in spent.items())}{allowed}.",)


def _divided(label: str, ours: Result | None, theirs: Result | None) -> tuple[str, ...]:
    """A row of our run's step, counters and peaks over theirs."""
    measures: tuple[Callable[[Result], float | None], ...] = (
        lambda r: r.median_s, lambda r: r.rusage.get("faults"), lambda r: r.rusage.get("user_s"),
        lambda r: r.rusage.get("system_s"), lambda r: r.rss_peak_bytes, lambda r: r.process_rss_peak_bytes)
    return (label, "", *(_ratio(theirs, ours, of) for of in measures), "", "", "measured: the rows above, divided")


def qlora_versus_hf(ctx: Context) -> Outcome:
    """Our QLoRA step on the RAM tier against transformers + bitsandbytes + PEFT's: its time, page faults and CPU
    seconds (user, system), and both peak RSS."""
    results = {label: _result(ctx, label) for label in (QLORA_OURS, QLORA_OURS_UNCACHED, QLORA_HF)}
    rows: list[tuple[str, ...]] = []
    for label, r in results.items():
        if r is None:
            failed = ctx.results.get(label)
            why = f"failed: {failed.error}" if failed is not None else f"not run: {ctx.skipped.get(label, 'not asked')}"
            rows.append((label, "—", why, "—", "—", "—", "—", "—", "—", "—", "measured"))
            continue
        shape = ModelConfig.from_dict(r.spec.model)
        planned = r.planned_host_bytes or None
        rows.append((label, f"{shape.model_type}, {params(shape.num_params())}, batch {r.spec.batch} x {r.spec.seq}, "
                     f"{r.spec.dtype} compute",
                     seconds(r.median_s), count(r.rusage.get("faults")), seconds(r.rusage.get("user_s")),
                     seconds(r.rusage.get("system_s")), size(r.rss_peak_bytes), size(r.process_rss_peak_bytes),
                     size(planned) if planned else "— (not ours: no plan)",
                     ratio(None if planned is None else r.process_rss_peak_bytes / planned),
                     f"measured, {r.steps_note} steps"))
    ours, uncached, theirs = results[QLORA_OURS], results[QLORA_OURS_UNCACHED], results[QLORA_HF]
    value = None if ours is None or theirs is None or not theirs.median_s or ours.median_s is None \
        else ours.median_s / theirs.median_s
    rss = _ratio(theirs, ours, lambda r: r.rss_peak_bytes)
    rows += [_divided(label, mine, theirs) for label, mine in (("ours / theirs", ours),
                                                                ("ours, torch's allocator / theirs", uncached))]
    met = None if value is None else value <= QLORA_TARGET
    named = {"ours": ours, "ours, torch's allocator": uncached, "transformers + bitsandbytes + PEFT": theirs}
    target = (f"QLoRA: our RAM-tier step <= {QLORA_TARGET}x transformers + bitsandbytes + PEFT's: {verdict(met)} "
              f"({ratio(value)}; peak RSS {rss})")
    notes = (f"Both: rank-{LORA_RANK} adapters on the default targets (PEFT's q_proj and v_proj), the base 4-bit as "
             "bitsandbytes quantizes it (nf4, double quant, blocks of 64), the same batch, compute dtype and random "
             "tokens; AdamW on the adapters.",
             "peak RSS: the process's high-water mark (VmHWM) over the timed steps, and over the whole run, setup "
             "included; planned host peak: memory_model.host's peak of one process for our run's settings "
             "(`streamer plan`'s \"host RAM per process at its peak\").",
             "page faults / step: the process's minor and major page faults in one timed step; user and system CPU / "
             "step: the CPU seconds its threads spent in user space and in the kernel in that step (getrusage; "
             "medians).",
             *_allocator_note(named),
             *_shared_kernels_note(named, theirs))
    return Outcome(Section("QLoRA vs transformers + bitsandbytes + PEFT: step time and host memory", QLORA_COLUMNS,
                           tuple(rows), notes), (target,))
