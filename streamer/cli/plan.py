"""`streamer plan`: the analytic plan of one training step (and, with --dry-run, the runtime's own ledger)."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from layers import GPTJConfig
from memory_model import DEVICE_PRESETS, DeviceSpec, device_spec, format_size, plan
from streamer.cli.flags import add_config_flag, add_run_flags, declare_command, given
from streamer.cli.trace import breakdown
from streamer.console import make_console
from streamer.errors import StreamerError
from streamer.run import resolve
from streamer.runtime.calibrate import local_spec
from streamer.runtime.hardware import DtypeChoice, resolve_compute_dtype

# The step's settings, shared with `streamer train` (the same flags, run.toml keys, defaults and checks).
STEP_SETTINGS = ("model", "batch", "seq", "grad_accum", "dtype", "store", "activations", "update_on", "prefetch",
                 "update_chunk")
EXAMPLES = """\
examples:
  streamer plan --model gptj-6b --target cs2 --batch 1 --seq 2048
  streamer plan --model gptj-6b --target a100-40g --batch 8 --seq 2048 --activations checkpoint --dry-run
  streamer plan --model ./gptj-hf/config.json --target local --json
  streamer plan --config run.toml --target rtx4090    the step `streamer train --config run.toml` runs

Settings resolve as in `streamer train`: its defaults (the demo's when nothing names a model or data), then
--config, then the flags; so `streamer plan` with train's flags plans the step that train runs."""


def declare(parser: argparse.ArgumentParser) -> None:
    declare_command(parser, plan_command, "The analytic plan of one training step.", EXAMPLES)
    add_config_flag(parser)
    parser.add_argument("--target", default="cs2", help=f"the simulated device: a preset ({', '.join(DEVICE_PRESETS)}) "
                        "or local (this machine, measured once and cached in runs/) (default: cs2)")
    parser.add_argument("--ranks", type=int, default=1, help="data-parallel processes (one device each): adds the "
                        "gradient all-reduce and prints the scaling curve")
    add_run_flags(parser, only=STEP_SETTINGS, help={
        "model": "a preset or a config.json",
        "dtype": "compute dtype: auto (for local, bf16 if this CPU runs it natively and at least as fast as fp32, "
                 "else fp32; bf16 for the presets, which all run it natively), bf16 or fp32"})
    parser.add_argument("--dry-run", action="store_true",
                        help="also run the real schedule on meta tensors and report its ledger's peak")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_command(args: argparse.Namespace) -> int:
    cfg = resolve(given(args), args.config)
    model_cfg = cfg.model_config()
    choice = plan_dtype(args.target, cfg.dtype)
    dtype = choice.dtype
    device = _device(args.target, model_cfg, dtype)
    try:
        settings = replace(cfg, dtype=dtype).tree(model_cfg, args.ranks)
        plan_cfg = settings.step
        result = plan(settings.model, device, plan_cfg)
        # The scaling curve: the same global batch on 1, 2, 4, ... devices (those the batch divides into).
        counts = [n for n in (2**k for k in range(args.ranks.bit_length())) if n <= args.ranks] + [args.ranks]
        scaling = [{"devices": n, **{k: v for k, v in plan(model_cfg, device, replace(plan_cfg, devices=n)).to_json().items()
                                     if k in ("step_time_s", "tokens_per_s", "peak_device_bytes")}}
                   for n in sorted(set(counts)) if cfg.batch % (n * cfg.grad_accum) == 0]
    except ValueError as exc:
        raise StreamerError(f"cannot plan this step: {exc}") from None
    out = {**result.to_json(), "scaling": scaling, "compute_dtype_reason": choice.reason}
    if args.dry_run:
        from streamer.config import TrainerConfig
        from streamer.runtime.dryrun import dry_run
        tc = TrainerConfig(compute_dtype=dtype, activations=cfg.activations, grad_accum=cfg.grad_accum,
                           prefetch=cfg.prefetch, update_on=cfg.update_on, update_chunk=cfg.update_chunk)
        ledger = dry_run(model_cfg, tc, cfg.batch, cfg.seq)
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

