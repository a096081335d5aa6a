"""`streamer plan | generate | export | trace`, and the memory summary lines `train` prints too."""
from __future__ import annotations

import argparse
from dataclasses import replace
import json
import time
from pathlib import Path
from typing import Any

import torch

from layers import PRESETS, GPTJConfig
from memory_model import (
    CATEGORIES, DeviceSpec, PlanConfig, Trace, device_spec, format_size, parse_size, plan,
)
from streamer.errors import StreamerError
from streamer.generate import Sampling, complete
from streamer.runtime.calibrate import local_spec
from streamer.runtime.hardware import DtypeChoice, resolve_compute_dtype
from streamer.store.layout import dtype_name
from streamer.run import RunConfig, RunDir, RunError
from streamer.io.tokenizer import Tokenizer, load_tokenizer
from streamer.trainer import StreamingTrainer
from streamer.console import make_console

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --- plan ------------------------------------------------------------------------------------------------------
def plan_command(args: argparse.Namespace) -> int:
    model_cfg = PRESETS[args.model] if args.model in PRESETS else GPTJConfig.from_hf(args.model)
    choice = plan_dtype(args.target, args.dtype)
    dtype = choice.dtype
    device = _device(args.target, model_cfg, dtype)
    try:
        plan_cfg = PlanConfig(batch=args.batch, seq=args.seq, activations=args.activations, compute_dtype=dtype,
                              prefetch=args.prefetch, update_on=args.update_on, grad_accum=args.grad_accum,
                              update_chunk=args.update_chunk, store=args.store, devices=args.ranks)
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
                           prefetch=args.prefetch, update_on=args.update_on, update_chunk=args.update_chunk)
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
                      f"({_breakdown(out['dry_run_peak_breakdown'])}); analytic "
                      f"{format_size(result.peak_device_bytes)} ({_breakdown(result.peak_breakdown)})")
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


# --- generate -------------------------------------------------------------------------------------------------
def generate_command(args: argparse.Namespace) -> int:
    run = RunDir.open(args.run)
    overrides: dict[str, Any] = {}
    if args.device is not None:
        overrides["device"] = args.device
    if args.budget is not None:
        overrides["budget"] = RunConfig(budget=args.budget).budget_bytes()
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                        use_cache=not args.no_cache)
    tokenizer = load_tokenizer(run.tokenizer)
    console = make_console()
    with open_trainer(run, overrides) as trainer:
        # The run's recorded dtype (its store holds compute weights in it); say so where it is emulated.
        dtype = resolve_compute_dtype(trainer.tc.device, dtype_name(trainer.tc.compute_dtype))
        if dtype.emulated:
            console.print(dtype.reason, markup=False, highlight=False)
        begin = time.perf_counter()
        text = complete(trainer, tokenizer, args.prompt, sampling)
        elapsed = time.perf_counter() - begin
        console.print(args.prompt, style="dim", end="", markup=False, highlight=False)
        console.print(text, markup=False, highlight=False)
        budget = trainer.tc.budget_bytes
        console.print(f"[dim]{len(tokenizer.encode(text))} tokens in {elapsed:.1f} s, every layer streamed per "
                      f"token; device peak {format_size(trainer.ledger.peak)} of "
                      f"{format_size(budget) if budget else 'no'} budget, model {trainer.cfg.num_params():,} params[/]")
    return 0


def open_trainer(run: RunDir, overrides: dict[str, Any] | None = None) -> StreamingTrainer:
    """The run's trainer at its last committed step; `overrides` replace trainer settings (device, budget)."""
    saved = run.read_config().trainer_config().to_dict()
    return StreamingTrainer.open(run.store_to_read(), overrides={**saved, **(overrides or {})})


# --- export ---------------------------------------------------------------------------------------------------
def export_command(args: argparse.Namespace) -> int:
    run = RunDir.open(args.run)
    tokenizer = load_tokenizer(run.tokenizer)
    with open_trainer(run, {"device": "cpu", "budget": None}) as trainer:
        begin = time.perf_counter()
        export_hf(trainer, tokenizer, args.hf_dir, EXPORT_DTYPES[args.dtype], parse_size(args.max_shard_size),
                  overwrite=args.overwrite)
        step = trainer.step_count
    files = sorted(p.name for p in Path(args.hf_dir).iterdir())
    make_console().print(
        f"exported step {step} of {run.root} to {args.hf_dir} in {time.perf_counter() - begin:.1f} s: "
        f"{', '.join(files)}\nload it with transformers.GPTJForCausalLM.from_pretrained({args.hf_dir!r})",
        markup=False, highlight=False)
    return 0


def export_hf(trainer: StreamingTrainer, tokenizer: Tokenizer | None, hf_dir: str | Path,
              dtype: torch.dtype = torch.float32, max_shard_bytes: int = 2 * 2**30, overwrite: bool = False) -> None:
    """Write the trainer's master weights as a Hugging Face GPT-J folder, one unit in memory at a time."""
    from streamer.io.hf import HFExporter
    if max_shard_bytes <= 0:
        raise RunError("--max-shard-size must be more than 0 bytes")
    with HFExporter(hf_dir, trainer.cfg, dtype, max_shard_bytes, overwrite) as exporter:
        for unit in trainer.units:
            flat = trainer.unit_master(unit)
            for slot in trainer.layouts[unit].slots:
                exporter.add(slot.hf_key, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
        if tokenizer is not None:
            tokenizer.save(exporter.staging_dir)


# --- trace ----------------------------------------------------------------------------------------------------
def step_ranges(steps: list[int]) -> str:
    """Sorted step numbers as runs of consecutive ones: [10, 20, 29, 30, 31] -> '10, 20, 29..31'."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def trace_command(args: argparse.Namespace) -> int:
    source = Path(args.run)
    path = source if source.is_file() else RunDir.open(source).trace_json
    if not path.is_file():
        raise RunError(f"{source} has no trace.json yet (it is written when `streamer train` finishes steps); "
                       "train it first")
    try:
        trace = Trace.from_json(path)
    except (ValueError, KeyError, TypeError) as exc:
        raise RunError(f"{path} is not a weight-streaming trace ({exc}); pass a run directory or its trace.json") \
            from None
    steps = trace.steps()
    if not steps:
        raise RunError(f"{path} records no training step; train the run first")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise RunError(f"--step {step} is not in the trace; it holds steps {step_ranges(steps)} (the last "
                       "--trace-steps, default 8, and every --trace-every-th); to keep others, train with "
                       "--trace-every N or a larger --trace-steps")
    summary = trace.summary(step)
    out = Path(args.out) if args.out else path.with_name("memory.png")
    trace.plot(out, step=step)
    if args.chrome:
        trace.to_chrome(args.chrome)
    if args.json:
        print(json.dumps({"step": step, "plot": str(out), **summary, "meta": trace.meta}, indent=2, default=str))
        return 0
    console = make_console()
    console.print(trace.table(step=step))
    for line in memory_lines(summary, trace.meta):
        console.print(line)
    console.print(f"plot: {out}" + (f"; Chrome trace: {args.chrome}" if args.chrome else ""))
    return 0


def memory_lines(summary: dict[str, Any], meta: dict[str, Any], planned: int | None = None) -> list[str]:
    """The measured device peak against the budget, the planner and the 16 B/param baseline."""
    peak = summary["peak_bytes"]
    budget = meta.get("budget")
    lines = [f"device peak {format_size(peak)} ({_breakdown(summary['peak_breakdown'])})"
             + (f" within a {format_size(budget)} budget" if budget else "")
             + (f"; the planner predicts {format_size(planned)}" if planned is not None else "")]
    if meta.get("params") and meta.get("baseline_bytes") and peak:
        baseline = meta["baseline_bytes"]
        lines.append(f"16 B/param baseline (all training state on the device): {meta['params']:,} params -> "
                     f"{format_size(baseline)}, {baseline / peak:.1f}x the streamed peak")
    lines.append(f"host RSS peak {format_size(summary['host_rss_peak_bytes'])}")
    return lines


def _breakdown(parts: dict[str, int]) -> str:
    return ", ".join(f"{c} {format_size(parts.get(c, 0))}" for c in CATEGORIES)
