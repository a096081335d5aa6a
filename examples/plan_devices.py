"""A model across devices and activation policies: device peak, fit (the device's memory, and a RAM store's host
RAM), step time, largest batch; below the table, why each step that does not fit does not.

    python examples/plan_devices.py [--model gptj-6b] [--batch 1] [--seq 2048] [--store ram] [--dry-run]

--model is any family's preset or config.json (gptj-6b, llama-3.1-8b, mistral-7b, qwen2.5-7b, qwen3-8b, ...).
Full fine-tuning with AdamW keeps 16 bytes per parameter (bf16 weights and gradients, fp32 master weights and two
moments): 96.8 GB for GPT-J-6B, 128 GB for Llama-3.1-8B, more than any single device here. Streamed, a device holds
one layer's state at a time plus the activations, which is what this table prices with the analytic planner
(memory_model.plan). --store says where the host store lives: ram (the default), or disk, which keeps no
compute-dtype copy and updates each layer during the backward (a lower peak, a step bound by the disk). --dry-run
also runs the runtime's real schedule on meta tensors for each policy and shows its ledger's peak beside the
planner's (a few seconds each).
"""
from __future__ import annotations

import argparse

from rich.table import Table

from layers import ModelConfig
from memory_model import DEVICE_PRESETS, PlanConfig, format_size, plan
from streamer import TrainerConfig
from streamer.calibration.dryrun import dry_run
from streamer.console import make_console

POLICIES = ("resident", "checkpoint")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gptj-6b", help="a preset or a config.json (default: gptj-6b)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--store", choices=("ram", "disk"), default="ram")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()

    cfg = ModelConfig.named(args.model)
    table = Table(title=f"{args.model} ({cfg.num_params():,} params), batch {args.batch} x {args.seq}, bf16, "
                        f"{args.store} store, 16 B/param baseline {format_size(16 * cfg.num_params())}")
    for column in ("device", "memory", "policy", "peak", "fits", "16 B/p ÷ peak", "step s", "tok/s", "MFU", "bound",
                   "max batch"):
        table.add_column(column, justify="left" if column in ("device", "policy", "bound") else "right")
    refused = {}  # why a step does not fit, by device and policy
    for name, device in DEVICE_PRESETS.items():
        for policy in POLICIES:
            p = plan(cfg, device, PlanConfig.of(batch=args.batch, seq=args.seq, activations=policy, store=args.store,
                                                update_on=device.update_on))  # MemoryX updates on the host
            # A RAM store must fit the host's RAM too: a large model's (Qwen3-30B-A3B's 512 GiB) may not.
            short = [what for what, fits in (("device", p.fits), ("host RAM", p.host_fits)) if not fits]
            if short:
                refused[f"{name}, {policy}"] = p.does_not_fit
            table.add_row(name, format_size(device.memory_bytes), policy, format_size(p.peak_device_bytes),
                          f"[red]no: {' and '.join(short)}[/]" if short else "yes",
                          f"{p.baseline_bytes / p.peak_device_bytes:.1f}",
                          f"{p.step_time_s:.2f}", f"{p.tokens_per_s:,.0f}", f"{p.utilisation:.1%}", p.bottleneck,
                          str(p.max_batch_seq[0]) if p.max_batch_seq and p.max_batch_seq[0] else "[red]none[/]")
    console = make_console()
    console.print(table)
    for where, why in refused.items():
        console.print(f"{where}: {why}")
    if args.dry_run:
        for policy in POLICIES:
            ledger = dry_run(cfg, TrainerConfig.of(activations=policy, store=args.store), args.batch, args.seq)
            planned = plan(cfg, DEVICE_PRESETS["cs2"], PlanConfig.of(batch=args.batch, seq=args.seq, store=args.store,
                                                                    activations=policy)).peak_device_bytes
            console.print(f"dry run, {policy}: the runtime's ledger peaks at {format_size(ledger.peak)}; "
                          f"the planner says {format_size(planned)}")


if __name__ == "__main__":
    main()
