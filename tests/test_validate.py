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
