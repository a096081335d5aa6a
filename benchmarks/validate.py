"""The planner against published runs of offloaded and streamed training: docs/VALIDATION.md.

    python -m benchmarks.validate [--output docs/VALIDATION.md]

Each run of memory_model.catalogue.PUBLISHED_RUNS is planned on its device preset, with no per-case figure:
the ratio is the plan's figure over the published one. The command writes the table; tests/test_validate.py
checks that the committed table is what it writes. It is a benchmark, not a `streamer` subcommand: it checks
the planner against the literature and writes a file of this repository, which no user's run needs.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from memory_model.catalogue import PUBLISHED_RUNS, PublishedRun
from memory_model.devices import device_spec
from memory_model.planner import plan, scaling_curve
from memory_model.shapes import PlanConfig

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "VALIDATION.md"
GOAL_CASE, GOAL_MEDIAN = 0.25, 0.10  # every case within 25%, the median within 10%


@dataclass(frozen=True)
class Row:
    run: PublishedRun
    predicted: float | None  # None: not priced
    mfu: float | None  # the plan's MFU, where priced
    recompute: float = 1.0  # the step's FLOPs with the recompute of checkpointed blocks over its model FLOPs

    @property
    def ratio(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.run.measured.value

    @property
    def ratio_recompute(self) -> float | None:
        """The ratio had the source counted the recompute's FLOPs (Megatron's convention): FLOP rates only."""
        if self.ratio is None or not self.run.metric.startswith("TFLOPS"):
            return None
        return self.ratio * self.recompute


def _step(run: PublishedRun) -> PlanConfig:
    """The run's step as `streamer plan` takes it: the update where the device runs it unless the run says."""
    device = device_spec(run.device)
    return PlanConfig(batch=run.batch, seq=run.seq, **{"update_on": device.update_on, **dict(run.step)})


def predict(run: PublishedRun) -> Row:
    """The plan's figure for one published run, in the run's own metric."""
    if not run.reproducible:
        return Row(run, None, None)
    shape, device, step = run.shape, device_spec(run.device), _step(run)
    many = plan(shape, device, step, limits=False)
    if many.does_not_fit:  # a stand-in step must run where the published one ran
        raise ValueError(f"{run.system}: the planned step does not fit {run.device}: {many.does_not_fit}")
    devices = step.devices
    if run.metric == "speedup":  # `streamer plan --ranks N`'s scaling curve: its last point over linear
        return Row(run, scaling_curve(shape, device, step)[-1]["efficiency"] * devices, many.utilisation)
    per_device = many.model_flops / many.step_time_s / 1e12
    if run.metric == "MFU":
        return Row(run, many.utilisation, many.utilisation)
    executed = sum(r.forward_flops + r.backward_flops for r in many.rows) / many.model_flops
    return Row(run, per_device * (devices if run.metric == "TFLOPS, all devices" else 1), many.utilisation,
               executed)


def rows() -> list[Row]:
    return [predict(run) for run in PUBLISHED_RUNS]


def _figure(value: float, metric: str) -> str:
    if metric == "speedup":
        return f"{value:.1f}x"
    if metric == "MFU":
        return f"{value:.0%}"
    return f"{value:,.0f}"


def summary(table: list[Row], recompute: bool = False) -> tuple[int, int, float]:
    """(priced cases, of them within the per-case goal, the median ratio); with `recompute`, each FLOP rate's
    ratio as if the source counted the recompute."""
    ratios = [(r.ratio_recompute if recompute and r.ratio_recompute is not None else r.ratio)
              for r in table if r.ratio is not None]
    within = sum(abs(x - 1) <= GOAL_CASE for x in ratios)
    return len(ratios), within, statistics.median(ratios)


def markdown(table: list[Row]) -> str:
    priced, within, median = summary(table)
    _, within_r, median_r = summary(table, recompute=True)
    lines = [
        "# Validation against published runs",
        "",
        "Written by `python -m benchmarks.validate`; do not edit it by hand.",
        "Each row is a published measurement of offloaded or streamed training.",
        "The planner prices the same step on the device's preset, with no figure tuned for the case.",
        "The ratio is the plan's figure over the published one.",
        "The published figures and their sources are in `memory_model/catalogue.py` (`PUBLISHED_RUNS`).",
        "Each model is planned in its own family; GPT-2, not one of the planner's, as GPT-J blocks of its width and depth.",
        "",
        f"Goal: every case within ±{GOAL_CASE:.0%} and the median within ±{GOAL_MEDIAN:.0%}.",
        f"Now {within} of {priced} priced cases are within ±{GOAL_CASE:.0%}; the median ratio is {median:.2f}.",
        "The plan's FLOP rates are model FLOPs: the recompute of checkpointed blocks is not counted.",
        "No source states its convention; Megatron's formula counts the recompute.",
        f"Counted so, {within_r} of {priced} cases are within ±{GOAL_CASE:.0%} and the median is {median_r:.2f} "
        "(the column 'ratio, recompute counted').",
        "",
        "| system | source | model | batch x seq | device (host) | measured | published | plan | ratio "
        "| ratio, recompute counted | plan's MFU | what the source leaves open |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    misses = [r for r in table if r.ratio is not None and abs(r.ratio - 1) > GOAL_CASE]
    if misses:  # before the table's header and rule, the last three lines
        lines[-3:-3] = ["The misses, and why (from each run's caveat):",
                        *(f"- {r.run.system} misses ({r.ratio:.2f}): {r.run.caveat}." for r in misses)]
    for row in table:
        run = row.run
        plan_s = "not priced" if row.predicted is None else _figure(row.predicted, run.metric)
        ratio = "" if row.ratio is None else f"{row.ratio:.2f}"
        counted = "" if row.ratio_recompute is None else f"{row.ratio_recompute:.2f}"
        mfu = "" if row.mfu is None else f"{row.mfu:.1%}"
        devices = int(dict(run.step).get("devices", 1))
        device = run.device if devices == 1 else f"{devices} x {run.device}"
        lines.append(f"| {run.system} | {run.measured.source} | {run.model} | {run.batch} x {run.seq} "
                     f"| {device} ({run.host}) | {run.metric} | {_figure(run.measured.value, run.metric)} "
                     f"| {plan_s} | {ratio} | {counted} | {mfu} | {run.caveat} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.validate", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where the table goes (default: %(default)s)")
    args = parser.parse_args(argv)
    table = rows()
    args.output.write_text(markdown(table))
    priced, within, median = summary(table)
    for row in table:
        shown = "not priced" if row.ratio is None else f"{row.ratio:.2f}"
        print(f"{row.run.system:28} {row.run.device:9} ratio {shown}")
    print(f"{within} of {priced} priced cases within ±{GOAL_CASE:.0%}; median ratio {median:.2f}; "
          f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
