"""`python -m benchmarks.plan_compare`: `streamer plan --compare` on the smallest runs, repeated.

Each repeat works in a new folder, as a new user would: `streamer devices --local` calibrates this machine
afresh, each run trains a few steps, and `streamer plan --compare` replays it on that calibration. The
report (docs/PLAN_COMPARE.md by default) gives every repeat's step and peak error and the CPU cores other
processes kept busy meanwhile. A calibration is a few seconds of short timings, so one repeat says little:
the spread over repeats is the measurement. The goal is the one `streamer bench` holds its larger runs to:
the step within 20%, the device peak within 5%.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.machine import describe
from benchmarks.runs import cpu_seconds, others_cores

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "PLAN_COMPARE.md"
GOAL_STEP, GOAL_PEAK = 0.20, 0.05
QUIET_CORES = 0.5  # a repeat timed while others kept more cores busy than this is reported, not judged

# (what it is, `streamer train` flags besides --steps and --run-dir): the demo's defaults train on the disk tier.
RUNS = (("the demo, disk tier", ()), ("the demo, RAM tier", ("--store", "ram")),
        ("gptj-debug, disk tier", ("--model", "gptj-debug", "--store", "disk")))


@dataclass(frozen=True)
class Result:
    repeat: int
    run: str
    step_error: float
    peak_error: float
    predicted_step_s: float
    measured_step_s: float
    others: float  # mean CPU cores other processes kept busy during the repeat

    @property
    def quiet(self) -> bool:
        return self.others <= QUIET_CORES


def _streamer(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "HOME": str(cwd / "home")}
    done = subprocess.run([sys.executable, "-m", "streamer", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"streamer {' '.join(args)} failed: {done.stderr[-2000:]}")
    return done.stdout


def repeat(index: int, steps: int, runs: tuple[tuple[str, tuple[str, ...]], ...]) -> list[Result]:
    """One repeat: a fresh calibration, then each run trained and compared."""
    with tempfile.TemporaryDirectory(prefix="plan-compare-") as tmp:
        folder = Path(tmp)
        (folder / "home").mkdir()
        before = cpu_seconds()
        _streamer(["devices", "--local"], folder)
        compared = []
        for i, (_, flags) in enumerate(runs):
            run_dir = f"r{i}"
            _streamer(["train", "--steps", str(steps), "--run-dir", run_dir, "--sample-tokens", "0",
                       "--eval-every", "0", *flags], folder)
            compared.append(json.loads(_streamer(["plan", "--compare", run_dir, "--json"], folder)))
        others = others_cores(before, cpu_seconds())
    return [Result(index, name, c["step_error"], c["peak_error"], c["predicted_step_s"], c["measured_step_s"], others)
            for (name, _), c in zip(runs, compared, strict=True)]


def report(results: list[Result], steps: int, command: str) -> str:
    machine = describe()
    lines = ["# `streamer plan --compare` on the smallest runs", "",
             f"Written by `{command}`; every number below was measured in that run. Do not edit by hand.", "",
             *(f"- {line}" for line in machine.lines()),
             f"- {steps} steps per run; the compare takes the median step after the first.", "",
             "| repeat | run | predicted step | measured step | step error | peak error | others' load (cores) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.repeat} | {r.run} | {r.predicted_step_s:.4g} s | {r.measured_step_s:.4g} s | "
              f"{r.step_error:+.1%} | {r.peak_error:+.2%} | {r.others:.2f} |" for r in results]
    lines += ["", "## Goal", "",
              f"Step within {GOAL_STEP:.0%} and device peak within {GOAL_PEAK:.0%} in every repeat timed while "
              f"other processes kept at most {QUIET_CORES} cores busy.", ""]
    for name, _ in RUNS:
        mine = [r for r in results if r.run == name]
        if not mine:
            continue
        quiet = [r for r in mine if r.quiet]
        met = bool(quiet) and all(abs(r.step_error) <= GOAL_STEP and abs(r.peak_error) <= GOAL_PEAK for r in quiet)
        errors = ", ".join(f"{r.step_error:+.1%}" for r in quiet) or "none quiet"
        lines.append(f"- {name}: {'met' if met else 'NOT met'} ({len(quiet)} of {len(mine)} repeats quiet; step "
                     f"errors {errors}; median {statistics.median(r.step_error for r in mine):+.1%} over all)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_compare", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh calibrations, each with every run (default 5)")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    parser.add_argument("--quick", action="store_true", help="one repeat of 3 steps of gptj-debug: the harness, "
                                                             "not a measurement (the test suite runs it)")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"the report (default {OUTPUT.relative_to(ROOT)})")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    repeats, steps, runs = (1, 3, RUNS[-1:]) if args.quick else (args.repeats, args.steps, RUNS)
    results = []
    for i in range(1, repeats + 1):
        results += repeat(i, steps, runs)
        for r in results[-len(runs):]:
            print(f"repeat {r.repeat}, {r.run}: step {r.step_error:+.1%}, peak {r.peak_error:+.2%}, "
                  f"others {r.others:.2f} cores", flush=True)
    command = " ".join(["python -m benchmarks.plan_compare", *argv])
    args.output.write_text(report(results, steps, command))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
