"""Human views of a trace: the PNG memory plot and the per-layer rich table."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from memory_model.ledger import CATEGORIES
from memory_model.units import SizeError, format_size, parse_size

if TYPE_CHECKING:
    from memory_model.trace import Trace

_COLORS = {"weights": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
           "workspace": "#8172B3"}


def _budget_bytes(meta: dict[str, Any]) -> int | None:
    """meta["budget"] as the runtime records it: bytes, a size string, or None (unlimited)."""
    budget = meta.get("budget")
    if budget is None:
        return None
    try:
        return parse_size(budget)
    except SizeError:
        return None


def plot_trace(trace: "Trace", path: Path, step: int | None = None) -> None:
    # A bare Figure renders with Agg and touches no global pyplot state: safe inside a library and headless.
    from matplotlib.figure import Figure

    start, end = trace.time_range(step)
    points = [(s.t_s, s.bytes) for s in trace.samples if start <= s.t_s <= end]
    before = [s.bytes for s in trace.samples if s.t_s < start]
    if before:  # what the device held when the window opened
        points.insert(0, (start, before[-1]))
    if not points:
        raise ValueError("the trace has no memory samples to plot")
    points.append((end, points[-1][1]))  # hold the last state to the window's end
    peak = max(sum(p[1]) for p in points)
    baseline = trace.meta.get("baseline_bytes")
    lines = [("budget", _budget_bytes(trace.meta), "black", "--"), ("16 B/param baseline", baseline, "grey", ":")]
    unit, scale = _axis_unit(max([peak] + [v for _, v, _, _ in lines if v]))
    t = [p[0] - start for p in points]
    stacks = [[p[1][i] / scale for p in points] for i in range(len(CATEGORIES))]
    fig = Figure(figsize=(11, 5.5), dpi=110)
    ax = fig.add_subplot()
    ax.stackplot(t, stacks, labels=CATEGORIES, colors=[_COLORS[c] for c in CATEGORIES], step="post",
                 alpha=0.9)
    for label, value, color, style in lines:
        if value:
            ax.axhline(value / scale, color=color, linestyle=style, linewidth=1.2,
                       label=f"{label} {format_size(value)}")
    if baseline and peak:
        model = f"{trace.meta['model']}: " if trace.meta.get("model") else ""
        ax.set_title(f"{model}device peak {format_size(peak)}, {baseline / peak:.1f}x below the 16 B/param baseline",
                     fontsize=10)
    ax.set_xlabel("seconds" + (f" into step {step}" if step is not None else ""))
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_xlim(0, max(end - start, 1e-9))
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8, ncols=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _axis_unit(largest: float) -> tuple[str, int]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= scale:
            return unit, scale
    return "B", 1


def trace_table(trace: "Trace", step: int | None = None) -> Table:
    spans = trace.spans(step)
    phases = list(dict.fromkeys(e.phase for e in spans))
    rows: dict[str, dict[str, Any]] = {}
    for e in spans:
        row = rows.setdefault(e.layer, {"peak": -1, "breakdown": {}, "time": {}})
        if e.peak_bytes > row["peak"]:
            row["peak"], row["breakdown"] = e.peak_bytes, e.peak_breakdown
        row["time"][e.phase] = row["time"].get(e.phase, 0.0) + e.duration_s
    title = "device memory by layer" + (f", step {step}" if step is not None else "")
    table = Table(title=title, show_lines=False)
    table.add_column("layer", style="bold")
    table.add_column("peak", justify="right")
    for c in CATEGORIES:
        table.add_column(c, justify="right")
    for p in phases:
        table.add_column(f"{p} ms", justify="right")
    for layer, row in rows.items():
        table.add_row(layer, format_size(row["peak"]), *(format_size(row["breakdown"].get(c, 0)) for c in CATEGORIES),
                      *(f"{row['time'][p] * 1e3:.1f}" if p in row["time"] else "" for p in phases))
    return table
