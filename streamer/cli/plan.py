"""`streamer plan`: the analytic plan of one training step (and, with --dry-run, the runtime's own ledger)."""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.table import Table

from layers import PRESETS, GPTJConfig
from memory_model import DeviceSpec, Plan, PlanConfig, device_spec, format_size, plan
from memory_model.baselines import Baseline, baselines
from streamer.cli.devices import apply_sets
from streamer.cli.trace import breakdown
from streamer.cli.whatif import compare, sweep
from streamer.console import make_console
from streamer.errors import StreamerError
from streamer.runtime.calibrate import local_spec
from streamer.runtime.hardware import DtypeChoice, resolve_compute_dtype


# What the scaling curve means (printed with it): Cerebras' 16 CS-3 = 15.3x is measured the same way.
SCALING_ASSUMPTION = ("weak scaling: each device keeps its own micro-batches, so n devices train an n times "
                      "larger global batch; efficiency = tokens/s on n / (n x tokens/s on 1)")


def plan_command(args: argparse.Namespace) -> int:
    if args.compare:
        return _print_compare(compare(args.compare, args.set), args.json)
    if args.sweep:
        began = time.perf_counter()
        table, png, points = sweep(args.model, args.activations, args.sweep)
        print(f"{points} points in {time.perf_counter() - began:.1f} s: {table}, {png}")
        return 0
    model_cfg = PRESETS[args.model] if args.model in PRESETS else GPTJConfig.from_hf(args.model)
    choice = plan_dtype(args.target, args.dtype)
    dtype = choice.dtype
    device = apply_sets(_device(args.target, model_cfg, dtype), args.set)
    try:
        plan_cfg = PlanConfig(batch=args.batch, seq=args.seq, activations=args.activations, compute_dtype=dtype,
                              prefetch=args.prefetch, update_on=args.update_on or device.update_on,
                              grad_accum=args.grad_accum, update_chunk=args.update_chunk, store=args.store,
                              devices=args.ranks, moment_dtype=args.moment_dtype, update_overlap=args.update_overlap)
        result = plan(model_cfg, device, plan_cfg)
        scaling = _scaling(model_cfg, device, plan_cfg)
    except ValueError as exc:
        raise StreamerError(f"cannot plan this step: {exc}") from None
    others = baselines(model_cfg, args.ranks, plan_cfg.dtype_bytes)
    out = {**result.to_json(), "scaling": scaling, "scaling_assumption": SCALING_ASSUMPTION,
           "compute_dtype_reason": choice.reason, "alternatives": [asdict(b) for b in others]}
    if args.dry_run:
        from streamer.config import TrainerConfig
        from streamer.runtime.dryrun import dry_run
        tc = TrainerConfig(compute_dtype=dtype, activations=args.activations, grad_accum=args.grad_accum,
                           prefetch=args.prefetch, update_on=plan_cfg.update_on, update_chunk=args.update_chunk)
        ledger = dry_run(model_cfg, tc, args.batch, args.seq)
        out["dry_run_peak_device_bytes"] = ledger.peak
        out["dry_run_peak_breakdown"] = dict(ledger.peak_breakdown)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    console = make_console()
    console.print(choice.reason, markup=False, highlight=False)
    console.print(result.table())
    console.print(_alternatives(result, others))
    if args.dry_run:
        measured = out["dry_run_peak_device_bytes"]
        console.print(f"dry run (the runtime's schedule and ledger on meta tensors): peak {format_size(measured)} "
                      f"({breakdown(out['dry_run_peak_breakdown'])}); analytic "
                      f"{format_size(result.peak_device_bytes)} ({breakdown(result.peak_breakdown)})")
    if args.ranks > 1:
        console.print(f"data-parallel scaling ({SCALING_ASSUMPTION}; reduce: {device.reduce}): " + "; ".join(
            f"{row['devices']} -> {row['tokens_per_s']:,.0f} tokens/s ({row['efficiency']:.1%} of linear)"
            for row in scaling))
    for note in device.notes:
        console.print(f"[dim]note: {note}[/]")
    return 0


def _scaling(shape: GPTJConfig, device: DeviceSpec, cfg: PlanConfig) -> list[dict[str, float]]:
    """Tokens/s on 1, 2, 4, ... up to cfg.devices devices, each with cfg's micro-batches (SCALING_ASSUMPTION)."""
    per_device = cfg.batch // cfg.devices
    counts = sorted({n for n in (2**k for k in range(cfg.devices.bit_length())) if n <= cfg.devices} | {cfg.devices})
    rows = [(n, plan(shape, device, replace(cfg, devices=n, batch=per_device * n))) for n in counts]
    one = rows[0][1].tokens_per_s
    return [{"devices": n, "step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s,
             "efficiency": p.tokens_per_s / (n * one)} for n, p in rows]


def _alternatives(result: Plan, others: list[Baseline]) -> Table:
    table = Table(title=f"model-state memory of the alternatives, same model ({result.params:,} params), "
                        "activations extra in every row")
    for name in ("scheme", "device", "host RAM", "NVMe", "formula", "source"):
        table.add_column(name, justify="right" if name in ("device", "host RAM", "NVMe") else "left")
    table.add_row("weight streaming (this plan's peak)", format_size(result.peak_device_bytes),
                  format_size(result.host_store_bytes * result.host_stores), "-", "planned", "memory_model.plan")
    for b in others:
        table.add_row(b.name, format_size(b.device_bytes), format_size(b.host_bytes) if b.host_bytes else "-",
                      format_size(b.nvme_bytes) if b.nvme_bytes else "-", b.formula, b.source)
    return table


def _print_compare(out: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['run']}: step {out['predicted_step_s']:.4g} s predicted, {out['measured_step_s']:.4g} s measured "
          f"({out['step_error']:+.1%}); device peak {format_size(out['predicted_peak_bytes'])} predicted, "
          f"{format_size(out['measured_peak_bytes'])} measured ({out['peak_error']:+.2%})")
    return 0


def plan_dtype(target: str, requested: str) -> DtypeChoice:
    """--dtype for a plan: this CPU's choice for the local target; the presets' GPUs and wafer all run bf16
    natively, so auto is bf16 for them."""
    if target == "local":
        return resolve_compute_dtype("cpu", requested)
    if requested == "auto":
        return DtypeChoice("bf16", f"compute dtype bf16: {target} runs bf16 natively")
    return DtypeChoice(requested, f"compute dtype {requested} (--dtype {requested})")


def _device(name: str, shape: GPTJConfig, dtype: str) -> DeviceSpec:
    try:
        if name == "local":
            return local_spec(Path("runs"), shape, dtype)
        return device_spec(name)
    except ValueError as exc:
        raise StreamerError(str(exc)) from None

