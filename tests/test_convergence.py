"""`python -m benchmarks.convergence`: its quick run trains every precision through `streamer train` and reports
each evaluation's held-out loss against fp32; docs/CONVERGENCE.md is what its full run wrote."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.convergence import GOAL, PRECISIONS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_run_reports_every_precision_at_every_evaluation(tmp_path: Path) -> None:
    out = tmp_path / "CONVERGENCE.md"
    done = subprocess.run([sys.executable, "-m", "benchmarks.convergence", "--quick", "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert out.with_suffix(".png").stat().st_size > 0
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \|(.*)\|$", text, re.M)
    assert [int(step) for step, _, _ in rows] == [0, 3, 6]  # the first evaluation, then every --eval-every
    for _, fp32, others in rows:
        cells = others.split("|")
        assert len(cells) == len(PRECISIONS) - 1
        for cell in cells:
            loss, relative = re.fullmatch(r" ([\d.]+) \(([-+][\d.]+)%\) ", cell).groups()
            assert abs(float(loss) / float(fp32) - 1 - float(relative) / 100) < 1e-3
    for name, _ in PRECISIONS[1:]:
        assert re.search(rf"- {name}: within {GOAL:.0%} of fp32 at every evaluation: (met|NOT met)", text)
    for name, _ in PRECISIONS:  # random tokens on a tiny model: gradients far above the norm of 1
        assert f"- {name}: 6 of 6\n" in text


def test_the_committed_report_meets_its_goal_for_every_precision() -> None:
    text = (ROOT / "docs" / "CONVERGENCE.md").read_text()
    assert "--quick" not in text, "docs/CONVERGENCE.md must be a full run, not the harness's smoke run"
    for name, _ in PRECISIONS[1:]:
        worst = re.search(rf"- {name}: within {GOAL:.0%} of fp32 at every evaluation: met \(at most ([\d.]+)%\)",
                          text)
        assert worst and float(worst.group(1)) <= 100 * GOAL, f"{name}: the goal is not met in docs/CONVERGENCE.md"
