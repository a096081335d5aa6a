"""`streamer plan`: the analytic plan of one training step (and, with --dry-run, the runtime's own ledger)."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from layers import PRESETS, GPTJConfig
from memory_model import DeviceSpec, PlanConfig, device_spec, format_size, plan
from memory_model.lora import LoraConfig
from streamer.cli.trace import breakdown
from streamer.console import make_console
from streamer.errors import StreamerError
from streamer.runtime.calibrate import local_spec
from streamer.runtime.hardware import DtypeChoice, resolve_compute_dtype


def plan_command(args: argparse.Namespace) -> int:
    model_cfg = PRESETS[args.model] if args.model in PRESETS else GPTJConfig.from_hf(args.model)
    choice = plan_dtype(args.target, args.dtype)
    dtype = choice.dtype
    device = _device(args.target, model_cfg, dtype)
    try:
        lora = LoraConfig(rank=args.lora_rank, targets=args.lora_targets)
        plan_cfg = PlanConfig(batch=args.batch, seq=args.seq, activations=args.activations, compute_dtype=dtype,
                              prefetch=args.prefetch, update_on=args.update_on, grad_accum=args.grad_accum,
                              update_chunk=args.update_chunk, store=args.store, devices=args.ranks, lora=lora)
        result = plan(model_cfg, device, plan_cfg)
        # The scaling curve: the same global batch on 1, 2, 4, ... devices (those the batch divides into).
        counts = [n for n in (2**k for k in range(args.ranks.bit_length())) if n <= args.ranks] + [args.ranks]
        scaling = [{"devices": n, **{k: v for k, v in plan(model_cfg, device, replace(plan_cfg, devices=n)).to_json().items()
                                     if k in ("step_time_s", "tokens_per_s", "peak_device_bytes")}}
                   for n in sorted(set(counts)) if args.batch % (n * args.grad_accum) == 0]
    except ValueError as exc:
        raise StreamerError(f"cannot plan this step: {exc}") from None
    out = {**result.to_json(), "scaling": scaling, "compute_dtype_reason": choice.reason}
    if args.dry_run:
        from streamer.config import TrainerConfig
        from streamer.runtime.dryrun import dry_run
        tc = TrainerConfig(compute_dtype=dtype, activations=args.activations, grad_accum=args.grad_accum,
                           prefetch=args.prefetch, update_on=args.update_on, update_chunk=args.update_chunk,
                           lora_rank=args.lora_rank, lora_targets=args.lora_targets)
        ledger = dry_run(model_cfg, tc, args.batch, args.seq)
        out["dry_run_peak_device_bytes"] = ledger.peak
        out["dry_run_peak_breakdown"] = dict(ledger.peak_breakdown)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    console = make_console()
    console.print(choice.reason, markup=False, highlight=False)
    console.print(result.table())
    if args.dry_run:
        measured = out["dry_run_peak_device_bytes"]
        console.print(f"dry run (the runtime's schedule and ledger on meta tensors): peak {format_size(measured)} "
                      f"({breakdown(out['dry_run_peak_breakdown'])}); analytic "
                      f"{format_size(result.peak_device_bytes)} ({breakdown(result.peak_breakdown)})")
    if args.ranks > 1:
        console.print("data-parallel scaling (same global batch): " + "; ".join(
            f"{row['devices']} -> {row['tokens_per_s']:,.0f} tokens/s, {row['step_time_s']:.2f} s/step"
            for row in scaling))
    for note in device.notes:
        console.print(f"[dim]note: {note}[/]")
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

