"""docs/VALIDATION.md is what `python -m benchmarks.validate` writes, and its figures are the planner's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import validate
from memory_model.catalogue import PUBLISHED_RUNS

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_table_is_what_the_command_writes(tmp_path: Path) -> None:
    out = tmp_path / "VALIDATION.md"
    done = subprocess.run([sys.executable, "-m", "benchmarks.validate", "--output", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == (ROOT / "docs" / "VALIDATION.md").read_text(), \
        "docs/VALIDATION.md is stale: run python -m benchmarks.validate"
    priced, within, median = validate.summary(validate.rows())
    assert f"{within} of {priced} priced cases within ±25%; median ratio {median:.2f}" in done.stdout


def test_the_table_holds_eight_sourced_runs_and_says_why_any_is_not_priced() -> None:
    assert len(PUBLISHED_RUNS) >= 8
    for row in validate.rows():
        assert row.run.measured.source and row.run.caveat
        assert (row.predicted is None) == (not row.run.reproducible)
        if row.predicted is None:
            assert row.run.caveat.startswith("not priced:")


def test_a_rows_figure_is_what_streamer_plan_prints(tmp_path: Path) -> None:
    """The ZeRO-Offload row through the CLI: its model as a config.json, its step as flags."""
    run = next(r for r in PUBLISHED_RUNS if r.system == "ZeRO-Offload")
    (tmp_path / "config.json").write_text(json.dumps(run.shape.to_hf()))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in run.step]
    done = subprocess.run([sys.executable, "-m", "streamer", "plan", "--model", str(tmp_path / "config.json"),
                           "--target", run.device, "--batch", str(run.batch), "--seq", str(run.seq), *flags,
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)["model_flops_per_s"] / 1e12
    row = validate.predict(run)
    assert printed == row.predicted
    assert f"| {printed:,.0f} | {printed / run.measured.value:.2f} |" in (ROOT / "docs" / "VALIDATION.md").read_text()


def _run(system: str):
    return next(r for r in PUBLISHED_RUNS if r.system == system)


def test_a_rate_is_priced_as_its_source_counts_its_flops() -> None:
    """SuperOffload's script counts 8 FLOPs per parameter and token with checkpointing (the recompute too), every
    parameter included, and 16 L d s^2 per sequence for attention; MegaTrain's 6 per parameter and padded token.
    The plan's figure is the source's count over the plan's step time, and no recompute column is added."""
    from memory_model.devices import device_spec
    from memory_model.planner import plan

    run = _run("SuperOffload")
    n = run.shape.num_params()
    assert 14.7e9 < n < 14.8e9  # Qwen3-14B: 14.8B parameters
    coefficient = 4  # estimate_transformer_tflops with use_activation_checkpointing
    per_sequence = 2 * coefficient * n * 4096 + 2 * 2 * coefficient * 40 * 5120 * 4096**2
    assert run.flops is not None and run.flops.flops(run.shape, 4, 4096) == 4 * per_sequence
    row = validate.predict(run)
    many = plan(run.shape, device_spec(run.device), validate._step(run), limits=False)
    assert row.predicted == 4 * per_sequence / many.step_time_s / 1e12
    assert row.ratio_recompute is None

    mega = _run("MegaTrain")
    assert mega.flops is not None
    assert mega.flops.flops(mega.shape, 158, 1024) == 6 * mega.shape.num_params() * 158 * 1024


def test_no_published_rate_passes_the_training_mfu_its_device_class_is_capped_at() -> None:
    """Counted as model FLOPs (the plan's count), every published rate is at most its device's training_mfu: the cap
    that bounds every plan is not below what a source measured."""
    from memory_model.devices import device_spec

    rated = [row for row in validate.rows() if row.published_mfu is not None]
    assert {row.run.system for row in rated} >= {"ZeRO-Offload", "SuperOffload", "MegaTrain"}
    for row in rated:
        assert row.published_mfu <= device_spec(row.run.device).training_mfu, row.run.system
