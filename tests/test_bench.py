"""`streamer bench`: the harness runs end to end (`--quick`), and its pieces compute what they claim.

These check the harness, not the numbers: `--quick` measures a tiny model and says so in its report.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from layers import PRESETS, ConfigError, GPTJConfig, ModelConfig
from layers.moe.config import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
from benchmarks import bench
from benchmarks.compare import HF_FP32, STREAM_RAM, Context, host_memory
from benchmarks.machine import ModelChoice, fitted_width, matmul_peaks, pick_scale_model, raw_disk
from benchmarks.report import Section
from benchmarks.runs import Runner, others_cores, merge
from benchmarks.worker import Measured, RunSpec, _union_s
from memory_model.units import Precision
from streamer.advice import step_host
from streamer.cli.launch import MALLOC_ENV, PROCESS_ENV
from streamer.config import TrainerConfig
from streamer.runtime.hardware import DtypeChoice, resolve_compute_dtype

FP32 = DtypeChoice("fp32", "compute dtype fp32 (--dtype fp32)")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.slow
def test_quick_run_writes_every_section(tmp_path):
    """`streamer bench` as the README shows it, at --quick: the documented-commands test leaves it to this one."""
    out = tmp_path / "BENCH.md"
    done = subprocess.run([sys.executable, "-m", "streamer", "bench", "--quick", "--output", str(out), "--workdir",
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    text = out.read_text()
    for title in ("Compute dtype of each run", "1. Streaming overhead", "2. vs Hugging Face", "3. vs DeepSpeed",
                  "4. Disk tier", "5. Utilisation", "6. Scale", "7. Memory", "Planner vs measured", "Data parallel",
                  "On a CUDA GPU", "LoRA vs full fine-tuning", "QLoRA vs transformers + bitsandbytes + PEFT",
                  "Half the bytes", "The update: AdamW vs torch",
                  "8. Host memory: planned vs measured peak RSS", "## Targets"):
        assert title in text
    # The opt-in precisions' disk-tier run moves what docs/CLI.md says: under 7 read and 5 written B/param.
    half = re.search(r"^\| ours streamed, disk tier, bf16 master \+ int8 moments \| [^|]+ \|[^|]+\|[^|]+\|[^|]+\| "
                     r"([\d.]+) / ([\d.]+) \|", text, re.M)
    assert half and float(half.group(1)) <= 7 and float(half.group(2)) <= 5, text
    assert "Both leave the weights bit for bit equal" in text  # the update's AdamW is torch's, chunk by chunk
    assert "command: `streamer bench --quick --output" in text
    assert "CPU: " in text and "torch " in text
    assert "unmeasured (no GPU in this run; `make gpu-check`" in text or "GPU: none" not in text
    # Each run says its compute dtype and why: ours follow --dtype auto on this CPU, the HF pair is fixed.
    ours = resolve_compute_dtype("cpu")
    # (The reason quotes the probe's rates, measured again in the bench's own process.)
    assert f"| {STREAM_RAM} | {ours.dtype} | compute dtype {ours.dtype}: " in text
    assert f"| {HF_FP32} | fp32 | fixed" in text
    # Every contender of the quick run produced timed steps (none failed, none silently missing).
    assert "failed:" not in text
    assert "not run: --quick" in text  # DeepSpeed and data parallel are skipped, and say why
    # Stores and logs are removed after each block: the scale run's store does not linger.
    assert not list((tmp_path / "work" / "runs").glob("*/store"))
    # The scale run alone, QLoRA, into that report: its own section and targets go in, the other sections stay.
    others = text.split("## 6. Scale")[0].split("## Targets")[1].split("\n## ", 1)[1]
    done = subprocess.run([sys.executable, "-m", "streamer", "bench", "--quick", "--only-scale", "--scale-qlora",
                           "--scale-model", "llama-3.1-8b", "--output", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    merged = out.read_text()
    assert others in merged and "## 6. Scale on this machine (disk tier): gptj-debug" in merged
    section = merged.split("## 6. Scale on this machine (disk tier): llama-debug, QLoRA r=8")[1].split("\n## ")[0]
    assert "QLoRA r=8: nf4 base, double quant" in section and "compute floor" in section
    assert re.search(r"^- `streamer bench --quick .*--only-scale.*`: CPU", section, re.M)
    assert re.search(r"^- 6\. llama-debug, QLoRA r=8: step <= 1\.2x max\(I/O floor, compute floor\): "
                     r"(NOT met|met|unmeasured) \([\d.]+x: I/O floor [\d.]+", merged, re.M), merged  # tiny: either
    assert re.search(r"^- 6\. llama-debug, QLoRA r=8: peak RSS <= 6.00 GiB: (NOT )?met", merged, re.M)
    assert "- 6. gptj-debug: peak RSS within 10% of the plan" in merged  # the full run's targets stay


def test_our_workers_run_with_the_streamer_commands_process_settings_and_the_peers_without(tmp_path, monkeypatch):
    """Our contenders' processes get what `streamer` sets as it starts (glibc's mmap threshold among them: without
    it a run keeps freed buffers the plan does not price); a peer's process runs as its users run it."""
    for name in (*PROCESS_ENV, *MALLOC_ENV):
        monkeypatch.delenv(name, raising=False)
    runner = Runner(tmp_path, console=_Quiet(), child_timeout_s=1)
    ours = runner._env(RunSpec(label="ours", contender="stream", model={}, batch=1, seq=8), 0, 0)
    theirs = runner._env(RunSpec(label="theirs", contender="hf-qlora", model={}, batch=1, seq=8), 0, 0)
    assert ours["MALLOC_MMAP_THRESHOLD_"] == str(2**20) and ours["OMP_WAIT_POLICY"] == "PASSIVE"
    assert not {*PROCESS_ENV, *MALLOC_ENV} & set(theirs)


def test_worker_reports_a_failure_instead_of_numbers(tmp_path):
    """A contender that cannot run is recorded with its error, never with made-up times."""
    cfg = GPTJConfig.preset("gptj-debug")
    spec = RunSpec(label="broken", contender="stream", model={**dataclasses.asdict(cfg), "n_head": 3}, batch=1, seq=8,
                   warmup=0, steps=1)
    result = Runner(tmp_path, console=_Quiet(), child_timeout_s=120).block(spec, 0)
    assert not result.ok and result.step_s == []
    assert "n_head" in result.error or "divisible" in result.error


def test_worker_measures_our_streamed_trainer(tmp_path):
    cfg = GPTJConfig.preset("gptj-debug")
    spec = RunSpec(label="ours", contender="stream", model=dataclasses.asdict(cfg), batch=1, seq=16, tier="disk",
                   warmup=1, steps=2)
    result = Runner(tmp_path, console=_Quiet(), child_timeout_s=300).block(spec, 0)
    assert result.ok, result.error
    assert len(result.step_s) == 2 and len(result.warmup_s) == 1 and all(t > 0 for t in result.step_s)
    assert result.ledger_peak_bytes > 0 and result.step_rss_peak_bytes > 0
    assert {"forward", "backward", "update", "load", "offload", "io_busy"} <= set(result.phases[0])
    assert result.io[0]["wchar"] > 0  # a disk-tier step writes its new state
    assert result.others_cores >= 0.0
    # The planner's host peak for this very run's settings, and the process's own high-water mark over the run.
    tc = TrainerConfig.of(dtype=spec.dtype, store="disk")
    assert result.planned_host_bytes == step_host(cfg, tc, tc.plan_config(1, 16)).total
    assert result.process_rss_peak_bytes >= result.step_rss_peak_bytes
    # Each unit's compute spans (the scale run's compute floor is built from them) and where the RSS peaked.
    units = result.unit_compute[-1]  # the last timed step
    assert set(units) == set(cfg.unit_names()) and all(s > 0 for s in units.values())
    assert re.match(r"(embed|block\.\d+|head) \w+, step \d+: [\d.]+ GiB$", result.rss_peak_at), result.rss_peak_at


def test_the_host_section_sets_each_runs_measured_peak_beside_its_plan():
    """BENCHMARKS.md's host table: the cells are the runs' own figures, a run without a plan says so, and the
    verdict is the measured peak within 10% of the planned one."""
    ours = RunSpec(label="ours", contender="stream", model={}, batch=1, seq=8)
    theirs = RunSpec(label="theirs", contender="hf", model={}, batch=1, seq=8)
    close = dataclasses.replace(_measured("ours", [1.0], 900 * 2**20), process_rss_peak_bytes=1050 * 2**20,
                                planned_host_bytes=1000 * 2**20)
    results = {"ours": merge(ours, [close]),
               "theirs": merge(theirs, [dataclasses.replace(_measured("theirs", [1.0], 2**30),
                                                            process_rss_peak_bytes=2**31)])}
    ctx = Context(results=results, peaks=None, disk={}, plans={}, scale=None, compute=FP32)
    outcome = host_memory(ctx)
    text = outcome.section.markdown()
    assert "| ours | 1000 MiB | 1.03 GiB | 900 MiB | 1.05x | met |" in text, text
    assert "| theirs | — (not ours: no plan) | 2.00 GiB | 1.00 GiB | — | unmeasured |" in text, text
    assert outcome.targets == ("host peak RSS within 10% of the plan, our runs: met (1/1)",)
    far = {"ours": merge(ours, [dataclasses.replace(close, process_rss_peak_bytes=1200 * 2**20)])}
    assert "NOT met" in host_memory(dataclasses.replace(ctx, results=far)).targets[0]


def _scale_context(model: str, chosen: ModelChoice, step_s: float, rss: int, planned: int,
                   floor_units: dict[str, float]) -> Context:
    """A scale run and its compute floor's run as the bench merges them, with a raw disk of 1 GB/s."""
    from benchmarks.compare import SCALE, SCALE_FLOOR
    from benchmarks.machine import DiskBandwidth, Peaks, ScalePick
    spec = RunSpec(label=SCALE, contender="stream", model=chosen.config.to_dict(), batch=1, seq=512, tier="disk",
                   moment_dtype="int8", master_dtype="bf16")
    usage = [{"minor_faults": 850_000, "major_faults": 12, "user_s": 90.0, "system_s": step_s / 4},
             {"minor_faults": 870_000, "major_faults": 8, "user_s": 110.0, "system_s": step_s / 2}]
    scale_run = dataclasses.replace(_measured(SCALE, [step_s, step_s], rss), planned_host_bytes=planned,
                                    io=[{"read_bytes": 10**10, "write_bytes": 10**10}] * 2, rusage=usage)
    short = chosen.config.resized(num_hidden_layers=2, vocab_size=chosen.config.vocab_size // 8)
    floor = dataclasses.replace(_measured(SCALE_FLOOR, [1.0, 1.0], rss), unit_compute=[floor_units] * 2)
    floor_spec = dataclasses.replace(spec, label=SCALE_FLOOR, tier="ram", model=short.to_dict())
    return Context(results={SCALE: merge(spec, [scale_run]), SCALE_FLOOR: merge(floor_spec, [floor])},
                   peaks=Peaks(1e12, 1e11, 64), plans={}, compute=FP32,
                   disk={SCALE: DiskBandwidth(where="x", nbytes=1, repeats=1, read_bytes_per_s=1e9,
                                              write_bytes_per_s=1e9, shared_bytes_per_s=1e9)},
                   scale=ScalePick(model, chosen, 10**12, 10**12, ((chosen, True),)))


def test_scale_step_is_held_to_its_floors_and_its_rss_to_the_plan():
    """Section 6: the I/O floor is what reached the disk over its rate; the compute floor scales the short RAM-tier
    run's median block to the model's blocks and its embedding and head to the model's vocabulary; the step is
    held to 1.2x the higher floor and the run's peak RSS to 10% of its plan, by the model asked for only."""
    from benchmarks.compare import SCALE_FLOOR, compute_floor_s, scale
    model = "llama-3.1-8b"
    full = ModelChoice(model, PRESETS[model], Precision("bf16", "bf16", "int8"))
    units = {"embed": 0.5, "block.0": 2.0, "block.1": 3.0, "head": 1.5}
    ctx = _scale_context(model, full, 100.0, 7 * 2**30, int(7.2 * 2**30), units)
    floor = compute_floor_s(ctx.results[SCALE_FLOOR], full.config)
    assert floor == pytest.approx((0.5 + 1.5) * full.config.vocab_size / (full.config.vocab_size // 8)
                                  + 2.5 * 32, rel=1e-3)  # compute-bound: 96 s against the disk's 20 s
    outcome = scale(ctx)
    row = dict(zip(outcome.section.columns, outcome.section.rows[0], strict=True))
    assert row["CPU: user / system / faults"] == "100 s / 37.5 s / 860k"  # medians of the two timed steps
    targets = {t.split(": ")[1]: t for t in outcome.targets}
    assert targets["step <= 1.2x max(I/O floor, compute floor)"].split(": ")[2].startswith("met (1.04x")
    assert targets["peak RSS within 10% of the plan"].split(": ")[2].startswith("met (7.00 GiB measured")
    slow = {t.split(": ")[1]: t for t in scale(_scale_context(model, full, 130.0, 7 * 2**30, 6 * 2**30,
                                                              units)).targets}
    assert "NOT met (1.35x" in slow["step <= 1.2x max(I/O floor, compute floor)"]
    assert "NOT met" in slow["peak RSS within 10% of the plan"]
    below = {t.split(": ")[1]: t for t in scale(_scale_context(model, full, 50.0, 7 * 2**30, 7 * 2**30,
                                                               units)).targets}
    assert "unmeasured (0.52x" in below["step <= 1.2x max(I/O floor, compute floor)"]  # 96 s floor, 50 s step
    assert "no floor: not judged" in below["step <= 1.2x max(I/O floor, compute floor)"]
    width = fitted_width(full, full.disk_bytes // 2)
    small = scale(_scale_context(model, width, 90.0, 2**30, 2**30, units)).targets
    assert all("NOT met" in t for t in small if "floor" in t or "plan" in t)  # a width is not the model


def test_a_qlora_scale_run_is_the_4bit_base_of_the_model_asked_for():
    """--scale-qlora: the scale run's store is the model's frozen base in 4 bits, only read (the disk holds it once),
    or its width where the disk does not; its section and targets carry QLoRA in their names, held to 6 GiB."""
    from benchmarks.compare import scale
    settings = bench.Settings.from_args(_parse(["--scale-qlora", "--scale-model", "llama-3.1-8b"]))
    qlora = bench._scale_candidates(settings, 10**13)
    assert [c.qlora_rank for c in qlora] == [8] and qlora[0].config == PRESETS["llama-3.1-8b"]
    full = ModelChoice("llama-3.1-8b", PRESETS["llama-3.1-8b"], Precision("bf16", "bf16", "int8"))
    assert qlora[0].disk_bytes == qlora[0].store_bytes < full.store_bytes / 3
    assert "QLoRA r=8: nf4 base, double quant" in qlora[0].describe()
    assert bench._scale_candidates(settings, qlora[0].disk_bytes // 2)[1].name.startswith("llama-3.1-8b width, ")
    units = {"embed": 0.1, "block.0": 1.0, "block.1": 1.0, "head": 0.3}
    outcome = scale(_scale_context("llama-3.1-8b", qlora[0], 60.0, 5 * 2**30, 5 * 2**30, units))
    assert outcome.section.title == "6. Scale on this machine (disk tier): llama-3.1-8b, QLoRA r=8"
    assert outcome.targets[0] == "6. llama-3.1-8b, QLoRA r=8: peak RSS <= 6.00 GiB: met (8.03B, 5.00 GiB)"
    assert not any("stretch" in t or ">= 3B" in t for t in outcome.targets)


def test_a_partial_run_replaces_only_its_own_sections_and_targets(tmp_path):
    """`--only-scale --output` an existing report: a section of the same title and targets of the same name are
    replaced, a new section goes after the last of its number, and the rest of the file stays as it was."""
    from benchmarks.report import update_markdown, write_markdown
    path = tmp_path / "B.md"
    write_markdown(path, ["CPU: x"], "streamer bench", 60.0, ["5. a: met (1)", "6. old: NOT met (2)"],
                   [Section("5. Five", ("a",), (("1",),)), Section("6. Scale: old", ("a",), (("2",),)),
                    Section("7. Seven", ("a",), (("3",),))])
    update_markdown(path, "`cmd` on x", ["6. new: met (4)"], [Section("6. Scale: new", ("a",), (("4",),))])
    update_markdown(path, "`cmd2` on x", ["6. new: met (5)", "6. old: met (6)"],
                    [Section("6. Scale: new", ("a",), (("5",),))])
    text = path.read_text()
    titles = re.findall(r"^## (.*)$", text, re.M)
    assert titles == ["Machine and command", "Targets", "5. Five", "6. Scale: old", "6. Scale: new", "7. Seven"]
    assert re.findall(r"^- (\d\. \w+: .*)$", text, re.M) == ["5. a: met (1)", "6. new: met (5)", "6. old: met (6)"]
    assert "| 5 |" in text and "| 4 |" not in text and "| 2 |" in text and "| 3 |" in text
    assert "- `cmd2` on x" in text.split("## 6. Scale: new")[1] and "`cmd` on x" not in text
    assert "- command: `streamer bench`" in text
    # A new section without a number goes where a full run's order puts it: after the last one before it there.
    update_markdown(path, "`cmd3` on x", [], [Section("QLoRA: new", ("a",), (("7",),))],
                    order=["5. Five", "LoRA: absent", "QLoRA: new", "6. Scale: old", "7. Seven"])
    update_markdown(path, "`cmd4` on x", [], [Section("Elsewhere", ("a",), (("8",),))], order=["5. Five"])
    assert re.findall(r"^## (.*)$", path.read_text(), re.M)[2:] == [
        "5. Five", "QLoRA: new", "6. Scale: old", "6. Scale: new", "7. Seven", "Elsewhere"]


class _Quiet:
    def print(self, *_: object, **__: object) -> None:
        pass


def _measured(label: str, steps: list[float], rss: int, ok: bool = True) -> Measured:
    return Measured(label, ok=ok, error="" if ok else "boom", params=10, setup_s=1.0, step_s=steps,
                    step_rss_peak_bytes=rss, io=[{"rchar": 4}] * len(steps), phases=[{"load": 1.0}] * len(steps))


def test_merge_pools_steps_and_takes_the_highest_peak():
    spec = RunSpec(label="a", contender="hf", model={}, batch=2, seq=8, steps=3)
    merged = merge(spec, [_measured("a", [3.0, 1.0, 2.0], 100), _measured("a", [5.0, 4.0, 6.0], 300)])
    assert merged.ok and merged.step_s == (3.0, 1.0, 2.0, 5.0, 4.0, 6.0)
    assert merged.median_s == 3.5 and merged.tokens_per_s == 16 / 3.5
    assert merged.rss_peak_bytes == 300 and merged.io == {"rchar": 4}
    failed = merge(spec, [_measured("a", [1.0], 1), _measured("a", [], 0, ok=False)])
    assert not failed.ok and failed.error == "boom" and failed.median_s is None


def test_abba_order_reverses_every_round(tmp_path, monkeypatch):
    order = []
    runner = Runner(tmp_path, console=_Quiet(), child_timeout_s=1)
    monkeypatch.setattr(runner, "block", lambda spec, r: order.append((spec.label, r)) or _measured(
        spec.label, [1.0], 1))
    specs = [RunSpec(label=x, contender="hf", model={}, batch=1, seq=1) for x in "ABC"]
    runner.compare(specs, rounds=2)
    assert order == [("A", 0), ("B", 0), ("C", 0), ("C", 1), ("B", 1), ("A", 1)]


def test_a_bracket_runs_the_reference_before_and_after_and_pools_it(tmp_path, monkeypatch):
    """The scale run's compute floor: one block before the scale run and one after, its steps pooled."""
    order = []
    runner = Runner(tmp_path, console=_Quiet(), child_timeout_s=1)
    monkeypatch.setattr(runner, "block", lambda spec, r: order.append((spec.label, r)) or _measured(
        spec.label, [1.0 + len(order)], 1))
    floor, scale_spec = (RunSpec(label=x, contender="hf", model={}, batch=1, seq=1) for x in ("floor", "scale"))
    results = runner.bracket(floor, scale_spec)
    assert order == [("floor", 0), ("scale", 0), ("floor", 1)]
    assert results["floor"].step_s == (2.0, 4.0) and results["scale"].step_s == (3.0,)


def test_others_load_is_cpu_time_not_ours_over_wall_time():
    # 10 s of wall time; the machine used 25 CPU-seconds, the bench 15 of them: others kept 1 core busy.
    assert others_cores((0.0, 100.0, 50.0), (10.0, 125.0, 65.0)) == 1.0  # exact in binary floating point
    assert others_cores((0.0, 100.0, 50.0), (10.0, 110.0, 65.0)) == 0.0  # tick rounding never goes negative


def test_union_of_overlapping_spans():
    class S:
        def __init__(self, a: float, b: float) -> None:
            self.start_s, self.end_s = a, b
    assert _union_s([S(0, 2), S(1, 3), S(5, 6)]) == 4.0  # exact: integer-valued spans
    assert _union_s([]) == 0.0


def test_scale_pick_takes_the_largest_store_that_fits():
    four = ModelChoice("gptj-4b", GPTJConfig.preset("gptj-4b"))
    small = ModelChoice("gptj-2.7b", GPTJConfig.preset("gptj-2.7b"))
    # 12 B/param: fp32 master, two fp32 moments; no compute copy (loads cast the master), whatever the dtype.
    assert four.store_bytes == 12 * four.params == ModelChoice("x", four.config, Precision("fp32")).store_bytes
    assert ModelChoice("x", four.config, Precision("bf16", moments="bf16")).store_bytes == 8 * four.params
    # A bf16 master and int8 moments: 2 + 2 x (1 + 4 / 256) B/param, from the store's own layout.
    half = ModelChoice("x", four.config, Precision("bf16", "bf16", "int8"))
    assert 4 * four.params < half.store_bytes <= 4.04 * four.params
    # A fused step keeps the previous generation until it commits: twice the store at its largest.
    assert four.disk_bytes == 2 * four.store_bytes
    # After the backward: one store, its gradient files (4 B/param) and one unit's second generation.
    journaled = ModelChoice("gptj-4b", four.config, update_timing="after-backward")
    block = four.store_bytes // four.config.n_layer
    assert 16 * four.params < journaled.disk_bytes < 16 * four.params + 2 * block < four.disk_bytes
    assert pick_scale_model("gptj-4b", [four, journaled], free=10**12,
                            budget=journaled.disk_bytes).chosen is journaled
    pick = pick_scale_model("gptj-4b", [four, small], free=10**12, budget=small.disk_bytes + 1)
    assert pick.chosen is small and [fits for _, fits in pick.considered] == [False, True]
    fitted = fitted_width(four, small.disk_bytes)
    assert fitted is not None and fitted.disk_bytes <= small.disk_bytes
    deeper = dataclasses.replace(fitted.config, n_layer=fitted.config.n_layer + 1)
    assert ModelChoice("y", deeper).disk_bytes > small.disk_bytes
    assert fitted_width(four, 1000) is None
    # The width keeps the precisions it was fitted in: a bf16 master and int8 moments hold about 3x the layers.
    quarter = four.disk_bytes // 4
    thick, thin = fitted_width(four, quarter), fitted_width(half, quarter)
    assert thick is not None and thin is not None and thin.precision == Precision("bf16", "bf16", "int8")
    assert four.config.n_layer > thin.config.n_layer > 2 * thick.config.n_layer and thin.disk_bytes <= quarter


@pytest.mark.parametrize("model, scale_model, family", [(None, "gptj-6b", "gptj"),
                                                        ("llama-350m", "llama-3.1-8b", "llama"),
                                                        ("qwen2.5-7b", "qwen2.5-7b", "qwen2")])
def test_scale_run_takes_the_largest_preset_of_the_models_family(model, scale_model, family):
    """Without --scale-model, the scale run is the largest preset of --model's family (GPT-J-6B by default);
    every candidate, down to the width fitted to a small disk, is of that family, the model asked for first."""
    settings = bench.Settings.from_args(_parse(["--model", model] if model else []))
    assert settings.scale_model == scale_model
    asked = ModelChoice(scale_model, PRESETS[scale_model], Precision("bf16", "bf16", "int8"))
    budget = asked.disk_bytes // 2  # too small for the model in any state: only smaller ones fit
    candidates = bench._scale_candidates(settings, budget)
    assert {c.config.model_type for c in candidates} == {family}
    assert candidates[0].name == scale_model and candidates[0].config == PRESETS[scale_model]
    assert [c.params for c in candidates] == sorted((c.params for c in candidates), reverse=True)
    pick = pick_scale_model(settings.scale_model, candidates, free=10**13, budget=budget)
    # Where the disk holds half the model, its width with int8 moments is the largest that fits.
    assert pick.chosen is not None and pick.chosen.name.startswith(f"{scale_model} width, ")
    assert pick.chosen.precision.moments == "int8" and pick.chosen.disk_bytes <= budget


def test_scale_model_is_asked_for_and_quick_takes_its_familys_smallest(tmp_path):
    """--scale-model names the scale run's model (a preset or a config.json) whatever --model is; --quick runs
    the smallest preset of its family."""
    assert bench.Settings.from_args(_parse(["--scale-model", "llama-3.1-8b"])).scale_model == "llama-3.1-8b"
    quick = bench.Settings.from_args(_parse(["--quick", "--only-scale", "--scale-model", "llama-3.1-8b"]))
    assert quick.scale_model == "llama-debug"
    assert [c.name for c in bench._scale_candidates(quick, 10**12)] == ["llama-debug"]
    assert bench.Settings.from_args(_parse(["--quick"])).scale_model == "gptj-debug"
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PRESETS["llama-debug"].adapter().to_hf()))
    settings = bench.Settings.from_args(_parse(["--scale-model", str(config)]))
    assert bench._scale_candidates(settings, 10**15)[0].config == PRESETS["llama-debug"]


@pytest.mark.parametrize("flag", ["--model", "--scale-model"])
def test_a_model_flag_naming_nothing_is_one_line_naming_the_flag(flag):
    with pytest.raises(ConfigError) as info:
        bench.Settings.from_args(_parse([flag, "nope"]))
    message = str(info.value)
    assert message.startswith(f"{flag} 'nope' is neither a preset") and "\n" not in message


@pytest.mark.parametrize("model", ["llama-3.1-8b", "gptj-6b"])
def test_scale_targets_hold_the_model_asked_for_to_its_own_limits(model):
    """Section 6 names the model asked for; its stated step and RSS limits are met only by that model itself,
    never by the smaller width that ran where the disk did not hold it."""
    from benchmarks.compare import SCALE, SCALE_TARGETS, Context, scale
    from benchmarks.machine import Peaks, ScalePick
    from benchmarks.runs import merge

    limit_s, limit_rss = SCALE_TARGETS[model]
    full = ModelChoice(model, PRESETS[model], Precision("bf16", "bf16", "int8"))
    width = fitted_width(full, full.disk_bytes // 2)

    def targets(chosen: ModelChoice, step_s: float, rss: int) -> list[str]:
        spec = RunSpec(label=SCALE, contender="stream", model=chosen.config.to_dict(), batch=1, seq=512,
                       tier="disk", moment_dtype="int8", master_dtype="bf16")
        ctx = Context(results={SCALE: merge(spec, [_measured(SCALE, [step_s, step_s], rss)])},
                      peaks=Peaks(1e12, 1e11, 64), disk={}, plans={}, compute=FP32,
                      scale=ScalePick(model, chosen, 10**12, 10**12, ((chosen, True),)))
        outcome = scale(ctx)
        assert f"stretch: {model}" in outcome.section.markdown()
        return [line for line in outcome.targets if line.startswith(f"6. {model}: step <= {limit_s:g} s")]

    assert targets(full, limit_s - 1, limit_rss - 1)[0].split(": ")[2].startswith("met")
    assert "NOT met" in targets(full, limit_s + 1, limit_rss - 1)[0]
    assert "NOT met" in targets(full, limit_s - 1, limit_rss + 1)[0]
    assert "NOT met" in targets(width, limit_s / 2, limit_rss // 2)[0]  # a width is not the model


def test_disk_measurements_leave_no_file_behind(tmp_path):
    """The raw disk measurements delete their files and close them: a deleted file still open keeps its blocks,
    and the scale run, which sizes its model by the free disk after them, would see less than there is."""
    opened = len(os.listdir("/proc/self/fd"))
    measured = raw_disk(tmp_path, 2**20, repeats=2)
    assert measured.read_bytes_per_s > 0 and measured.shared_bytes_per_s > 0
    assert list(tmp_path.iterdir()) == [] and len(os.listdir("/proc/self/fd")) == opened


def test_section_renders_markdown_and_rejects_ragged_rows():
    section = Section("T", ("a", "b"), (("x|y", "1"),), ("note",))
    text = section.markdown()
    assert "| x\\|y | 1 |" in text and "- note" in text
    with pytest.raises(ValueError):
        Section("T", ("a", "b"), (("only one",),))


def test_spec_round_trips_and_validates():
    spec = RunSpec(label="a", contender="deepspeed", model={"n_layer": 2}, batch=1, seq=4, tier="disk")
    assert RunSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError):
        RunSpec(label="a", contender="jax", model={}, batch=1, seq=4)


def test_command_lists_only_changed_options():
    args = _parse(["--quick", "--output", "x y.md"])
    assert bench._command(args) == "streamer bench --quick --output 'x y.md'"
    assert bench._command(_parse([])) == "streamer bench"
    # A flag whose option name differs from the flag: the command a user can paste back.
    assert bench._command(_parse(["--untimed-steps", "1"])) == "streamer bench --untimed-steps 1"


def test_quick_writes_no_report_unless_told_where():
    """The repository's BENCHMARKS.md holds a measured run; a smoke run must not replace it by default."""
    assert bench._output(_parse(["--quick"])) is None
    assert bench._output(_parse([])) == Path("BENCHMARKS.md")
    assert bench._output(_parse(["--quick", "--output", "x.md"])) == Path("x.md")
    assert bench._output(_parse(["--only-qlora"])) is None and bench._output(_parse(["--only-scale"])) is None


@pytest.mark.parametrize("flags", [["--only-qlora", "--only-scale"], ["--only-scale", "--no-scale"],
                                   ["--only-qlora", "--no-deepspeed", "--scale-model", "llama-3.1-8b"]])
def test_a_part_alone_with_a_flag_it_excludes_is_one_line_naming_both(flags):
    with pytest.raises(SystemExit) as info:
        bench.Settings.from_args(_parse(flags))
    message = str(info.value)
    assert "\n" not in message and all(flag in message for flag in flags if flag.startswith("--"))


def test_the_qlora_pair_alone_runs_no_scale_run_and_keeps_the_pairs_flags():
    """--only-qlora: the pair's model is --model where it is a Llama (else llama-350m), with the step flags given."""
    s = bench.Settings.from_args(_parse(["--only-qlora", "--model", "llama-debug", "--rounds", "3",
                                         "--steps", "2", "--untimed-steps", "1", "--seq", "64"]))
    assert (s.alone, s.scale, s.rounds, s.steps, s.warmup) == ("--only-qlora", False, 3, 2, 1)
    ours, theirs, largest = bench._qlora_specs(s)
    assert ours.model == theirs.model == largest.model == PRESETS["llama-debug"].to_dict()
    assert (ours.seq, ours.steps) == (largest.seq, largest.steps) == (64, 2)
    assert bench._qlora_model(bench.Settings.from_args(_parse(["--only-qlora"]))) == PRESETS["llama-350m"]


def test_every_section_renders_when_nothing_ran():
    """Skipped or failed contenders become 'not run' / 'failed' cells, never a crash after an hour of runs."""
    from benchmarks.compare import (
        STREAM_RAM, Context, data_parallel, disk_tier, dtypes, gpu, memory, overhead, planner, scale, utilisation,
        versus_deepspeed, versus_hf, where_time_goes,
    )
    from benchmarks.lora import qlora_versus_hf
    from benchmarks.machine import Peaks
    spec = RunSpec(label=STREAM_RAM, contender="stream", model={}, batch=1, seq=1)
    ctx = Context(results={STREAM_RAM: merge(spec, [_measured(STREAM_RAM, [], 0, ok=False)])},
                  peaks=Peaks(1e12, 1e11, 64), disk={}, plans={}, scale=None, compute=FP32, skipped={"x": "--quick"})
    outcomes = [dtypes(ctx), overhead(ctx), versus_hf(ctx), versus_deepspeed(ctx), disk_tier(ctx), utilisation(ctx),
                scale(ctx), memory(ctx), planner(ctx), data_parallel(ctx), gpu(ctx, ""), qlora_versus_hf(ctx),
                *where_time_goes(ctx)]
    text = "".join(o.section.markdown() for o in outcomes)
    assert "failed: boom" in text
    assert all("unmeasured" in t or "NOT met" in t for o in outcomes for t in o.targets)


def test_disk_bandwidth_is_judged_only_where_the_disk_served_it():
    from benchmarks.compare import STREAM_DISK, Context, disk_tier
    from benchmarks.machine import DiskBandwidth, Peaks
    spec = RunSpec(label=STREAM_DISK, contender="stream", model={}, batch=1, seq=1, tier="disk")
    block = _measured(STREAM_DISK, [2.0], 1)
    # Reads came from the page cache (nothing reached the device); writes did, at half the raw rate.
    block.io = [{"rchar": 8e9, "read_bytes": 0, "wchar": 4e9, "write_bytes": 4e9}]
    block.phases = [{"load_busy": 1.0, "offload_busy": 4.0, "io_busy": 1.9}]
    raw = DiskBandwidth(read_bytes_per_s=2e9, write_bytes_per_s=2e9, nbytes=1, repeats=1, where="x",
                        shared_bytes_per_s=1e9)
    ctx = Context(results={STREAM_DISK: merge(spec, [block])}, peaks=Peaks(1.0, 1.0, 1), disk={STREAM_DISK: raw},
                  plans={}, scale=None, compute=FP32)
    row = disk_tier(ctx).section.rows[0]
    assert "page cache: not judged" in row[1] and "50% of 2.00 GB/s" in row[2]
    assert row[-2:] == ("NOT met", "met")  # 2.0 s step vs max(1.9 s I/O, no compute reference): 1.05x
    assert row[-3] == "4 s (0.50x)"  # 4 GB reached the disk at 1 GB/s reading and writing at once


def test_gpu_check_imports_and_says_why_it_measures_nothing_without_a_gpu() -> None:
    """`make gpu-check`'s command on a machine with no CUDA device: it exits 0 and says there is nothing to
    check (so a broken import in it fails here, not first on a GPU)."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "sees no CUDA device" in done.stdout


def test_model_is_a_preset_or_a_config_file(tmp_path):
    """--model takes what `streamer train --model` takes: a preset, or a config.json (the ~100M comparison)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gptj", "vocab_size": 512, "n_positions": 64, "n_embd": 64,
                                  "n_layer": 3, "n_head": 4, "rotary_dim": 8}))
    settings = bench.Settings.from_args(_parse(["--model", str(config)]))
    assert settings.second.n_layer == 1 and settings.second.vocab_size == 512
    with pytest.raises(ConfigError, match="neither a preset"):
        bench.Settings.from_args(_parse(["--model", str(tmp_path / "missing.json")]))


@pytest.mark.parametrize("family", [Qwen3MoeConfig, MixtralConfig, OlmoeConfig])
def test_a_mixture_of_experts_is_compared_with_transformers_default_experts(tmp_path, family):
    """`--model` a mixture's config.json: our streamed step and transformers' class (its experts as it picks them
    by default, grouped_mm on this torch; under bf16 autocast they stay fp32) both train it, and section 2
    compares them. Timings are not judged: tiny sizes, a shared machine."""
    from benchmarks.compare import HF_BF16, Context, versus_hf
    from benchmarks.machine import Peaks
    from benchmarks.report import ratio
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(family.example().adapter().to_hf()))
    cfg = ModelConfig.named(str(tmp_path / "moe" / "config.json"))
    specs = [RunSpec(label=label, contender=contender, model=cfg.to_dict(), batch=2, seq=16, dtype=dtype, warmup=1,
                     steps=2) for label, contender, dtype in ((STREAM_RAM, "stream", "fp32"), (HF_BF16, "hf", "bf16"))]
    results = Runner(tmp_path / "work", console=_Quiet(), child_timeout_s=300).compare(specs, rounds=1)
    assert all(r.ok for r in results.values()), [r.error for r in results.values()]
    assert results[HF_BF16].experts == "grouped_mm" and results[STREAM_RAM].experts == ""
    section = versus_hf(Context(results=results, peaks=Peaks(1.0, 1.0, 1), disk={}, plans={}, scale=None,
                                compute=FP32)).section
    rows = {row[0]: row for row in section.rows}
    assert rows[STREAM_RAM][5] == ratio(results[STREAM_RAM].median_s / results[HF_BF16].median_s)
    assert f"{HF_BF16}: `grouped_mm` (fp32 under the autocast)" in " ".join(section.notes)


def test_matmul_peaks_stop_at_their_time_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a dtype is emulated one matmul takes half a minute: its repeats stop once the bound has passed, after
    the first call, instead of running all of them."""
    calls: list[torch.dtype] = []

    def slow_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        calls.append(a.dtype)
        time.sleep(0.02)
        return out

    monkeypatch.setattr(torch, "mm", slow_mm)
    peaks = matmul_peaks(64, repeats=5, seconds=0.01)
    assert calls == [torch.bfloat16, torch.float32]
    assert 0 < peaks.bf16_flops < 2 * 64**3 / 0.02 and peaks.n == 64
