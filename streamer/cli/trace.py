"""`streamer trace`: a run's per-layer memory table and plot; the memory summary lines `train` prints too."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from memory_model import CATEGORIES, Trace, format_size
from streamer.cli.flags import declare_command
from streamer.console import make_console
from streamer.run import RunError
from streamer.run_dir import RunDir
from streamer.store.slabfile import replace_file

EXAMPLES = """\
examples:
  streamer trace RUN
  streamer train --run-dir runs/traced --steps 300 --trace-every 100
  streamer trace runs/traced --step 100 --out step100.png --chrome step100.json
  streamer trace RUN/trace.json --json"""


def declare(parser: argparse.ArgumentParser) -> None:
    declare_command(parser, trace_command, "Show a run's memory trace. A run's trace keeps its last --trace-steps "
                    "steps (default 8) and, if trained with --trace-every N, every Nth step; --step picks one of "
                    "them.", EXAMPLES)
    parser.add_argument("run", metavar="RUN", help="a run directory or a trace JSON file")
    parser.add_argument("--step", type=int, help="one of the steps the trace keeps (default: the peak step, the "
                        "one with the highest device peak)")
    parser.add_argument("--out", help="the PNG to write (default: RUN/memory.png, or RUN/memory-stepN.png with "
                        "--step N, leaving the peak step's plot as it is)")
    parser.add_argument("--chrome", help="also write a Chrome trace (chrome://tracing, ui.perfetto.dev) here")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


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
    step = trace.peak_step() if args.step is None else args.step
    if step not in steps:
        raise RunError(f"--step {step} is not in the trace; it holds steps {step_ranges(steps)} (the last "
                       "--trace-steps, default 8, and every Nth with --trace-every N); to keep others, train with "
                       "--trace-every N or a larger --trace-steps")
    summary = trace.summary(step)
    plot = Path(args.out) if args.out else path.with_name(plot_name(args.step))
    out: Path | None = plot
    if args.out or _writable(plot):
        replace_file(plot, lambda tmp: trace.plot(tmp, step=step))
    else:  # a run folder that is archived, shared or mounted read-only: the table alone, and where a plot can go
        out = None
    if args.chrome:
        trace.to_chrome(args.chrome)
    if args.json:
        print(json.dumps({"step": step, "peak_step": trace.peak_step(), "plot": out and str(out), **summary,
                          "meta": trace.meta}, indent=2, default=str))
        return 0
    console = make_console()
    console.print(trace.table(step=step))
    for line in memory_lines(trace, step):
        console.print(line)
    shown = f"plot: {out}" if out else f"plot: not written ({path.parent} is read-only); pass --out FILE.png"
    console.print(shown + (f"; Chrome trace: {args.chrome}" if args.chrome else ""), markup=False)
    return 0


def plot_name(step: int | None) -> str:
    """The plot's file name beside the trace: memory.png shows the peak step (train writes it too); a step picked
    with --step gets its own file, so looking at one step never replaces the peak step's plot."""
    return "memory.png" if step is None else f"memory-step{step}.png"


def _writable(path: Path) -> bool:
    """Whether this process may write `path`: replace it where it exists, else create it in its folder."""
    return os.access(path, os.W_OK) if path.exists() else os.access(path.parent, os.W_OK)


def memory_lines(trace: Trace, step: int, planned: int | None = None, planned_host: int | None = None) -> list[str]:
    """Step `step`'s measured device peak against the budget, the planner and the 16 B/param baseline, saying
    whose peak it is: the run's (the highest of the steps the trace was made over) or that one step's; and the
    host's resident peak against the planner's (`planned_host`)."""
    meta, summary, top = trace.meta, trace.summary(step), trace.peak_step()
    peak = summary["peak_bytes"]
    budget = meta.get("budget")
    trained = meta.get("steps")  # [first, last] of the invocation that wrote the trace
    over = f"{trained[0]}..{trained[1]}" if trained and trained[0] != trained[1] else step_ranges(trace.steps())
    whose = (f"device peak {format_size(peak)} at step {step}, the highest of steps {over}" if step == top else
             f"device peak of step {step}: {format_size(peak)} (the highest, "
             f"{format_size(trace.summary(top)['peak_bytes'])}, is at step {top})")
    lines = [f"{whose} ({breakdown(summary['peak_breakdown'])})"
             + (f" within a {format_size(budget)} budget" if budget else "")
             + (f"; the planner predicts {format_size(planned)}" if planned is not None else "")]
    if meta.get("params") and meta.get("baseline_bytes") and peak:
        baseline = meta["baseline_bytes"]
        lines.append(f"16 B/param baseline (all training state on the device): {meta['params']:,} params -> "
                     f"{format_size(baseline)}, {baseline / peak:.1f}x the streamed peak")
    high_water = meta.get("host_rss_high_water_bytes")  # a trace written before it was recorded has none
    rss = (f"host RSS peak {format_size(high_water)} (the process's high-water mark)" if high_water else
           f"host RSS peak {format_size(summary['host_rss_peak_bytes'])} (at span ends)")
    lines.append(rss + (f"; the planner predicts {format_size(planned_host)}" if planned_host is not None else ""))
    if meta.get("params") and meta.get("step_disk_read_bytes") is not None:
        read, written, params = meta["step_disk_read_bytes"], meta["step_disk_write_bytes"], meta["params"]
        if read or written:
            lines.append(f"store files, last step: read {format_size(read)} ({read / params:.2f} B/param), "
                         f"written {format_size(written)} ({written / params:.2f} B/param)")
    return lines


def breakdown(parts: dict[str, int]) -> str:
    return ", ".join(f"{c} {format_size(parts.get(c, 0))}" for c in CATEGORIES)
