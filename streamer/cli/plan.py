"""`streamer plan`: the analytic plan of one training step (and, with --dry-run, the runtime's own ledger)."""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from rich.table import Table

from layers import ModelConfig
from memory_model import DEVICE_PRESETS, DeviceSpec, Ledger, Plan, PlanConfig, device_spec, format_size, plan
from memory_model.baselines import Baseline, baselines
from memory_model.devices import with_sets
from memory_model.lora import LoraConfig, check_targets
from memory_model.planner import clipped_schedule, clipped_steps, fewest_expert_groups
from memory_model.rollout import RolloutPlan, rollout_plan
from memory_model.scaling import SCALING_ASSUMPTION, scaling_curve
from streamer.cli.flags import add_config_flag, add_run_flags, declare_command, given
from streamer.cli.trace import breakdown
from streamer.cli.whatif import add_flags, compare, sweep
from streamer.console import make_console
from streamer.errors import StreamerError
from streamer.resources import store_size
from streamer.run import SettingError, read_toml, resolve, store_choice
from streamer.calibration.calibrate import local_spec
from streamer.calibration.dryrun import dry_run, dry_run_generation
from streamer.runtime.hardware import DtypeChoice, resolve_compute_dtype

# The step's settings, shared with `streamer train` (the same flags, run.toml keys, defaults and checks).
STEP_SETTINGS = ("model", "batch", "seq", "grad_accum", "dtype", "store", "activations", "update_on", "prefetch",
                 "update_chunk", "moment_dtype", "master_dtype", "update_timing", "clipped_steps", "data_parallel",
                 "expert_group_size", "lora_rank", "lora_targets", "load_in_4bit", "bnb_4bit_quant_type",
                 "bnb_4bit_use_double_quant", "load_in_8bit", "set", "pack", "method", "beta", "num_generations",
                 "max_completion_length", "num_iterations")
EXAMPLES = """\
examples:
  streamer plan --model gptj-6b --target cs2 --batch 1 --seq 2048
  streamer plan --model gptj-6b --target a100-40g --batch 8 --seq 2048 --activations checkpoint --dry-run
  streamer plan --model gptj-6b --target h100-sxm --batch 64 --seq 2048 --activations offload
  streamer plan --model ./gptj-hf/config.json --target local --json
  streamer plan --model mixtral-8x7b --target h100-sxm --batch 1 --activations checkpoint --set memory_bytes=5e9
  streamer plan --config run.toml --target rtx4090    the step `streamer train --config run.toml` runs

Settings resolve as in `streamer train`: its defaults (the demo's when nothing names a model or data), then
--config, then the flags; so `streamer plan` with train's flags plans the step that train runs."""

_STEP_HELP = {f.name: f.metadata.get("help") for f in fields(PlanConfig)}


def declare(parser: argparse.ArgumentParser) -> None:
    declare_command(parser, plan_command, "The analytic plan of one training step.", EXAMPLES)
    add_config_flag(parser)
    parser.add_argument("--target", default="cs2", help=f"the simulated device: a preset ({', '.join(DEVICE_PRESETS)}) "
                        "or local (this machine, measured once and cached in runs/) (default: cs2)")
    parser.add_argument("--ranks", type=int, default=1, help="data-parallel processes (one device each): adds the "
                        "gradient all-reduce and prints the scaling curve")
    parser.add_argument("--ranks-per-node", type=int, default=PlanConfig.ranks_per_node, metavar="N",
                        help=f"{_STEP_HELP['ranks_per_node']}; the network's speed is the target's "
                             "inter_node_bytes_per_s (--set it)")
    add_run_flags(parser, only=STEP_SETTINGS, help={
        "model": "a preset or a config.json",
        "dtype": "compute dtype: auto (for local, bf16 if this CPU runs it natively and at least as fast as fp32, "
                 "else fp32; bf16 for the presets, v100's being its fp16 tensor rate), bf16 or fp32",
        "set": "replace one figure of --target (repeatable; `streamer devices` lists the fields); with "
               "--compare, on top of the run's own",
        "update_on": "run AdamW on the device (streamed state) or on the host (default: the target's place: host "
                     "for cs2 and cs3, whose MemoryX runs the update; device for the GPUs and local)"})
    add_flags(parser)
    parser.add_argument("--dry-run", action="store_true",
                        help="also run the real schedule on meta tensors and report its ledger's peak")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_command(args: argparse.Namespace) -> int:
    if args.compare:
        return _print_compare(compare(args.compare, given(args).get("set", ())), args.json)
    explicit = given(args)
    cfg = resolve(explicit, args.config)
    if args.sweep:
        began = time.perf_counter()
        table, png, points = sweep(cfg.model, cfg.trainer.step.activations, args.sweep)
        print(f"{points} points in {time.perf_counter() - began:.1f} s: {table}, {png}")
        return 0
    model_cfg = cfg.model_config()
    choice = plan_dtype(args.target, cfg.trainer.step.precision.compute)
    dtype = choice.dtype
    device = with_sets(_device(args.target, model_cfg, dtype), cfg.trainer.device.set, SettingError)
    # Unless named, the update runs where the target runs it (MemoryX updates cs2's and cs3's weights): set before
    # the step is checked, which refuses an overlapped update on the device.
    named = set(explicit) | (set(read_toml(args.config)) if args.config else set())
    update_on = cfg.trainer.step.update_on if "update_on" in named else device.update_on
    try:
        plan_cfg = replace(cfg.replace(dtype=dtype, update_on=update_on).plan_config(args.ranks),
                           ranks_per_node=args.ranks_per_node)
        # The groups `streamer train` would choose for a --budget of this device's room (one search, one measure).
        clips = cfg.trainer.optimizer.max_grad_norm > 0
        plan_cfg = plan_cfg.replace(expert_group_size=fewest_expert_groups(model_cfg, device, plan_cfg, clips))
        result = plan(model_cfg, device, plan_cfg)
        scaling = None if result.does_not_fit else scaling_curve(model_cfg, device, plan_cfg)
        rollout = rollout_plan(model_cfg, device, plan_cfg) if plan_cfg.objective.grpo else None
        # A quantized base is planned beside the same step on its 16-bit base (LoRA as before); an 8-bit one
        # beside QLoRA's 4-bit base too (nf4, double quant).
        check_targets(model_cfg, plan_cfg.lora)
        sixteen = plan(model_cfg, device, plan_cfg.replace(lora=replace(plan_cfg.lora, load_in_4bit=False,
                                                                        load_in_8bit=False, gguf=None)),
                       limits=False) if plan_cfg.lora.quantized else None
        four = plan(model_cfg, device, plan_cfg.replace(lora=replace(
            plan_cfg.lora, load_in_8bit=False, load_in_4bit=True, bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True)), limits=False) if plan_cfg.lora.load_in_8bit else None
    except ValueError as exc:
        raise StreamerError(f"cannot plan this step: {exc}") from None
    store = f"{store_choice(cfg, explicit, args.config)}, on {device.name}'s host"
    store_ram, store_disk = store_size(model_cfg, cfg.trainer.replace(dtype=dtype), args.ranks)
    others = baselines(model_cfg, args.ranks, plan_cfg.dtype_bytes)
    out = {**result.to_json(), "scaling": scaling, "scaling_assumption": SCALING_ASSUMPTION,
           "compute_dtype_reason": choice.reason, "store_reason": store, "store_ram_bytes": store_ram,
           "store_disk_bytes": store_disk, "alternatives": [asdict(b) for b in others],
           **({} if rollout is None else {"rollout": {**asdict(rollout), "total_s": rollout.total_s}})}
    if sixteen is not None:
        out["base_16bit"] = {**_base_figures(sixteen), "does_not_fit": sixteen.does_not_fit,
                             "link_ratio": _link(result) / _link(sixteen)}
    if four is not None:
        out["base_4bit"] = {**_base_figures(four), "does_not_fit": four.does_not_fit}
    clipping = plan_cfg.fused and cfg.trainer.optimizer.max_grad_norm > 0
    if clipping:
        try:
            schedules = clipped_steps(model_cfg, device, plan_cfg)
        except ValueError as exc:
            raise StreamerError(f"cannot plan this step: {exc}") from None
        chosen = clipped_schedule(schedules, plan_cfg.step.clipped_steps)
        out["clipped_steps"] = {name: asdict(p) for name, p in schedules.items()}
        out["clipped_schedule"] = chosen.schedule
    if args.dry_run:
        tc = cfg.trainer.replace(dtype=dtype, update_on=plan_cfg.step.update_on, budget=None,  # the ledger's own peak
                                 expert_group_size=plan_cfg.step.expert_group_size)  # as planned
        ledger = dry_run(model_cfg, tc, plan_cfg.batch, cfg.seq, packed=plan_cfg.packed)  # rows
        out["dry_run_peak_device_bytes"] = ledger.peak
        out["dry_run_peak_breakdown"] = dict(ledger.peak_breakdown)
        if clipping:  # a step that clips, on the schedule the plan chose for it
            clipped = dry_run(model_cfg, tc.replace(clipped_steps=chosen.schedule), plan_cfg.batch, cfg.seq,
                              packed=plan_cfg.packed, clipped=True)
            out["dry_run_clipped_peak_device_bytes"] = clipped.peak
        if rollout is not None:  # a prompt's generation, each way of decoding
            out["dry_run_generation"] = {way: _ledger_figures(dry_run_generation(
                model_cfg, tc, plan_cfg.objective.num_generations, rollout.prompt_tokens, way == "resident"))
                for way in ("streamed", "resident")}
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    console = make_console()
    console.print(choice.reason, markup=False, highlight=False)
    console.print(store, markup=False, highlight=False)
    precision = cfg.trainer.step.precision
    console.print(f"host store per process: {format_size(store_ram)} of RAM, {format_size(store_disk)} of disk "
                  f"(--master-dtype {precision.master} --moment-dtype {precision.moments}; at its largest, "
                  f"while a step commits)",
                  markup=False, highlight=False)
    host = result.host_peak
    console.print(f"host RAM per process at its peak: {format_size(host.total)} ({host.describe()})",
                  markup=False, highlight=False)
    console.print(result.table())
    line = _method_line(cfg.batch, plan_cfg, result, rollout)
    if line is not None:
        console.print(line, markup=False, highlight=False)
    if clipping:
        console.print(_clipped_line(out["clipped_steps"], chosen.schedule, plan_cfg.step.clipped_steps, result.params),
                      markup=False, highlight=False)
    console.print(_alternatives(result, others, store_disk))
    if sixteen is not None:
        console.print(_beside_16bit(result, sixteen, four))
    if args.dry_run:
        measured = out["dry_run_peak_device_bytes"]
        console.print(f"dry run (the runtime's schedule and ledger on meta tensors): peak {format_size(measured)} "
                      f"({breakdown(out['dry_run_peak_breakdown'])}); analytic "
                      f"{format_size(result.peak_device_bytes)} ({breakdown(result.peak_breakdown)})")
        if clipping:
            console.print(f"dry run of a step that clips ({chosen.schedule}): peak "
                          f"{format_size(out['dry_run_clipped_peak_device_bytes'])}; analytic "
                          f"{format_size(chosen.peak_bytes)}", markup=False, highlight=False)
        if rollout is not None:
            dry = out["dry_run_generation"]
            console.print("dry run of a prompt's generation: " + "; ".join(
                f"{way} peak {format_size(dry[way]['peak_device_bytes'])}, analytic {format_size(planned.peak_bytes)}"
                for way, planned in (("streamed", rollout.streamed), ("resident", rollout.resident))),
                markup=False, highlight=False)
    if scaling is not None and args.ranks > 1:
        machines = f", hierarchical over {plan_cfg.nodes} machines" if plan_cfg.nodes > 1 and device.reduce == "ring" \
            else ""
        console.print(f"data-parallel scaling ({SCALING_ASSUMPTION}; reduce: {device.reduce}{machines}): " + "; ".join(
            f"{row['devices']} -> {row['tokens_per_s']:,.0f} tokens/s ({row['devices'] * row['efficiency']:.2f}x one, "
            f"{row['efficiency']:.1%} of linear)"
            for row in scaling))
    for note in device.notes:
        console.print(f"[dim]note: {note}[/]")
    return 0


def _ledger_figures(ledger: Ledger) -> dict[str, Any]:
    return {"peak_device_bytes": ledger.peak, "peak_breakdown": dict(ledger.peak_breakdown)}


def _method_line(batch: int, cfg: PlanConfig, result: Plan, rollout: RolloutPlan | None) -> str | None:
    """What a DPO step or a GRPO step and its rollout take, for --method dpo or grpo."""
    if cfg.objective.preference:
        return f"a DPO step ({batch} pairs, {2 * batch} rows): {result.step_time_s:.3g} s"
    if rollout is None:
        return None
    objective, resident, streamed = cfg.objective, rollout.resident, rollout.streamed
    kept = "the units resident" if rollout.chose_resident else "every unit streamed in each decode pass"
    return (f"a GRPO rollout ({batch // objective.num_generations} prompts of up to {rollout.prompt_tokens} tokens "
            f"x {objective.num_generations} completions of {objective.max_completion_length} tokens, {kept}): "
            f"{rollout.total_s:.3g} s (prefill {rollout.prefill_s:.3g} s, decode {rollout.decode_s:.3g} s, scoring "
            f"{rollout.scoring_s:.3g} s); then its step {result.step_time_s:.3g} s. Decoding with the units resident: "
            f"{resident.decode_s:.3g} s, device peak {format_size(resident.peak_bytes)} "
            f"({breakdown(resident.peak_breakdown)}); streamed in each pass: {streamed.decode_s:.3g} s, peak "
            f"{format_size(streamed.peak_bytes)}; a prompt's KV cache is {format_size(rollout.kv_cache_bytes)}. "
            f"Resident where its peak fits the device."
            + ("" if rollout.does_not_fit is None else f" The rollout does NOT fit: {rollout.does_not_fit}"))


def _clipped_line(schedules: dict[str, dict[str, Any]], chosen: str, setting: str, params: int) -> str:
    """How a fused step that clips (--max-grad-norm) is made, and what each schedule costs."""
    def cost(p: dict[str, Any]) -> str:
        disk = (f", disk read {p['disk_read_bytes'] / params:.2f} and written {p['disk_write_bytes'] / params:.2f} "
                "B/param" if p["disk_write_bytes"] else "")
        return f"{p['step_s']:.3g} s{disk}, peak {format_size(p['peak_bytes'])}"
    why = "as --clipped-steps names" if setting == chosen else "the faster planned (--clipped-steps auto)"
    others = "; ".join(f"{name}: {cost(p)}" for name, p in schedules.items() if name != chosen)
    return (f"a step that clips (--max-grad-norm) is made {chosen}, {why}: {cost(schedules[chosen])}"
            + (f" (else {others})" if others else ""))


def _alternatives(result: Plan, others: list[Baseline], store_disk: int) -> Table:
    """Our row holds what the plan holds at its peak: every process's host RAM on one host (the RAM tier's store
    included) and the store's files on disk, beside each scheme's model states."""
    table = Table(title=f"model-state memory of the alternatives, same model ({result.params:,} params), "
                        "activations extra in every row")
    for name in ("scheme", "device", "host RAM", "NVMe", "formula", "source"):
        table.add_column(name, justify="right" if name in ("device", "host RAM", "NVMe") else "left")
    table.add_row("weight streaming (this plan's peak)", format_size(result.peak_device_bytes),
                  format_size(result.host_peak.total * result.host_stores),
                  format_size(store_disk * result.host_stores) if store_disk else "-", "planned", "memory_model.plan")
    for b in others:
        table.add_row(b.name, format_size(b.device_bytes), format_size(b.host_bytes) if b.host_bytes else "-",
                      format_size(b.nvme_bytes) if b.nvme_bytes else "-", b.formula, b.source)
    return table


def _link(p: Plan) -> int:
    """Bytes a step sends over the host-device link, both ways."""
    return p.link_bytes["h2d"] + p.link_bytes["d2h"]


def _base_figures(p: Plan) -> dict[str, Any]:
    return {"peak_device_bytes": p.peak_device_bytes, "host_peak_bytes": p.host_peak.total,
            "host_store_bytes": p.host_store_bytes, "link_bytes_per_step": _link(p),
            "disk_read_bytes_per_step": p.link_bytes["disk_read"],
            "step_s": None if p.does_not_fit else p.step_time_s}


def _base_name(lora: LoraConfig) -> str:
    if lora.gguf is not None:
        return "GGUF"
    if lora.load_in_8bit:
        return "8-bit (LLM.int8 weights)"
    return f"4-bit {lora.bnb_4bit_quant_type}{' (double quant)' * lora.bnb_4bit_use_double_quant}"


def _beside_16bit(quantized: Plan, sixteen: Plan, four: Plan | None) -> Table:
    """A quantized base's step beside the same LoRA step on the 16-bit base (an 8-bit base's beside the 4-bit
    one too), and the 16 B/param baseline."""
    table = Table(title="the quantized base beside a 16-bit one: the same LoRA step, model and target")
    for column in ("base", "device peak", "host RAM at its peak", "host store", "link a step", "disk read a step",
                   "step"):
        table.add_column(column, justify="left" if column == "base" else "right")
    link = _link(sixteen)
    rows = [(f"{_base_name(quantized.config.lora)} (this plan)", quantized)]
    rows += [] if four is None else [(_base_name(four.config.lora), four)]
    for label, p in (*rows, (f"16-bit ({quantized.config.precision.compute})", sixteen)):
        figures = _base_figures(p)
        table.add_row(label, format_size(p.peak_device_bytes), format_size(figures["host_peak_bytes"]),
                      format_size(p.host_store_bytes),
                      f"{format_size(figures['link_bytes_per_step'])} ({figures['link_bytes_per_step'] / link:.2f}x)",
                      format_size(figures["disk_read_bytes_per_step"]),
                      "does not fit" if figures["step_s"] is None else f"{figures['step_s']:.3g} s")
    table.add_row("16 B/param baseline (weights, gradients, Adam)", format_size(quantized.baseline_bytes), "-", "-",
                  "-", "-", "-")
    if sixteen.does_not_fit:
        table.caption = f"16-bit: {sixteen.does_not_fit}"
    return table


def _print_compare(out: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['run']}: step {out['predicted_step_s']:.4g} s predicted, {out['measured_step_s']:.4g} s measured "
          f"({out['step_error']:+.1%}); device peak {format_size(out['predicted_peak_bytes'])} predicted, "
          f"{format_size(out['measured_peak_bytes'])} measured ({out['peak_error']:+.2%}); host RAM "
          f"{format_size(out['predicted_host_bytes'])} predicted at its peak, "
          f"{format_size(out['measured_host_bytes'])} resident at the steps' ends")
    return 0


def plan_dtype(target: str, requested: str) -> DtypeChoice:
    """--dtype for a plan: this CPU's choice for the local target; bf16 for the presets, which run a 16-bit
    dtype natively (v100's 16-bit rate is fp16's, catalogue.py)."""
    if target == "local":
        return resolve_compute_dtype("cpu", requested)
    if requested == "auto":
        native = "16-bit (fp16) tensors" if target == "v100" else "bf16"
        return DtypeChoice("bf16", f"compute dtype bf16: {target} runs {native} natively")
    return DtypeChoice(requested, f"compute dtype {requested} (--dtype {requested})")


def _device(name: str, shape: ModelConfig, dtype: str) -> DeviceSpec:
    try:
        if name == "local":
            return local_spec(Path("runs"), shape, dtype)
        return device_spec(name)
    except ValueError as exc:
        raise StreamerError(str(exc)) from None

