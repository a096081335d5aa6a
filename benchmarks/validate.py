"""The planner against published runs of offloaded and streamed training: docs/VALIDATION.md.

    python -m benchmarks.validate [--output docs/VALIDATION.md]

Each run of memory_model.catalogue.PUBLISHED_RUNS is planned on its device preset (its published machine's own
host figures in place of the preset's, where the source names them), with no per-case figure:
the ratio is the plan's figure over the published one. The command writes the table; tests/test_validate.py
checks that the committed table is what it writes. It is a benchmark, not a `streamer` subcommand: it checks
the planner against the literature and writes a file of this repository, which no user's run needs.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memory_model.catalogue import PUBLISHED_RUNS, PublishedRun
from memory_model.devices import DeviceSpec, device_spec, with_figures
from memory_model.planner import plan
from memory_model.scaling import scaling_curve
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
    published_mfu: float | None = None  # a published FLOP rate as model FLOPs (the plan's count) over the peak

    @property
    def ratio(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.run.measured.value

    @property
    def ratio_recompute(self) -> float | None:
        """The ratio had the source counted the recompute's FLOPs (Megatron's convention): FLOP rates whose source
        does not say how it counts them."""
        if self.ratio is None or not self.run.metric.startswith("TFLOPS") or self.run.flops is not None:
            return None
        return self.ratio * self.recompute


def _device(run: PublishedRun) -> DeviceSpec:
    """The run's device preset with the published machine's own figures in place of the preset's."""
    return with_figures(device_spec(run.device), dict(run.testbed))


def _step(run: PublishedRun) -> PlanConfig:
    """The run's step as `streamer plan` takes it: the update where the device runs it unless the run says."""
    device = device_spec(run.device)
    step: dict[str, Any] = {"update_on": device.update_on, **dict(run.step)}
    return PlanConfig.of(batch=run.batch, seq=run.seq, **step)


def predict(run: PublishedRun) -> Row:
    """The plan's figure for one published run, in the run's own metric and, where its source says, its FLOP count."""
    if not run.reproducible:
        return Row(run, None, None)
    shape, device, step = run.shape, _device(run), _step(run)
    many = plan(shape, device, step, limits=False)
    if many.does_not_fit:  # a stand-in step must run where the published one ran
        raise ValueError(f"{run.system}: the planned step does not fit {run.device}: {many.does_not_fit}")
    devices = step.devices
    if run.metric == "speedup":  # `streamer plan --ranks N`'s scaling curve: its last point over linear
        return Row(run, scaling_curve(shape, device, step)[-1]["efficiency"] * devices, many.utilisation)
    if run.metric == "MFU":
        return Row(run, many.utilisation, many.utilisation)
    # The source's FLOPs per device and step (model FLOPs where it does not say), and the published rate counted
    # as model FLOPs: model_flops is per device already.
    counted = many.model_flops if run.flops is None else run.flops.flops(shape, step.batch, step.seq) / devices
    every = devices if run.metric == "TFLOPS, all devices" else 1
    published = run.measured.value * 1e12 / every * many.model_flops / counted
    executed = sum(r.forward_flops + r.backward_flops for r in many.rows) / many.model_flops
    return Row(run, counted / many.step_time_s / 1e12 * every, many.utilisation, executed,
               published / device.flops_for(step.precision.compute))


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


def _against_caps(table: list[Row]) -> str:
    """Whether a published rate, as model FLOPs, passes the training MFU its device class is capped at."""
    caps = {r.run.device: device_spec(r.run.device).training_mfu for r in table}
    above = [f"{r.run.system} ({r.published_mfu:.1%} > {caps[r.run.device]:.1%})"
             for r in table if r.published_mfu is not None and r.published_mfu > caps[r.run.device]]
    if above:
        return f"Above their device's `training_mfu`, which caps every plan: {', '.join(above)}."
    return "Each is below its device's `training_mfu`, which caps every plan's MFU."


def markdown(table: list[Row]) -> str:
    priced, within, median = summary(table)
    _, within_r, median_r = summary(table, recompute=True)
    lines = [
        "# Validation against published runs",
        "",
        "Written by `python -m benchmarks.validate`; do not edit it by hand.",
        "Each row is a published measurement of offloaded or streamed training.",
        "The planner prices the same step on the device's preset, with no figure tuned for the case.",
        "Where a source names its machine's host, RAM or disks, those figures replace the preset's "
        "(`PublishedRun.testbed`, as `--set` would).",
        "The ratio is the plan's figure over the published one.",
        "The published figures and their sources are in `memory_model/catalogue.py` (`PUBLISHED_RUNS`).",
        "Each model is planned in its own family; GPT-2, not one of the planner's, as GPT-J blocks of its width "
        "and depth.",
        "",
        f"Goal: every case within ±{GOAL_CASE:.0%} and the median within ±{GOAL_MEDIAN:.0%}.",
        f"Now {within} of {priced} priced cases are within ±{GOAL_CASE:.0%}; the median ratio is {median:.2f}.",
        "Where a source's code shows how it counts FLOPs, the plan's rate is counted the same way "
        "(`FlopCount` in the catalogue).",
        "Elsewhere the plan's rates are model FLOPs: the recompute of checkpointed blocks is not counted.",
        "Those sources do not state their convention; Megatron's formula counts the recompute.",
        f"Had they counted it, {within_r} of {priced} cases would be within ±{GOAL_CASE:.0%} and the median "
        f"{median_r:.2f} (the column 'ratio, recompute counted').",
        "The column 'published MFU' is the published rate as model FLOPs over the device's dense peak "
        "(a rate whose count is unstated taken as model FLOPs).",
        _against_caps(table),
        "",
        "| system | source | model | batch x seq | device (host) | measured | published | plan | ratio "
        "| ratio, recompute counted | plan's MFU | published MFU | what the source leaves open |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    misses = [r for r in table if r.ratio is not None and abs(r.ratio - 1) > GOAL_CASE]
    if misses:  # before the table's header and rule, the last three lines
        lines[-3:-3] = ["The misses, and why (from each run's caveat, one clause a line):",
                        *(line for r in misses for line in (f"- {r.run.system} misses ({r.ratio:.2f}):",
                                                            *(f"  - {c}" for c in r.run.caveat.split("; "))))]
    for row in table:
        run = row.run
        plan_s = "not priced" if row.predicted is None else _figure(row.predicted, run.metric)
        ratio = "" if row.ratio is None else f"{row.ratio:.2f}"
        counted = "" if row.ratio_recompute is None else f"{row.ratio_recompute:.2f}"
        mfu = "" if row.mfu is None else f"{row.mfu:.1%}"
        published_mfu = "" if row.published_mfu is None else f"{row.published_mfu:.1%}"
        step: dict[str, Any] = dict(run.step)
        devices = int(step.get("devices", 1))
        device = run.device if devices == 1 else f"{devices} x {run.device}"
        lines.append(f"| {run.system} | {run.measured.source} | {run.model} | {run.batch} x {run.seq} "
                     f"| {device} ({run.host}) | {run.metric} | {_figure(run.measured.value, run.metric)} "
                     f"| {plan_s} | {ratio} | {counted} | {mfu} | {published_mfu} | {run.caveat} |")
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
