"""Running contenders for `streamer bench`: one child process per block, blocks in ABBA order, medians.

Each contender runs in `rounds` blocks (a fresh process each: warm-up, then timed steps), and the order of
the contenders reverses every round, so that slow drift on a shared machine (other jobs starting and
stopping) falls on every contender alike. A contender's steps from all blocks are pooled for the median.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from rich.console import Console

from benchmarks.worker import RESULT_TAG, Measured, RunSpec
from streamer.cli.launch import MALLOC_ENV, PROCESS_ENV

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Result:
    """A contender's blocks merged: timed steps pooled, peaks maxed, per-step counters as medians."""

    spec: RunSpec
    ok: bool
    error: str
    params: int
    blocks: int
    others_cores: float  # mean over its blocks
    setup_s: tuple[float, ...]
    step_s: tuple[float, ...]
    rss_peak_bytes: int
    process_rss_peak_bytes: int
    planned_host_bytes: int  # ours streamed: the planner's host peak of one process; 0 for the others
    io: dict[str, float]
    # median per timed step: page faults (minor_faults, major_faults, and faults, their sum) and CPU seconds of
    # every thread of the process (user_s, system_s)
    rusage: dict[str, float]
    malloc_env: dict[str, str]  # the allocator settings of MALLOC_ENV its processes started with
    cpu_cache: bool  # its processes' torch CPU allocator was streamer.cpu_cache
    phases: dict[str, float]
    unit_compute: dict[str, float]  # ours: median seconds of each unit's compute spans per step
    rss_peak_at: str  # ours: the span at the highest host RSS of the timed steps (of the block with the peak)
    ledger_peak_bytes: int
    ledger_peak_breakdown: dict[str, int]
    profile: tuple[tuple[str, float, int], ...]
    fused: bool  # ours: the update fused into the backward
    redone_steps: int  # of the timed fused steps, those clipping made again after the backward
    experts: str  # HF's: the experts implementation transformers picked ("" without experts)

    @property
    def update_schedule(self) -> str:
        if not self.fused:
            return "update after the backward"
        if not self.redone_steps:
            return "update fused into the backward"
        return (f"update fused into the backward, {self.redone_steps} of {len(self.step_s)} timed steps redone "
                "(clipping)")

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.step_s) if self.ok and self.step_s else None

    @property
    def tokens_per_s(self) -> float | None:
        median = self.median_s
        return None if median is None else self.spec.batch * self.spec.seq / median

    @property
    def steps_note(self) -> str:
        return f"{len(self.step_s)} ({self.blocks}x{self.spec.steps}, {self.spec.warmup} warm-up each)"


def _median_by_key(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    keys = {k for row in rows for k in row}
    return {k: statistics.median(row[k] for row in rows if k in row) for k in sorted(keys)}


def merge(spec: RunSpec, blocks: list[Measured]) -> Result:
    failed = next((b for b in blocks if not b.ok), None)
    good = [b for b in blocks if b.ok]
    return Result(
        spec=spec, ok=failed is None and bool(good), error=failed.error if failed else "",
        params=max((b.params for b in good), default=0), blocks=len(blocks),
        others_cores=statistics.fmean(b.others_cores for b in blocks) if blocks else 0.0,
        setup_s=tuple(b.setup_s for b in good), step_s=tuple(s for b in good for s in b.step_s),
        rss_peak_bytes=max((b.step_rss_peak_bytes for b in good), default=0),
        process_rss_peak_bytes=max((b.process_rss_peak_bytes for b in good), default=0),
        planned_host_bytes=max((b.planned_host_bytes for b in good), default=0),
        io=_median_by_key([row for b in good for row in b.io]),
        rusage=_median_by_key([{**row, "faults": row["minor_faults"] + row["major_faults"]}
                               for b in good for row in b.rusage]),
        malloc_env=next((b.malloc_env for b in good), {}),
        cpu_cache=all(b.cpu_cache for b in good) and bool(good),
        phases=_median_by_key([row for b in good for row in b.phases]),
        unit_compute=_median_by_key([row for b in good for row in b.unit_compute]),
        rss_peak_at=max(good, key=lambda b: b.step_rss_peak_bytes).rss_peak_at if good else "",
        ledger_peak_bytes=max((b.ledger_peak_bytes for b in good), default=0),
        ledger_peak_breakdown=max(good, key=lambda b: b.ledger_peak_bytes).ledger_peak_breakdown if good else {},
        profile=tuple((op, s, calls) for b in good for op, s, calls in b.profile),
        fused=any(b.fused for b in good), redone_steps=sum(b.redone_steps for b in good),
        experts=next((b.experts for b in good if b.experts), ""),
    )


def cpu_seconds() -> tuple[float, float, float]:
    """(wall clock, CPU seconds all processes used, CPU seconds this process and its waited-for children used)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return time.monotonic(), 0.0, 0.0
    busy = sum(ticks) - ticks[3] - ticks[4]  # user nice system irq softirq: everything but idle and iowait
    ours = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
    return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), ours


def others_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Mean CPU cores that other users of the machine kept busy between two readings: timings on a shared
    machine mean little without it."""
    wall = after[0] - before[0]
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall if wall > 0 else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


class Runner:
    def __init__(self, workdir: Path, console: Console, child_timeout_s: float) -> None:
        self.workdir, self.console, self.child_timeout_s = workdir, console, child_timeout_s

    def _env(self, spec: RunSpec, rank: int, port: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        env["PYTHONUNBUFFERED"] = "1"
        if spec.contender in ("stream", "resident"):  # as the `streamer` command runs them
            env.update({k: v for k, v in {**PROCESS_ENV, **MALLOC_ENV}.items() if k not in env})
        if spec.contender == "deepspeed":
            env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator; without it, it looks for CUDA
        if spec.world > 1:  # what torchrun would set for this rank
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(spec.world),
                       LOCAL_WORLD_SIZE=str(spec.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return env

    def block(self, spec: RunSpec, round_index: int) -> Measured:
        """One fresh process per rank; the result is rank 0's, with the largest peak RSS of any rank."""
        run_dir = self.workdir / "runs" / f"{_slug(spec.label)}-r{round_index}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        spec_json = json.dumps({**json.loads(spec.to_json()), "workdir": str(run_dir)})
        port = _free_port()
        logs = [run_dir / f"rank{rank}.log" for rank in range(spec.world)]
        procs, before = [], cpu_seconds()
        for rank, log in enumerate(logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.worker", spec_json],
                                              stdout=out, stderr=subprocess.STDOUT, env=self._env(spec, rank, port)))
        results = [self._wait(proc, log, spec.label) for proc, log in zip(procs, logs, strict=True)]
        others = others_cores(before, cpu_seconds())
        shutil.rmtree(run_dir, ignore_errors=True)  # a disk-tier store can be tens of GB
        first = results[0]
        if first.ok and spec.world > 1:
            failed = next((r for r in results if not r.ok), None)
            if failed is not None:
                first.ok, first.error = False, failed.error
            first.step_rss_peak_bytes = max(r.step_rss_peak_bytes for r in results)
            first.process_rss_peak_bytes = max(r.process_rss_peak_bytes for r in results)
        first.others_cores = others
        return first

    def _wait(self, proc: subprocess.Popen, log: Path, label: str) -> Measured:
        try:
            proc.wait(timeout=self.child_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return Measured(label, ok=False, error=f"no result within {self.child_timeout_s:.0f} s (killed)")
        text = log.read_text(errors="replace")
        for line in reversed(text.splitlines()):
            if line.startswith(RESULT_TAG):
                raw = json.loads(line[len(RESULT_TAG):])
                return Measured(**{f.name: raw[f.name] for f in fields(Measured)})
        tail = " | ".join(text.strip().splitlines()[-6:])
        return Measured(label, ok=False, error=f"exit status {proc.returncode} without a result: {tail}"[-2000:])

    def _logged_block(self, spec: RunSpec, r: int, rounds: int) -> Measured:
        self.console.print(f"[bold]{spec.label}[/]: round {r + 1}/{rounds} "
                           f"({spec.warmup} warm-up + {spec.steps} timed steps) ...")
        measured = self.block(spec, r)
        if measured.ok:
            planned = (f" (planned {measured.planned_host_bytes / 2**30:.2f} GiB)"
                       if measured.planned_host_bytes else "")
            self.console.print(f"  median {statistics.median(measured.step_s):.3g} s/step "
                               f"(setup {measured.setup_s:.0f} s), "
                               f"peak RSS {measured.step_rss_peak_bytes / 2**30:.2f} GiB over the steps, "
                               f"{measured.process_rss_peak_bytes / 2**30:.2f} GiB over the run{planned}, "
                               f"others' load {measured.others_cores:.1f} cores")
        else:
            self.console.print(f"  [red]failed[/]: {measured.error[:300]}")
        return measured

    def compare(self, specs: list[RunSpec], rounds: int) -> dict[str, Result]:
        """Every spec in `rounds` blocks; odd rounds run the contenders in reverse order (ABBA)."""
        blocks: dict[str, list[Measured]] = {s.label: [] for s in specs}
        for r in range(rounds):
            for spec in specs if r % 2 == 0 else list(reversed(specs)):
                # One profiled step, in the last block only, so that the profiler never slows a timed step.
                spec = dataclasses.replace(spec, profile=spec.profile and r == rounds - 1)
                blocks[spec.label].append(self._logged_block(spec, r, rounds))
        return {s.label: merge(s, blocks[s.label]) for s in specs}

    def bracket(self, outer: RunSpec, inner: RunSpec) -> dict[str, Result]:
        """`inner` in one block between two blocks of `outer`, pooled: a reference for a long run measured under
        the load the machine had before and after it (on a shared machine the load drifts over minutes)."""
        before = self._logged_block(outer, 0, 2)
        middle = self._logged_block(inner, 0, 1)
        after = self._logged_block(outer, 1, 2)
        return {outer.label: merge(outer, [before, after]), inner.label: merge(inner, [middle])}
