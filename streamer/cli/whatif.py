"""`streamer plan`'s what-ifs: --compare RUN_DIR (prediction vs a finished run), --sweep (CSV + roofline).

Only argparse is imported at the top: `add_flags` runs whenever the command line is parsed.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layers import ModelConfig
    from memory_model.devices import DeviceSpec
    from streamer.run import RunConfig

SWEEP_BATCHES = (1, 4, 16, 64)
SWEEP_SEQS = (512, 2048)
SWEEP_TARGETS = ("cs2", "cs3", "a100-80g", "h100-sxm", "h100-pcie", "gh200", "rtx4090")
SWEEP_UPDATES = ("device", "host")


def add_flags(plan: argparse.ArgumentParser) -> None:
    """The what-if flags of `streamer plan`, kept together."""
    plan.add_argument("--compare", metavar="RUN_DIR",
                      help="replay a finished CPU run's settings on the local target: predicted vs measured "
                           "step time and device peak")
    plan.add_argument("--sweep", metavar="DIR",
                      help="plan batch x seq x target x tier x update place; write DIR/sweep.csv and "
                           "DIR/roofline.png")


def compare(run_dir: str, sets: tuple[str, ...]) -> dict[str, Any]:
    """The plan of a run's own settings on this machine (its --set figures, then `sets`) beside what the run
    measured (its metrics.jsonl: the median step time after the first step, which pays for warm-up, and the
    ledger's peak). A data-parallel run is planned as it ran: each of its processes on its own share of the
    batch, with the gradient all-reduce."""
    from memory_model import plan
    from memory_model.devices import with_sets
    from streamer.errors import StreamerError
    from streamer.run import SettingError
    from streamer.run_dir import RunDir
    from streamer.advice import peak_plan_config, planned_host
    from streamer.calibration.calibrate import local_spec

    run = RunDir.open(run_dir)
    cfg = run.read_config()
    if cfg.trainer.device.device != "cpu":
        raise StreamerError(f"--compare replays runs on the cpu device (the calibrated local target); {run_dir} "
                            f"ran on {cfg.trainer.device.device}")
    steps = [r for r in run.read_metrics() if "step_s" in r and not r.get("skipped")]
    if len(steps) < 2:
        raise StreamerError(f"{run_dir} has {len(steps)} timed step(s); --compare needs 2 or more (the first "
                            "pays for warm-up): train it longer with --steps")
    shape, processes = cfg.model_config(), run.processes()
    device = with_sets(local_spec(Path("runs"), shape, cfg.trainer.step.precision.compute),
                       (*cfg.trainer.device.set, *sets), SettingError)
    # The peak of the schedule a clipped fused step runs; the largest batch and seq that fit are not needed.
    predicted = plan(shape, device, peak_plan_config(shape, cfg, processes), limits=False)
    predicted_step = statistics.median(replayed_steps(shape, device, cfg, steps, processes)[1:])
    measured_step = statistics.median(r["step_s"] for r in steps[1:])
    measured_peak = max(r["device_peak_bytes"] for r in steps)
    # The process's high-water mark after each step (metrics.jsonl; a run logged before it was recorded: its
    # resident set at each step's end), against the process's planned peak.
    measured_host = max(r.get("host_rss_peak_bytes", r.get("host_rss_bytes", 0)) for r in steps)
    return {"run": str(run_dir), "predicted_step_s": predicted_step, "measured_step_s": measured_step,
            "step_error": predicted_step / measured_step - 1,
            "predicted_peak_bytes": predicted.peak_device_bytes, "measured_peak_bytes": measured_peak,
            "peak_error": predicted.peak_device_bytes / measured_peak - 1,
            "predicted_host_bytes": planned_host(shape, cfg, processes).total, "measured_host_bytes": measured_host,
            "steps_measured": len(steps) - 1, "processes": processes,
            "bottleneck": predicted.bottleneck}


def replayed_steps(shape: ModelConfig, device: DeviceSpec, cfg: RunConfig, steps: list[dict[str, Any]],
                   processes: int = 1) -> list[float]:
    """The planned time of each step the run logged, on the schedule the trainer ran it with. With clipping
    on, a fused step is speculative: one whose gradient norm exceeded --max-grad-norm was undone and made
    again, norm-first or after the backward (--clipped-steps), and the steps after it ran that way until one did
    not clip. Each record says how its step was made (`schedule`, `redone`); a run logged before they did
    is replayed on the after-backward schedule. The undone attempt is priced as its forward (it stops at the
    first unit whose running norm crosses the threshold, early when the norm is far above it): a lower bound."""
    from memory_model import plan
    from memory_model.planner import clipped_steps

    pc = cfg.plan_config(processes)
    fused = plan(shape, device, pc, limits=False)
    if not (pc.fused and cfg.trainer.optimizer.max_grad_norm):
        return [fused.step_time_s] * len(steps)
    clipped = {name: p.step_s for name, p in clipped_steps(shape, device, pc).items()}
    priced = {"fused": fused.step_time_s, **clipped}
    attempt = sum(row.forward_s for row in fused.rows)
    times, speculate = [], True
    for record in steps:
        if "schedule" in record:
            times.append(priced[record["schedule"]] + (attempt if record["redone"] else 0.0))
            continue
        clips = record.get("grad_norm", 0.0) > cfg.trainer.optimizer.max_grad_norm
        after = clipped["after-backward"]
        times.append((attempt + after if clips else fused.step_time_s) if speculate else after)
        speculate = not clips
    return times


def sweep(model: str, activations: str, out_dir: str) -> tuple[Path, Path, int]:
    """Plan every point of the grid; write the CSV and the roofline plot. Returns their paths and the count."""
    from layers import ModelConfig
    from memory_model import PlanConfig, device_spec, plan
    from memory_model.tiers import TIERS

    shape = ModelConfig.named(model)
    rows = []
    for batch, seq, target, tier, update in itertools.product(SWEEP_BATCHES, SWEEP_SEQS, SWEEP_TARGETS,
                                                               tuple(TIERS), SWEEP_UPDATES):
        if seq > shape.attention().context()[0]:
            continue
        device = device_spec(target)
        p = plan(shape, device, PlanConfig.of(batch=batch, seq=seq, activations=activations, store=tier,
                                            update_on=update), limits=False)
        # Intensity against the busier host link (they are full duplex: each direction has its own bandwidth).
        moved = max(p.link_bytes["h2d"], p.link_bytes["d2h"])
        rows.append({"batch": batch, "seq": seq, "target": target, "tier": tier, "update_on": update,
                     **p.summary(), "flops_per_byte": p.model_flops / moved if moved else float("inf"),
                     "peak_flops": device.flops_for("bf16"),
                     "achievable_flops": device.flops_for("bf16") * device.matmul_efficiency,
                     "h2d_bytes_per_s": device.h2d.bandwidth_bytes_per_s * device.bandwidth_efficiency})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "sweep.csv"
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return table, _roofline(rows, out / "roofline.png"), len(rows)


def _roofline(rows: list[dict[str, Any]], path: Path) -> Path:
    """Achieved model FLOP/s against model FLOPs per byte over the busier host link, per target, under each
    target's roof: min(achievable FLOP/s, intensity x achievable link bandwidth). Points well below their roof
    are bound by something else: the host update, the disk, or exposed latency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for target in dict.fromkeys(r["target"] for r in rows):
        mine = [r for r in rows if r["target"] == target and r["flops_per_byte"] != float("inf")]
        dots = ax.scatter([r["flops_per_byte"] for r in mine], [r["model_flops_per_s"] for r in mine], s=12,
                          label=target)
        lo, hi = min(r["flops_per_byte"] for r in mine), max(r["flops_per_byte"] for r in mine)
        xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
        roof, bw = mine[0]["achievable_flops"], mine[0]["h2d_bytes_per_s"]
        ax.plot(xs, [min(roof, x * bw) for x in xs], color=dots.get_facecolor()[0], linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model FLOPs per byte over the busier host link")
    ax.set_ylabel("model FLOP/s (predicted)")
    ax.set_title("what-if sweep: achieved vs each device's achievable roof")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
