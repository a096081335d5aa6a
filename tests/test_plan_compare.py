"""`python -m benchmarks.plan_compare`: its quick run calibrates, trains and compares through the CLI and
reports each repeat; docs/PLAN_COMPARE.md is what its full run wrote."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from benchmarks.plan_compare import GOAL_PEAK, GOAL_STEP, QUIET_CORES, RUNS

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (\d+) \| ([^|]+) \| ([\d.e+-]+) s \| ([\d.e+-]+) s \| ([+-][\d.]+)% \| ([+-][\d.]+)% "
                 r"\| ([\d.]+) \|$", re.M)


def test_quick_run_reports_the_compare_of_a_fresh_calibration(tmp_path: Path) -> None:
    out = tmp_path / "PLAN_COMPARE.md"
    done = subprocess.run([sys.executable, "-m", "benchmarks.plan_compare", "--quick", "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = ROW.findall(out.read_text())
    assert [(int(r[0]), r[1]) for r in rows] == [(1, "gptj-debug, disk tier")]
    _, _, predicted, measured, step_error, peak_error, _ = rows[0]
    assert float(predicted) > 0 and float(measured) > 0
    # The printed error is the printed times' ratio (both rounded); the peak is planned to the byte.
    assert abs(float(step_error) / 100 - (float(predicted) / float(measured) - 1)) < 2e-3
    assert abs(float(peak_error)) <= 100 * GOAL_PEAK


def test_the_committed_report_is_a_full_run_whose_verdicts_follow_from_its_rows() -> None:
    text = (ROOT / "docs" / "PLAN_COMPARE.md").read_text()
    assert "--quick" not in text, "docs/PLAN_COMPARE.md must be a full run, not the harness's smoke run"
    rows = ROW.findall(text)
    assert {r[1] for r in rows} == {name for name, _ in RUNS}
    for name, _ in RUNS:
        quiet = [r for r in rows if r[1] == name and float(r[6]) <= QUIET_CORES]
        met = bool(quiet) and all(abs(float(r[4])) <= 100 * GOAL_STEP and abs(float(r[5])) <= 100 * GOAL_PEAK
                                  for r in quiet)
        assert re.search(rf"^- {re.escape(name)}: {'met' if met else 'NOT met'} \(", text, re.M), name
