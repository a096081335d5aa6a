"""A memory trace: per layer and phase, when it ran, on which thread, and what the device held.

Spans come from the runtime (`with trace.span("block.3", "forward", step=1, micro=0): ...`); the device's
bytes by category over time come from the ledger itself (every allocate/free), so the plot and the Chrome
counters show the real shape of the step rather than samples at span ends. The JSON layout is documented
in docs/TRACE_SCHEMA.md.
"""
from __future__ import annotations

import json
import resource
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import psutil
from rich.table import Table

from memory_model.ledger import CATEGORIES, Ledger
from memory_model.units import SizeError, format_size, parse_size

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PHASES = ("load", "forward", "backward", "offload", "update", "generate")  # what the executor emits
SCHEMA = "weight-streaming.trace"
SCHEMA_VERSION = 2  # 2 added each span's layer_bytes; a version 1 file reads with them empty


def rss_high_water() -> int:
    """This process's highest resident set so far: the kernel's high-water mark (VmHWM on Linux, else
    getrusage's ru_maxrss). The RSS sampled at span ends misses a peak inside a span; this does not."""
    return resident_set()[1]


def resident_set() -> tuple[int, int]:
    """This process's resident set now and its high-water mark (`rss_high_water`), in bytes. On Linux both come
    from one read of /proc/self/status, so the mark is never below the set; two reads (statm's per-CPU estimate,
    say) can disagree by a few pages."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return psutil.Process().memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class SpanEvent:
    """One span. Times are seconds since the trace started; bytes are device bytes from the ledger."""

    layer: str
    phase: str
    step: int | None
    micro: int | None
    start_s: float
    end_s: float
    thread: str
    ok: bool  # False when the span's body raised (e.g. DeviceOutOfMemory): the trace shows where it failed
    device_bytes: dict[str, int]  # by category when the span ended
    peak_bytes: int  # the highest device total while the span was open
    peak_breakdown: dict[str, int]  # by category at that moment
    host_rss_bytes: int  # this process's resident set when the span ended
    layer_bytes: dict[str, int]  # by category, the most the span's layer itself held at once while it was open

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class MemorySample:
    """The device's bytes by category (in CATEGORIES order) right after an allocation or a free."""

    t_s: float
    bytes: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.bytes)


class Trace:
    """Spans and memory samples of a run; exports JSON, Chrome trace, a PNG plot, a rich table, a summary."""

    def __init__(self, ledger: Ledger | None, meta: dict[str, Any] | None = None) -> None:
        self.ledger = ledger
        self.meta: dict[str, Any] = dict(meta or {})
        self.events: list[SpanEvent] = []
        self.samples: list[MemorySample] = []
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._process = psutil.Process()
        if ledger is not None:
            breakdown = ledger.breakdown()
            self.samples.append(MemorySample(0.0, tuple(breakdown[c] for c in CATEGORIES)))
            ledger.add_listener(self._on_change)

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _on_change(self, breakdown: dict[str, int]) -> None:
        # Called under the ledger's lock, so samples arrive in allocation order from every thread.
        self.samples.append(MemorySample(self._now(), tuple(breakdown[c] for c in CATEGORIES)))

    def keep_last_steps(self, steps: int, every: int = 0) -> None:
        """Forget spans and memory samples of steps other than the last `steps`, the peak step (`peak_step`) and,
        with `every` > 0, every `every`-th step (steps every, 2*every, ...): a long run's trace holds at most
        steps/every + `steps` + 1 steps."""
        if steps < 1 or every < 0:
            raise ValueError(f"keep at least one step and every >= 0 (0: none), got steps={steps}, every={every}")
        peak = self.peak_step()
        with self._lock:
            recent = sorted({e.step for e in self.events if e.step is not None})[-steps:]
            if not recent:
                return
            cutoff = min(e.start_s for e in self.events if e.step == recent[0])

            def older_kept(step: int | None) -> bool:
                return step is not None and step < recent[0] and (step == peak or bool(every and step % every == 0))

            windows = self._step_windows({e.step for e in self.events if e.step is not None and older_kept(e.step)})

            def kept(t_start: float, t_end: float) -> bool:
                return t_end >= cutoff or any(lo <= t_start and t_end <= hi for lo, hi in windows)

            self.events = [e for e in self.events
                           if (e.step is not None and (e.step >= recent[0] or older_kept(e.step)))
                           or (e.step is None and kept(e.start_s, e.end_s))]
        if not windows:  # samples are appended in time order from the ledger's listener: delete the old prefix
            old = next((i for i, sample in enumerate(self.samples) if sample.t_s >= cutoff), len(self.samples))
            del self.samples[:old]
        else:
            self.samples[:] = [sample for sample in self.samples if kept(sample.t_s, sample.t_s)]

    def _step_windows(self, steps: set[int]) -> list[tuple[float, float]]:
        """For each step, the time from its first span's start to its last span's end."""
        starts: dict[int, float] = {}
        ends: dict[int, float] = {}
        for e in self.events:
            if e.step in steps:
                starts[e.step] = min(starts.get(e.step, e.start_s), e.start_s)
                ends[e.step] = max(ends.get(e.step, e.end_s), e.end_s)
        return [(starts[step], ends[step]) for step in sorted(starts)]

    def close(self) -> None:
        """Stop sampling the ledger (the trace keeps what it has)."""
        if self.ledger is not None:
            self.ledger.remove_listener(self._on_change)
            self.ledger = None

    @contextmanager
    def span(self, layer: str, phase: str, step: int | None = None, micro: int | None = None) -> Iterator[None]:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
        if self.ledger is None:
            raise RuntimeError("this trace has no ledger (loaded from JSON, or closed); it cannot record spans")
        ledger = self.ledger
        window = ledger.open_window(layer)
        start = self._now()
        ok = False
        try:
            yield
            ok = True
        finally:
            stats = ledger.close_window(window)
            event = SpanEvent(
                layer=layer, phase=phase, step=step, micro=micro, start_s=start, end_s=self._now(),
                thread=threading.current_thread().name, ok=ok, device_bytes=ledger.breakdown(),
                peak_bytes=stats.peak, peak_breakdown=stats.peak_breakdown,
                host_rss_bytes=self._process.memory_info().rss, layer_bytes=stats.layer_peaks,
            )
            with self._lock:
                self.events.append(event)

    # --- selections ----------------------------------------------------------------------
    def spans(self, step: int | None = None) -> list[SpanEvent]:
        """Spans in start order, of one step or all."""
        with self._lock:
            chosen = [e for e in self.events if step is None or e.step == step]
        return sorted(chosen, key=lambda e: e.start_s)

    def time_range(self, step: int | None = None) -> tuple[float, float]:
        spans = self.spans(step)
        if step is not None and not spans:
            raise ValueError(f"the trace has no spans of step {step}; steps: {self.steps()}")
        if not spans:
            end = self.samples[-1].t_s if self.samples else 0.0
            return 0.0, end
        return min(e.start_s for e in spans), max(e.end_s for e in spans)

    def steps(self) -> list[int]:
        return sorted({e.step for e in self.events if e.step is not None})

    def peak_step(self) -> int | None:
        """The step whose spans reached the highest device total (the earliest of equal ones); None if no step."""
        with self._lock:
            top = max((e for e in self.events if e.step is not None), key=lambda e: (e.peak_bytes, -(e.step or 0)),
                      default=None)
        return None if top is None else top.step

    # --- summaries -------------------------------------------------------------------------
    def summary(self, step: int | None = None) -> dict[str, Any]:
        """Peak device bytes (and where), time per phase, per-layer peaks, host RSS peak."""
        spans = self.spans(step)
        start, end = self.time_range(step)
        top = max(spans, key=lambda e: e.peak_bytes, default=None)
        by_phase: dict[str, float] = {}
        layers: dict[str, dict[str, Any]] = {}
        for e in spans:
            by_phase[e.phase] = by_phase.get(e.phase, 0.0) + e.duration_s
            row = layers.setdefault(e.layer, {"peak_bytes": 0, "peak_phase": None, "time_by_phase_s": {}})
            if e.peak_bytes >= row["peak_bytes"]:
                row["peak_bytes"], row["peak_phase"] = e.peak_bytes, e.phase
            row["time_by_phase_s"][e.phase] = row["time_by_phase_s"].get(e.phase, 0.0) + e.duration_s
        return {
            "spans": len(spans), "steps": self.steps() if step is None else [step],
            "duration_s": end - start,
            "peak_bytes": top.peak_bytes if top else 0,
            "peak_breakdown": dict(top.peak_breakdown) if top else dict.fromkeys(CATEGORIES, 0),
            "peak_at": ({"layer": top.layer, "phase": top.phase, "step": top.step, "micro": top.micro}
                        if top else None),
            "failed_spans": sum(not e.ok for e in spans),
            "time_by_phase_s": by_phase,
            "host_rss_peak_bytes": max((e.host_rss_bytes for e in spans), default=0),
            "layers": layers,
        }

    # --- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            events = [asdict(e) for e in self.events]
        return {
            "schema": SCHEMA, "version": SCHEMA_VERSION, "meta": self.meta, "categories": list(CATEGORIES),
            "events": events,
            "memory": {"columns": ["t_s", *CATEGORIES], "rows": [[s.t_s, *s.bytes] for s in list(self.samples)]},
            "summary": self.summary(),
        }

    def to_json(self, path: Path | str) -> None:
        # meta is the caller's; a value JSON cannot hold (a Path, a dtype) is written as its str().
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, default=str))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Trace":
        if raw.get("schema") != SCHEMA or raw.get("version") not in (1, SCHEMA_VERSION):
            raise ValueError(f"not a version {SCHEMA_VERSION} {SCHEMA} file "
                             f"(schema {raw.get('schema')!r}, version {raw.get('version')!r})")
        if list(raw.get("categories", ())) != list(CATEGORIES):
            raise ValueError(f"trace categories {raw.get('categories')} differ from {list(CATEGORIES)}")
        trace = cls(None, raw.get("meta", {}))
        names = {f.name for f in fields(SpanEvent)}
        for e in raw["events"]:
            if raw["version"] == 1:  # written before spans kept their layer's own bytes: none known
                e = {**e, "layer_bytes": {}}
            if set(e) != names:
                raise ValueError(f"trace event fields {sorted(e)} differ from {sorted(names)}")
            trace.events.append(SpanEvent(**e))
        if raw["memory"]["columns"] != ["t_s", *CATEGORIES]:
            raise ValueError(f"memory columns {raw['memory']['columns']} differ from {['t_s', *CATEGORIES]}")
        trace.samples = [MemorySample(row[0], tuple(row[1:])) for row in raw["memory"]["rows"]]
        return trace

    @classmethod
    def from_json(cls, path: Path | str) -> "Trace":
        return cls.from_dict(json.loads(Path(path).read_text()))

    # --- Chrome trace event format (chrome://tracing, ui.perfetto.dev) ---------------------------
    def to_chrome(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(self.chrome_events(), default=str))

    def chrome_events(self) -> dict[str, Any]:
        """Complete ("X") events per span on one track per thread, counters ("C") for device bytes and RSS."""
        pid = 1
        spans = self.spans()
        tids: dict[str, int] = {}
        for e in spans:
            tids.setdefault(e.thread, len(tids) + 1)
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
             "args": {"name": f"weight-streaming {self.meta.get('model', '')}".strip()}},
            *({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
              for name, tid in tids.items()),
        ]
        for e in spans:
            out.append({
                "name": f"{e.phase} {e.layer}", "cat": e.phase, "ph": "X", "pid": pid, "tid": tids[e.thread],
                "ts": _us(e.start_s), "dur": _us(e.duration_s),
                "args": {"step": e.step, "micro": e.micro, "ok": e.ok, "peak_bytes": e.peak_bytes,
                         **{f"peak_{c}": e.peak_breakdown[c] for c in CATEGORIES},
                         "host_rss_bytes": e.host_rss_bytes},
            })
            out.append({"name": "host RSS bytes", "ph": "C", "pid": pid, "ts": _us(e.end_s),
                        "args": {"rss": e.host_rss_bytes}})
        for s in list(self.samples):
            out.append({"name": "device bytes", "ph": "C", "pid": pid, "ts": _us(s.t_s),
                        "args": dict(zip(CATEGORIES, s.bytes, strict=True))})
        out.sort(key=lambda ev: ev.get("ts", -1))
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"meta": self.meta}}

    # --- views ------------------------------------------------------------------------------------
    def plot(self, path: Path | str, step: int | None = None) -> None:
        """PNG: device bytes stacked by category over time under the step's phases, with the budget and 16 B/param
        baseline lines, over lanes naming the unit on the device at each moment (`plot_trace`)."""
        plot_trace(self, Path(path), step)

    def table(self, step: int | None = None) -> Table:
        """A rich table, one row per layer: its peak and phase, what it held by category, time in each phase."""
        return trace_table(self, step)


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


# --- rendering: the PNG memory plot and the per-layer rich table -------------------------------------
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


def plot_trace(trace: Trace, path: Path | None, step: int | None = None) -> Figure:
    """The memory plot (written to `path` as PNG unless None), returned for a caller to inspect: above, device bytes
    stacked by category over time under bands of the step's phases (forward, backward, update); below, a lane of
    what runs on the device (each unit's forward, backward and update) and one of its loads and offloads."""
    # A bare Figure renders with Agg and touches no global pyplot state: safe inside a library and headless.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

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
    fig = Figure(figsize=(12, 7), dpi=110)
    ax, lanes = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": (4, 1.6), "hspace": 0.06})
    fig.subplots_adjust(left=0.07, right=0.9, top=0.94, bottom=0.08)
    lanes.set_xlim(0, max(end - start, 1e-9))
    spans = [e for e in trace.spans(step) if e.end_s >= start and e.start_s <= end]
    _phase_bands(ax, phase_runs(spans), start)
    ax.stackplot(t, stacks, labels=CATEGORIES, colors=[_COLORS[c] for c in CATEGORIES], step="post",
                 alpha=0.9)
    for label, value, color, style in lines:
        if value:
            ax.axhline(value / scale, color=color, linestyle=style, linewidth=1.2,
                       label=f"{label} {format_size(value)}")
    if baseline and peak:
        model = f"{trace.meta['model']}: " if trace.meta.get("model") else ""
        ax.set_title(f"{model}device peak {format_size(peak)}" + (f" in step {step}" if step is not None else "")
                     + f", {against_baseline(peak, baseline)} the 16 B/param baseline", fontsize=10)
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.08)  # room for the phase labels above the stack
    ax.legend(loc="upper left", fontsize=8, ncols=2, bbox_to_anchor=(0, 0.93))
    ax.grid(alpha=0.3)
    _unit_lanes(lanes, spans, start, end)
    lanes.legend(handles=[Patch(color=_PHASE_COLORS[p], label=p) for p in PHASES
                          if any(e.phase == p for e in spans)],
                 loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, title="phase", title_fontsize=7)
    lanes.set_xlabel("seconds" + (f" into step {step}" if step is not None else ""))
    if path is not None:
        fig.savefig(path, format="png")
    return fig


def against_baseline(peak: int, baseline: int) -> str:
    """How the streamed peak stands to the baseline: "5.0x below" when under it, "1.4x above" when over."""
    return f"{baseline / peak:.1f}x below" if peak <= baseline else f"{peak / baseline:.1f}x above"


# The phases that run on the device (the compute thread) and those that move bytes to and from it.
_COMPUTE = ("forward", "backward", "update", "generate")
_PHASE_COLORS = {"forward": "#4C9F70", "backward": "#D1495B", "update": "#EDAE49", "generate": "#00798C",
                 "load": "#7A7A7A", "offload": "#B0B0B0"}


def phase_runs(spans: list[SpanEvent]) -> list[tuple[str, float, float]]:
    """The compute spans merged into runs of one phase, in time order: (phase, start_s, end_s). A step reads as
    forward, backward, update (a fused update alternates with the backward, unit by unit)."""
    runs: list[list[Any]] = []
    for e in sorted((e for e in spans if e.phase in _COMPUTE), key=lambda e: e.start_s):
        if runs and runs[-1][0] == e.phase:
            runs[-1][2] = max(runs[-1][2], e.end_s)
        else:
            runs.append([e.phase, e.start_s, e.end_s])
    return [(phase, lo, hi) for phase, lo, hi in runs]


def _phase_bands(ax: Any, runs: list[tuple[str, float, float]], start: float) -> None:
    """Each run shaded in its phase's colour and named at the top of the plot where it is wide enough to read."""
    width = max(ax.get_xlim()[1], 1e-9)
    axis_px = ax.figure.get_figwidth() * ax.figure.dpi * ax.get_position().width
    for phase, lo, hi in runs:
        ax.axvspan(lo - start, hi - start, color=_PHASE_COLORS[phase], alpha=0.12, linewidth=0)
        if (hi - lo) / width * axis_px >= 6 * (len(phase) + 1):  # the name fits in its band (~6 px a letter)
            ax.text(lo - start + width / 400, 0.985, phase, transform=ax.get_xaxis_transform(), ha="left",
                    va="top", fontsize=8, color=_PHASE_COLORS[phase], fontweight="bold")


def _unit_lanes(ax: Any, spans: list[SpanEvent], start: float, end: float) -> None:
    """Three lanes: what computes on the device (each unit's forward, backward, update), what is loaded to it and
    what is offloaded from it, each span a bar in its phase's colour named by its unit where the bar has room."""
    lanes = {"device": [e for e in spans if e.phase in _COMPUTE], "load": [e for e in spans if e.phase == "load"],
             "offload": [e for e in spans if e.phase == "offload"]}
    width = max(end - start, 1e-9)
    for row, chosen in enumerate(lanes.values()):
        y = len(lanes) - 1 - row  # the first lane on top
        for e in chosen:
            lo, hi = max(e.start_s, start) - start, min(e.end_s, end) - start
            ax.broken_barh([(lo, max(hi - lo, width / 2000))], (y - 0.4, 0.8), facecolors=_PHASE_COLORS[e.phase],
                           edgecolor="white", linewidth=0.3)
            if hi - lo >= width / 25:
                ax.text((lo + hi) / 2, y, e.layer, ha="center", va="center", fontsize=7, clip_on=True)
            elif hi - lo >= width / 160:  # a narrow bar: its name stands upright
                ax.text((lo + hi) / 2, y, e.layer, ha="center", va="center", fontsize=6, rotation=90,
                        clip_on=True)
    ax.set_yticks(range(len(lanes)), list(reversed(lanes)), fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.grid(axis="x", alpha=0.3)


def _axis_unit(largest: float) -> tuple[str, int]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= scale:
            return unit, scale
    return "B", 1


def trace_table(trace: Trace, step: int | None = None) -> Table:
    """One row per layer: the device's peak while one of its spans was open (and in which phase), the most that
    layer itself held of each category at once (its weights while loaded, its gradient, its update chunk's state,
    its saved activations), and its time in each phase. The device's makeup at a peak is not the layer's: a
    block's peak falls in its update, when the device holds its optimizer state and no weights."""
    spans = trace.spans(step)
    phases = list(dict.fromkeys(e.phase for e in spans))
    rows: dict[str, dict[str, Any]] = {}
    for e in spans:
        row = rows.setdefault(e.layer, {"peak": -1, "phase": "", "held": {}, "time": {}})
        if e.peak_bytes > row["peak"]:
            row["peak"], row["phase"] = e.peak_bytes, e.phase
        for c, nbytes in e.layer_bytes.items():
            row["held"][c] = max(row["held"].get(c, 0), nbytes)
        row["time"][e.phase] = row["time"].get(e.phase, 0.0) + e.duration_s
    title = "device memory by layer" + (f", step {step}" if step is not None else "") \
        + (" (the peak step)" if step is not None and step == trace.peak_step() and len(trace.steps()) > 1 else "")
    table = Table(title=title, show_lines=False, caption="peak: the device's while the layer ran; categories: the "
                  "most the layer itself held", caption_justify="left")
    table.add_column("layer", style="bold")
    table.add_column("peak", justify="right")
    table.add_column("in", justify="left")
    for c in CATEGORIES:
        table.add_column(c, justify="right")
    for p in phases:
        table.add_column(f"{p} ms", justify="right")
    for layer, row in rows.items():
        held = [format_size(row["held"][c]) if c in row["held"] else "-" for c in CATEGORIES]  # "-": an old trace
        table.add_row(layer, format_size(row["peak"]), row["phase"], *held,
                      *(f"{row['time'][p] * 1e3:.1f}" if p in row["time"] else "" for p in phases))
    return table
