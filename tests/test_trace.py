"""Traces: spans and samples, the JSON schema of docs/TRACE_SCHEMA.md, Chrome trace, PNG plot, rich table."""
from __future__ import annotations

import json
import threading

import pytest
from rich.console import Console

from memory_model import CATEGORIES, PHASES, DeviceOutOfMemory, Ledger, Trace
from memory_model.trace import MemorySample, SpanEvent, plot_trace

META = {"model": "gptj-debug", "batch": 2, "seq": 16, "budget": "4KiB", "baseline_bytes": 16 * 300, "params": 300}


def _run(trace: Trace, ledger: Ledger, steps: int = 2) -> None:
    """A toy step: load, forward, backward (with a gradient) and update, two layers."""
    for step in range(1, steps + 1):
        acts = []
        for layer in ("block.0", "block.1"):
            with trace.span(layer, "load", step=step):
                w = ledger.allocate("weights", layer, 400, "weights")
            with trace.span(layer, "forward", step=step, micro=0):
                acts.append(ledger.allocate("activations", layer, 300))
                tmp = ledger.allocate("workspace", layer, 500)
                ledger.free(tmp)
            ledger.free(w)
        for layer, act in zip(("block.1", "block.0"), reversed(acts), strict=True):
            with trace.span(layer, "backward", step=step, micro=0):
                w = ledger.allocate("weights", layer, 400)
                g = ledger.allocate("gradients", layer, 400)
                ledger.free(act)
            with trace.span(layer, "offload", step=step):
                ledger.free(g)
                ledger.free(w)
        with trace.span("block.0", "update", step=step):
            o = ledger.allocate("optimizer", "block.0", 1200)
            ledger.free(o)


@pytest.fixture
def traced() -> tuple[Trace, Ledger]:
    ledger = Ledger(4096)
    trace = Trace(ledger, META)
    _run(trace, ledger)
    return trace, ledger


def test_spans_record_time_threads_and_window_peaks(traced) -> None:
    trace, ledger = traced
    assert len(trace.events) == 2 * (2 * 2 + 2 * 2 + 1)
    fwd = [e for e in trace.events if e.phase == "forward" and e.layer == "block.1" and e.step == 1][0]
    assert fwd.peak_bytes == 400 + 300 + 300 + 500  # block.1 weights, both activations, the scratch
    assert fwd.peak_breakdown["workspace"] == 500 and fwd.device_bytes["workspace"] == 0
    assert fwd.end_s >= fwd.start_s >= 0 and fwd.thread == threading.current_thread().name and fwd.ok
    assert fwd.host_rss_bytes > 0 and fwd.micro == 0
    assert max(e.peak_bytes for e in trace.events) == ledger.peak
    starts = [e.start_s for e in trace.spans()]
    assert starts == sorted(starts)
    assert trace.steps() == [1, 2] and {e.step for e in trace.spans(2)} == {2}


def test_samples_follow_every_change(traced) -> None:
    trace, ledger = traced
    assert trace.samples[0].bytes == (0,) * len(CATEGORIES)
    assert max(s.total for s in trace.samples) == ledger.peak
    assert trace.samples[-1].total == 0
    times = [s.t_s for s in trace.samples]
    assert times == sorted(times)
    trace.close()
    ledger.allocate("weights", "x", 1)
    assert trace.samples[-1].total == 0  # detached
    with pytest.raises(RuntimeError):
        with trace.span("x", "load"):
            pass


def test_failed_span_is_recorded_and_the_error_propagates() -> None:
    ledger = Ledger(100)
    trace = Trace(ledger, {})
    with pytest.raises(DeviceOutOfMemory):
        with trace.span("block.0", "forward", step=1):
            ledger.allocate("activations", "block.0", 200)
    (event,) = trace.events
    assert not event.ok and event.layer == "block.0"
    assert trace.summary()["failed_spans"] == 1


def test_unknown_phase_is_rejected(traced) -> None:
    trace, _ = traced
    with pytest.raises(ValueError, match="forward"):
        with trace.span("block.0", "fwd"):
            pass


def test_spans_from_two_threads(traced) -> None:
    trace, ledger = traced

    def io() -> None:
        with trace.span("block.0", "load", step=3):
            h = ledger.allocate("weights", "block.0", 10)
            ledger.free(h)

    worker = threading.Thread(target=io, name="io")
    with trace.span("block.1", "forward", step=3):
        worker.start()
        worker.join()
    assert {e.thread for e in trace.spans(3)} == {"io", threading.current_thread().name}
    chrome = trace.chrome_events()
    tids = {e["tid"] for e in chrome["traceEvents"] if e["ph"] == "X"}
    assert len(tids) == 2


# --- JSON ---------------------------------------------------------------------------------------------------
EVENT_TYPES = {"layer": str, "phase": str, "step": (int, type(None)), "micro": (int, type(None)), "start_s": float,
               "end_s": float, "thread": str, "ok": bool, "device_bytes": dict, "peak_bytes": int,
               "peak_breakdown": dict, "host_rss_bytes": int, "layer_bytes": dict}


def test_json_follows_the_documented_schema(traced, tmp_path) -> None:
    trace, _ = traced
    path = tmp_path / "trace.json"
    trace.to_json(path)
    raw = json.loads(path.read_text())
    assert raw["schema"] == "weight-streaming.trace" and raw["version"] == 2
    assert raw["categories"] == list(CATEGORIES) and raw["meta"] == META
    assert set(raw) == {"schema", "version", "meta", "categories", "events", "memory", "summary"}
    for event in raw["events"]:
        assert set(event) == set(EVENT_TYPES)
        for key, kind in EVENT_TYPES.items():
            assert isinstance(event[key], kind), key
        assert event["phase"] in PHASES
        assert set(event["device_bytes"]) == set(event["peak_breakdown"]) == set(event["layer_bytes"]) \
            == set(CATEGORIES)
        assert sum(event["peak_breakdown"].values()) == event["peak_bytes"]
    assert raw["memory"]["columns"] == ["t_s", *CATEGORIES]
    assert all(len(row) == 1 + len(CATEGORIES) for row in raw["memory"]["rows"])
    summary = raw["summary"]
    for key in ("spans", "steps", "duration_s", "peak_bytes", "peak_breakdown", "peak_at", "failed_spans",
                "time_by_phase_s", "host_rss_peak_bytes", "layers"):
        assert key in summary
    assert summary["peak_bytes"] == max(e["peak_bytes"] for e in raw["events"])


def test_json_roundtrip(traced, tmp_path) -> None:
    trace, _ = traced
    path = tmp_path / "trace.json"
    trace.to_json(path)
    again = Trace.from_json(path)
    assert again.events == trace.events and again.samples == trace.samples and again.meta == trace.meta
    assert again.summary() == trace.summary()
    with pytest.raises(RuntimeError):
        with again.span("block.0", "load"):
            pass


def test_json_rejects_other_files(tmp_path) -> None:
    with pytest.raises(ValueError, match="weight-streaming.trace"):
        Trace.from_dict({"schema": "something-else", "version": 1})
    with pytest.raises(ValueError, match="version"):
        Trace.from_dict({"schema": "weight-streaming.trace", "version": 99})


def test_meta_values_json_cannot_hold_are_written_as_text(tmp_path) -> None:
    trace = Trace(Ledger(None), {"store": tmp_path})
    trace.to_json(tmp_path / "t.json")
    assert Trace.from_json(tmp_path / "t.json").meta == {"store": str(tmp_path)}


# --- Chrome trace ---------------------------------------------------------------------------------------------------
def test_chrome_trace(traced, tmp_path) -> None:
    trace, _ = traced
    path = tmp_path / "trace.chrome.json"
    trace.to_chrome(path)
    raw = json.loads(path.read_text())
    events = raw["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(trace.events)
    for e in spans:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e) and e["dur"] >= 0
    counters = [e for e in events if e["ph"] == "C"]
    device = [e for e in counters if e["name"] == "device bytes"]
    assert len(device) == len(trace.samples) and set(device[0]["args"]) == set(CATEGORIES)
    assert any(e["name"] == "host RSS bytes" for e in counters)
    assert any(e["ph"] == "M" and e["name"] == "thread_name" for e in events)
    stamps = [e["ts"] for e in events if "ts" in e]
    assert stamps == sorted(stamps)


# --- plot, table, summary -----------------------------------------------------------------------------------------
def test_plot_writes_a_png(traced, tmp_path) -> None:
    trace, _ = traced
    for step in (None, 2):
        path = tmp_path / f"memory-{step}.png"
        trace.plot(path, step=step)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="step 7"):
        trace.plot(tmp_path / "none.png", step=7)


def _timed_step() -> Trace:
    """One step laid out in whole seconds: each unit loaded, then its forward; the backward in reverse with each
    gradient offloaded; the update. The device holds 100 B of weights per loaded unit."""
    trace = Trace(None, {**META, "baseline_bytes": 16 * 300})
    units, t, clock = ("embed", "block.0", "block.1", "head"), 0.0, []

    def span(layer: str, phase: str, length: float, thread: str = "MainThread") -> None:
        nonlocal t
        held = dict.fromkeys(CATEGORIES, 0) | {"weights": 100}
        trace.events.append(SpanEvent(layer, phase, 1, 0, t, t + length, thread, True, held, 100, held, 1, held))
        clock.append(t)
        t += length

    for unit in units:
        span(unit, "load", 0.5, "io")
        span(unit, "forward", 1.0)
    for unit in reversed(units):
        span(unit, "backward", 2.0)
        span(unit, "offload", 0.5, "io")
    for unit in units:
        span(unit, "update", 1.0)
    trace.samples = [MemorySample(at, (100, 0, 0, 0, 0)) for at in clock]
    return trace


def _texts(ax) -> list[str]:
    return [text.get_text() for text in ax.texts]


def test_plot_names_the_phases_and_the_unit_on_the_device(tmp_path) -> None:
    """The plot's upper axes shade and name the forward, backward and update; its lanes name each unit as it runs,
    is loaded and is offloaded; the legend gives each phase's colour."""
    trace = _timed_step()
    figure = plot_trace(trace, tmp_path / "memory.png", step=1)
    memory, lanes = figure.axes
    assert _texts(memory) == ["forward", "backward", "update"]
    bands = [(round(patch.get_x(), 6), round(patch.get_x() + patch.get_width(), 6)) for patch in memory.patches
             if patch.get_alpha() == 0.12]
    assert bands == [(0.5, 6.0), (6.0, 15.5), (16.0, 20.0)]  # each from its first compute span to its last
    named = _texts(lanes)
    units = ["embed", "block.0", "block.1", "head"]
    assert named == [*units, *reversed(units), *units, *units, *reversed(units)]  # device, then load, offload
    assert [label.get_text() for label in lanes.get_yticklabels()] == ["offload", "load", "device"]
    assert [t.get_text() for t in lanes.get_legend().get_texts()] == ["load", "forward", "backward", "offload",
                                                                      "update"]
    assert lanes.get_xlabel() == "seconds into step 1"
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("baseline, said", [(16 * 300, "48.0x below"), (20, "5.0x above")])
def test_plot_title_says_above_or_below_the_baseline(baseline, said) -> None:
    trace = _timed_step()
    trace.meta["baseline_bytes"] = baseline
    title = plot_trace(trace, None).axes[0].get_title()
    assert f"device peak 100 B, {said} the 16 B/param baseline" in title


def test_table_has_a_row_per_layer(traced) -> None:
    trace, _ = traced
    table = trace.table()
    assert table.row_count == 2
    headers = [c.header for c in table.columns]
    assert headers[:2] == ["layer", "peak"] and all(c in headers for c in CATEGORIES)
    assert {"load ms", "forward ms", "backward ms", "offload ms", "update ms"} <= set(headers)
    console = Console(record=True, width=200)
    console.print(trace.table(step=1))
    text = console.export_text()
    assert "block.0" in text and "block.1" in text


def test_table_gives_what_each_layer_itself_held(traced) -> None:
    """Each layer's category columns are its own bytes at their most (block.0's weights while loaded, its update's
    optimizer state), not the device's makeup at the layer's peak, whose weights may be another layer's or none."""
    trace, _ = traced
    console = Console(record=True, width=250)
    console.print(trace.table(step=1))
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in console.export_text().splitlines() if line.startswith("│")}
    assert rows["block.0"][2:7] == ["400 B", "400 B", "1.17 KiB", "300 B", "500 B"]
    assert rows["block.1"][2:7] == ["400 B", "400 B", "0 B", "300 B", "500 B"]
    # The peak column stays the device's, with the phase it fell in.
    assert [rows[layer][:2] for layer in ("block.0", "block.1")] == [["1.17 KiB", "forward"],
                                                                     ["1.46 KiB", "forward"]]
    update = next(e for e in trace.spans(1) if e.phase == "update")
    assert update.peak_breakdown["weights"] == 0 and update.layer_bytes["optimizer"] == 1200


def test_a_version_1_trace_still_reads(traced) -> None:
    """Traces written before spans kept their layer's own bytes: read, with those columns shown as unknown."""
    trace, _ = traced
    raw = trace.to_dict()
    raw["version"] = 1
    for event in raw["events"]:
        del event["layer_bytes"]
    old = Trace.from_dict(raw)
    assert old.summary() == trace.summary() and all(e.layer_bytes == {} for e in old.events)
    console = Console(record=True, width=250)
    console.print(old.table(step=1))
    row = next(line for line in console.export_text().splitlines() if line.startswith("│ block.0 "))
    assert [cell.strip() for cell in row.split("│")[4:9]] == ["-"] * len(CATEGORIES)


def test_summary(traced) -> None:
    trace, ledger = traced
    summary = trace.summary()
    assert summary["peak_bytes"] == ledger.peak
    assert sum(summary["peak_breakdown"].values()) == summary["peak_bytes"]
    assert summary["peak_at"]["layer"] in ("block.0", "block.1")
    assert summary["spans"] == len(trace.events) and summary["steps"] == [1, 2]
    assert summary["time_by_phase_s"]["forward"] == sum(  # measured equal: the same sum in the same order
        e.duration_s for e in trace.events if e.phase == "forward")
    assert set(summary["layers"]) == {"block.0", "block.1"}
    assert trace.summary(step=1)["steps"] == [1]


def test_keep_last_steps_bounds_a_long_run() -> None:
    ledger = Ledger(None)
    trace = Trace(ledger)
    for step in range(1, 21):
        with trace.span("block.0", "forward", step=step):
            handle = ledger.allocate("weights", "block.0", 100)
            ledger.free(handle)
        trace.keep_last_steps(3)
    # Every step peaks alike: the peak step is the earliest of them, kept beside the last 3.
    assert trace.steps() == [1, 18, 19, 20] and trace.peak_step() == 1
    recent = min(e.start_s for e in trace.events if e.step == 18)
    assert len([s for s in trace.samples if s.t_s >= recent]) <= 3 * 2 + 1
    assert len(trace.samples) <= 4 * 2 + 1


def test_the_peak_step_is_kept_until_a_higher_one_comes() -> None:
    ledger = Ledger(None)
    trace = Trace(ledger)
    for step, nbytes in enumerate([100, 900, 200, 300, 950, 100, 100], start=1):
        with trace.span("block.0", "forward", step=step):
            ledger.free(ledger.allocate("weights", "block.0", nbytes))
        trace.keep_last_steps(2)
        assert trace.peak_step() == (1 if step == 1 else 2 if step < 5 else 5)
    assert trace.steps() == [5, 6, 7]
    assert {s.total for s in trace.samples} - {0} == {950, 100}


def test_keep_every_nth_step_stays_bounded() -> None:
    """Every 5th step and the last 2: at most steps/5 + 2 steps; each kept step keeps its own memory samples."""
    ledger = Ledger(None)
    trace = Trace(ledger)
    for step in range(1, 24):
        with trace.span("block.0", "forward", step=step):
            handle = ledger.allocate("weights", "block.0", 100 * step)
            ledger.free(handle)
        trace.keep_last_steps(2, every=5)
    assert trace.steps() == [5, 10, 15, 20, 22, 23]
    assert sorted({s.total for s in trace.samples} - {0}) == [500, 1000, 1500, 2000, 2200, 2300]
    with pytest.raises(ValueError, match="every >= 0"):
        trace.keep_last_steps(2, every=-1)


def test_every_place_names_the_same_peak_through_the_cli(tiny_setup, tmp_path, capsys) -> None:
    """A disk-tier run whose first step clips: its fused update is undone and made again after the backward, the
    run's highest device peak. The summary `streamer train` prints, `streamer trace` (its default step and any
    other), metrics.jsonl (each step's own peak) and docs/TRACE_SCHEMA.md (which steps a trace keeps) agree."""
    from pathlib import Path

    from memory_model import format_size
    from streamer.cli.main import main
    from streamer.run_dir import RunDir
    run = tmp_path / "run"
    argv = ["train", "--model", tiny_setup / "config.json", "--data", tiny_setup / "train.txt", "--tokenizer",
            tiny_setup / "tok", "--run-dir", run, "--steps", 4, "--batch", 4, "--seq", 32, "--dtype", "fp32",
            "--store", "disk", "--max-grad-norm", 0.5, "--trace-steps", 1, "--sample-tokens", 0, "--eval-every", 0]
    assert main([str(a) for a in argv]) == 0
    printed = capsys.readouterr().out
    peaks = {r["step"]: r["device_peak_bytes"] for r in RunDir(run).read_metrics() if "loss" in r}
    top = max(peaks, key=lambda step: (peaks[step], -step))
    assert peaks[top] > peaks[4], peaks  # the run's peak is not the last step's: each place must say which
    line = f"device peak {format_size(peaks[top])} at step {top}, the highest of steps 1..4"
    assert line in " ".join(printed.split()) and f"step {top} (the peak step)" in printed

    assert main(["trace", str(run), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["step"], shown["peak_step"], shown["peak_bytes"]) == (top, top, peaks[top])
    assert main(["trace", str(run), "--step", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"] == peaks[4]
    peak_plot = (run / "memory.png").read_bytes()
    assert main(["trace", str(run), "--step", "4"]) == 0
    other = " ".join(capsys.readouterr().out.split())
    # Each block's weights column is its own fp32 weights (it read 0 B: the device's makeup at the block's peak,
    # which falls in its fused update).
    from conftest import TINY_RUN_MODEL
    weights = format_size(4 * TINY_RUN_MODEL.params().device("block.0"))
    for block in ("block.0", "block.1"):
        assert f"│ {block} │" in other and other.split(f"│ {block} │")[1].split("│")[2].strip() == weights, other
    # One step's plot goes to a file of its own, named where it is said; the peak step's plot stays.
    assert f"plot: {run / 'memory-step4.png'}" in other and (run / "memory-step4.png").stat().st_size > 10_000
    assert (run / "memory.png").read_bytes() == peak_plot
    assert (f"device peak of step 4: {format_size(peaks[4])} (the highest, {format_size(peaks[top])}, is at step "
            f"{top})") in other
    # --trace-steps 1 keeps the last step and the peak step, as the schema says.
    assert Trace.from_json(run / "trace.json").steps() == sorted({top, 4})
    schema = " ".join((Path(__file__).parents[1] / "docs" / "TRACE_SCHEMA.md").read_text().split())
    assert "except the last `trace_steps` (default 8), the step with the highest device peak" in schema
    assert "`device_peak_bytes` that `metrics.jsonl` logs for that step" in schema
