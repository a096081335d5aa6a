"""`streamer bench`'s LoRA pair: the worker trains adapters on the frozen base, and the section divides the
measured rows and prices GPT-J-6B both ways with the planner."""
from __future__ import annotations

import dataclasses
import mmap
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layers import GPTJConfig
from memory_model import device_spec, plan
from memory_model.lora import LoraConfig
from benchmarks.compare import STREAM_RAM, Context
from benchmarks.lora import FULL, LORA, LORA_RANK, PLANNED, lora_pair, lora_versus_full, store_bytes
from benchmarks.machine import Peaks
from benchmarks.report import count, seconds, size
from benchmarks.report import ratio as format_ratio
from benchmarks.runs import Runner, merge
from benchmarks.worker import RUSAGE_COUNTERS, Measured, RunSpec
from streamer.cli.launch import MALLOC_ENV, MMAP_THRESHOLD
from streamer.runtime.hardware import DtypeChoice

ROOT = Path(__file__).resolve().parents[1]
CFG = GPTJConfig.preset("gptj-debug")
FP32 = DtypeChoice("fp32", "compute dtype fp32 (--dtype fp32)")


class _Quiet:
    def print(self, *_: object, **__: object) -> None:
        pass


def _context(results: dict, skipped: dict | None = None) -> Context:
    return Context(results=results, peaks=Peaks(1e12, 1e11, 64), disk={}, plans={}, scale=None, compute=FP32,
                   skipped=skipped or {})


def test_the_pair_differs_only_in_the_adapters() -> None:
    base = RunSpec(label=STREAM_RAM, contender="stream", model=dataclasses.asdict(CFG), batch=1, seq=16)
    full, lora = lora_pair(base)
    assert (full.label, full.lora_rank, lora.label, lora.lora_rank) == (FULL, 0, LORA, LORA_RANK)
    assert dataclasses.replace(lora, label=FULL, lora_rank=0) == full
    # The full store holds at least fp32 master, moments and gradient (16 B/param); LoRA's the bf16 weights alone.
    assert store_bytes(full) >= 16 * CFG.num_params() and store_bytes(lora) == 2 * CFG.num_params()


def test_worker_trains_lora_with_less_device_and_host_memory(tmp_path) -> None:
    base = RunSpec(label="x", contender="stream", model=dataclasses.asdict(CFG), batch=1, seq=16, warmup=1,
                   steps=1, dtype="fp32")
    runner = Runner(tmp_path, console=_Quiet(), child_timeout_s=300)
    full, lora = (runner.block(spec, 0) for spec in lora_pair(base))
    assert full.ok and lora.ok, (full.error, lora.error)
    assert lora.ledger_peak_breakdown["gradients"] == 4 * (CFG.n_layer * 2 * LORA_RANK * 2 * CFG.n_embd)
    assert lora.ledger_peak_bytes < full.ledger_peak_bytes
    assert all(row["store_read"] == 0 and row["store_written"] == 0 for row in lora.io)  # the RAM tier


def test_section_divides_the_measured_rows_and_plans_gptj6b() -> None:
    model = dataclasses.asdict(CFG)
    specs = {label: RunSpec(label=label, contender="stream", model=model, batch=1, seq=8, lora_rank=rank)
             for label, rank in ((FULL, 0), (LORA, LORA_RANK))}
    measured = {FULL: (4.0, 800, 600), LORA: (2.0, 400, 150)}
    results = {label: merge(specs[label], [Measured(label, step_s=[t], step_rss_peak_bytes=rss,
                                                    ledger_peak_bytes=peak)])
               for label, (t, rss, peak) in measured.items()}
    rows = lora_versus_full(_context(results)).section.rows
    assert rows[2][:4] == ("LoRA / full", "0.50x", "0.50x", "0.25x")
    assert rows[2][4] == f"{store_bytes(specs[LORA]) / store_bytes(specs[FULL]):.2f}x"
    six = GPTJConfig.preset("gptj-6b")
    for row, lora in zip(rows[3:], (LoraConfig(), LoraConfig(rank=LORA_RANK)), strict=True):
        p = plan(six, device_spec("h100-sxm"), dataclasses.replace(PLANNED, lora=lora), limits=False)
        assert row[3] == f"{size(p.peak_device_bytes)} (planned)" and row[4] == f"{size(p.host_store_bytes)} (planned)"
    assert rows[4][4] == f"{size(2 * six.num_params())} (planned)"  # the frozen base in bf16, nothing else


def test_section_says_why_a_row_is_missing() -> None:
    spec = RunSpec(label=FULL, contender="stream", model={}, batch=1, seq=1)
    failed = merge(spec, [Measured(FULL, ok=False, error="boom")])
    rows = lora_versus_full(_context({FULL: failed}, {LORA: "--no-lora"})).section.rows
    assert rows[0][1] == "failed: boom" and rows[1][1] == "not run: --no-lora" and rows[2][1] == "—"


def test_a_row_without_timed_steps_has_no_ratio() -> None:
    # A run that finished without timed steps has no median step time: its ratio is "—", not a crash.
    specs = {label: RunSpec(label=label, contender="stream", model={}, batch=1, seq=1) for label in (FULL, LORA)}
    results = {FULL: merge(specs[FULL], [Measured(FULL, step_s=[4.0], step_rss_peak_bytes=800)]),
               LORA: merge(specs[LORA], [Measured(LORA, step_s=[], step_rss_peak_bytes=400)])}
    rows = lora_versus_full(_context(results)).section.rows
    assert rows[2][1] == "—" and rows[2][2] == "0.50x"


def test_the_qlora_pair_runs_ours_and_transformers_bitsandbytes_peft_on_one_llama() -> None:
    from benchmarks.lora import QLORA_HF, QLORA_OURS, QLORA_OURS_UNCACHED, QLORA_QUICK_MODEL, qlora_pair
    from layers import ModelConfig

    model = ModelConfig.named(QLORA_QUICK_MODEL).to_dict()
    ours, theirs, uncached = qlora_pair(RunSpec(label="x", contender="stream", model=model, batch=1, seq=16,
                                               tier="disk"))
    assert (ours.label, ours.contender, ours.tier, theirs.label, theirs.contender) == \
        (QLORA_OURS, "stream", "ram", QLORA_HF, "hf-qlora")
    assert dataclasses.replace(theirs, label=QLORA_OURS, contender="stream", tier="ram") == ours
    assert ours.cpu_cache  # as `streamer` sets it up
    assert dataclasses.replace(uncached, label=QLORA_OURS, cpu_cache=True) == ours
    assert uncached.label == QLORA_OURS_UNCACHED and not uncached.cpu_cache
    assert (ours.lora_rank, ours.load_in_4bit, ours.bnb_4bit_quant_type, ours.bnb_4bit_use_double_quant) == \
        (LORA_RANK, True, "nf4", True)


def test_worker_counts_page_faults_and_cpu_seconds() -> None:
    """The worker's per-step counters are the process's own: fresh anonymous pages fault in as they are touched, and
    a busy loop is user CPU."""
    from benchmarks.worker import _rusage

    before = _rusage()
    pages = mmap.mmap(-1, 8 * 2**20)
    for offset in range(0, len(pages), mmap.PAGESIZE):
        pages[offset] = 1
    spin = time.process_time() + 0.05
    while time.process_time() < spin:
        pass
    after = _rusage()
    pages.close()
    delta = {key: after[key] - before[key] for key in RUSAGE_COUNTERS}
    assert delta["minor_faults"] >= 1 and delta["major_faults"] >= 0  # one per page, or per huge page
    assert delta["user_s"] + delta["system_s"] >= 0.04 and delta["system_s"] >= 0


def test_worker_trains_qlora_both_ways_and_the_section_divides_them(tmp_path, monkeypatch) -> None:
    """The bench path at a tiny size: both contenders train (ours with a packed 4-bit base on the device), and the
    section holds our step against theirs to the target, with each step's page faults and CPU seconds as measured."""
    from benchmarks.lora import (
        QLORA_HF, QLORA_OURS, QLORA_OURS_UNCACHED, QLORA_QUICK_MODEL, SHARED_KERNELS, qlora_pair, qlora_versus_hf,
    )
    from layers import ModelConfig

    for name in MALLOC_ENV:  # a user's own setting would reach both contenders
        monkeypatch.delenv(name, raising=False)
    model = ModelConfig.named(QLORA_QUICK_MODEL)
    base = RunSpec(label="x", contender="stream", model=model.to_dict(), batch=1, seq=16, warmup=1,
                   steps=1, dtype="fp32", profile=True)
    runner = Runner(tmp_path, console=_Quiet(), child_timeout_s=300)
    blocks = {spec.label: (spec, runner.block(spec, 0)) for spec in qlora_pair(base)}
    results = {label: merge(spec, [block]) for label, (spec, block) in blocks.items()}
    assert all(r.ok for r in results.values()), {k: r.error for k, r in results.items()}
    assert results[QLORA_OURS].ledger_peak_bytes > 0 and results[QLORA_HF].rss_peak_bytes > 0
    for _, block in blocks.values():  # each timed step's getrusage deltas, within what its threads could run
        assert [sorted(row) for row in block.rusage] == [sorted(RUSAGE_COUNTERS)], block.rusage
        step = block.rusage[0]
        assert step["minor_faults"] >= 0 and step["major_faults"] >= 0 and step["system_s"] >= 0
        busy = step["user_s"] + step["system_s"]  # no more than every core for the step's wall time, with margin
        assert 0 < busy < 2 * (os.cpu_count() or 1) * block.step_s[0] + 0.05
    # Ours start with glibc's mmap threshold fixed as `streamer` fixes it, with or without its CPU buffer cache;
    # theirs with glibc's defaults and torch's allocator.
    assert results[QLORA_OURS].malloc_env == results[QLORA_OURS_UNCACHED].malloc_env == MALLOC_ENV
    assert results[QLORA_HF].malloc_env == {}
    assert results[QLORA_OURS].cpu_cache and not results[QLORA_OURS_UNCACHED].cpu_cache
    assert not results[QLORA_HF].cpu_cache
    outcome = qlora_versus_hf(_context(results))
    labels = (QLORA_OURS, QLORA_OURS_UNCACHED, QLORA_HF)
    assert tuple(row[0] for row in outcome.section.rows[:3]) == labels
    for row, label in zip(outcome.section.rows, labels, strict=False):
        usage = results[label].rusage
        assert usage["faults"] == usage["minor_faults"] + usage["major_faults"]
        assert row[3:6] == (count(usage["faults"]), seconds(usage["user_s"]), seconds(usage["system_s"]))
    theirs = results[QLORA_HF]
    ratio = results[QLORA_OURS].median_s / theirs.median_s
    for row, label in zip(outcome.section.rows[3:], (QLORA_OURS, QLORA_OURS_UNCACHED), strict=True):
        ours = results[label]
        assert row[2] == format_ratio(ours.median_s / theirs.median_s)
        faults = theirs.rusage["faults"]  # a tiny step may fault 0
        assert row[3] == format_ratio(ours.rusage["faults"] / faults if faults else None)
    note = next(n for n in outcome.section.notes if n.startswith("freed buffers: "))
    fixed = f"glibc's mmap threshold fixed at {size(MMAP_THRESHOLD)} as `streamer` fixes it " \
            f"(MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD})"
    assert f"ours: {fixed}, and torch's CPU allocator the buffer cache `streamer` installs" in note
    assert f"ours, torch's allocator: {fixed}, torch's own CPU allocator: every freed buffer" in note
    assert "; transformers + bitsandbytes + PEFT: glibc's default" in note
    # The kernels both sides share, from each run's profiled step, beside the step the target allows.
    note = next(n for n in outcome.section.notes if n.startswith("matmuls and attention ("))
    for who, label in (("ours", QLORA_OURS), ("ours, torch's allocator", QLORA_OURS_UNCACHED),
                       ("transformers + bitsandbytes + PEFT", QLORA_HF)):
        profile = results[label].profile
        assert any(op == "aten::mm" for op, _, _ in profile), profile
        shared = sum(s for op, s, _ in profile if op.startswith(SHARED_KERNELS))
        assert f"{who} {seconds(shared)}" in note, note
    assert note.endswith(f"; 0.8x their step is {seconds(0.8 * theirs.median_s)}."), note
    assert outcome.targets[0].startswith("QLoRA: our RAM-tier step <= 0.8x") and \
        ("NOT met" in outcome.targets[0]) == (ratio > 0.8)


@pytest.mark.slow
def test_the_qlora_pair_alone_rewrites_only_its_section_of_a_report(tmp_path) -> None:
    """`streamer bench --only-qlora --output` a copy of the repository's report, holding a QLoRA section and target
    from an earlier run: the pair's section, its target and a line naming the command change; every other byte
    stays. A flag it excludes is one line naming both flags, before anything runs."""
    from benchmarks.lora import QLORA_HF, QLORA_OURS, QLORA_OURS_UNCACHED
    from streamer.runtime.hardware import resolve_compute_dtype

    title = "QLoRA vs transformers + bitsandbytes + PEFT: step time and host memory"
    stale_target = "- QLoRA: our RAM-tier step <= 0.8x transformers + bitsandbytes + PEFT's: unmeasured (—; peak RSS —)"
    report = (ROOT / "BENCHMARKS.md").read_text()
    # Whatever the repository's report holds of an earlier pair (its section, target and command line) goes first.
    report = re.sub(rf"^- QLoRA: our RAM-tier step .*\n|^- `streamer bench .*wrote \"{re.escape(title)}\"\n", "",
                    report, flags=re.M)
    report = re.sub(rf"## {re.escape(title)}\n.*?\n(?=## )", "", report, flags=re.S)
    report = report.replace("## Targets\n\n", f"## Targets\n\n{stale_target}\n", 1).replace(
        "## Where our step time goes", f"## {title}\n\n| run |\n|---|\n| stale |\n\n## Where our step time goes", 1)
    out = tmp_path / "BENCHMARKS.md"
    out.write_text(report)

    def bench(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "streamer", "bench", *flags], capture_output=True, text=True,
                              timeout=600, cwd=tmp_path)

    refused = bench("--quick", "--only-qlora", "--only-scale", "--output", str(out))
    assert refused.returncode != 0 and refused.stderr.count("\n") == 1, refused.stderr
    assert "--only-qlora" in refused.stderr and "--only-scale" in refused.stderr and out.read_text() == report

    done = bench("--quick", "--only-qlora", "--output", str(out))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    before, after = (dict(_blocks(text)) for text in (report, out.read_text()))
    assert list(after) == list(before)  # no section added, none moved
    changed = [name for name in before if after[name] != before[name]]
    assert changed == ["Machine and command", "Targets", title]  # every other section is byte for byte the same
    machine = after["Machine and command"].rstrip("\n").splitlines()
    assert machine[:-1] == before["Machine and command"].rstrip("\n").splitlines()
    assert re.fullmatch(rf"- `streamer bench --quick --output {re.escape(str(out))} --only-qlora`: CPU: .*; wrote "
                        f'"{re.escape(title)}"', machine[-1])
    targets = after["Targets"].rstrip("\n").splitlines()
    assert [line for line in before["Targets"].rstrip("\n").splitlines() if line != stale_target] == targets[:-1]
    assert re.fullmatch(r"- QLoRA: our RAM-tier step <= 0\.8x transformers \+ bitsandbytes \+ PEFT's: (NOT )?met "
                        r"\(\d+\.\d\dx; peak RSS \d+\.\d\dx\)", targets[-1]), targets[-1]
    section = after[title]
    dtype = resolve_compute_dtype("cpu").dtype
    assert "stale" not in section and "not run" not in section and "failed" not in section
    assert re.search(r"^- `streamer bench --quick --output .* --only-qlora`: CPU", section, re.M)
    for label in (QLORA_OURS, QLORA_OURS_UNCACHED, QLORA_HF):  # llama-debug, each measured: step, both peaks
        row = next(line for line in section.splitlines() if line.startswith(f"| {label} |"))
        assert f"| llama, 106,816, batch 1 x 32, {dtype} compute | " in row, row
        # step, page faults, user and system CPU per step, both peaks
        cpu, rss = r"[\d.e-]+ s", r"[\d.]+ [MG]iB"
        assert re.search(rf"\| [\d.]+ s \| [\d.]+[kM]? \| {cpu} \| {cpu} \| {rss} \| {rss} \| ", row), row
    ours = next(line for line in section.splitlines() if line.startswith(f"| {QLORA_OURS} |"))
    assert re.search(r"\| [\d.]+ [MG]iB \| \d+\.\d\dx \| measured, 2 \(1x2, 1 warm-up each\) steps \|$", ours), ours


def _blocks(text: str) -> list[tuple[str, str]]:
    """A report's parts by heading: the text before the first `## ` and each section, as written."""
    parts = re.split(r"(?m)^(?=## )", text)
    return [("", parts[0]), *((part.split("\n", 1)[0][3:], part) for part in parts[1:])]
