"""LoRA against full fine-tuning in `streamer bench`: measured on the bench model, planned at GPT-J-6B.

The measured pair is our streamed trainer on the RAM tier, once training every weight and once training rank-8
adapters on the frozen base, run in the same ABBA blocks. The planned pair prices GPT-J-6B's step both ways
with the planner (memory_model.plan) on an H100: no run of it here.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from layers import ModelConfig
from memory_model import PlanConfig, device_spec, plan
from memory_model.lora import LoraConfig
from benchmarks.compare import Context, Outcome
from benchmarks.report import Section, ratio, seconds, size
from benchmarks.runs import Result
from benchmarks.worker import RunSpec
from streamer.config import TrainerConfig

LORA_RANK = 8
FULL = "ours streamed, RAM tier, full"
LORA = f"ours streamed, RAM tier, LoRA r={LORA_RANK}"
# The planned pair: README's GPT-J-6B step (batch 1 x 2048, bf16, checkpointed activations) on one H100.
PLANNED_MODEL, PLANNED_DEVICE = "gptj-6b", "h100-sxm"
PLANNED = PlanConfig.of(batch=1, seq=2048, compute_dtype="bf16", activations="checkpoint")
COLUMNS = ("run", "step (median)", "host peak RSS", "device peak (ledger)", "host store", "source")


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


def _ratio(full: Result | None, lora: Result | None, of: Callable[[Result], float | None]) -> str:
    if full is None or lora is None:
        return ratio(None)
    base, value = of(full), of(lora)
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
