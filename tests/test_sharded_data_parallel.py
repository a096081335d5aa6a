"""Data parallel with the state sharded: 2 gloo processes, each storing and updating half of every unit, equal
one process on the same global batch, resume, refuse another number of processes, and store half the bytes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from streamer import StreamingTrainer
from streamer.errors import StoreError
from tests.test_distributed import CFG, TC, _free_port, _max_diff, _rank_main, global_batches, single_process

SHARDED = TC.replace(data_parallel="sharded")


def run_sharded(tmp_path: Path, phases: list[tuple[str, int]], tc=SHARDED) -> list[dict]:
    out = str(tmp_path / "result")
    mp.spawn(_rank_main, args=(2, _free_port(), str(tmp_path / "run"), phases, out, tc), nprocs=2, join=True)
    return [torch.load(f"{out}.{r}") for r in range(2)]


def _bytes_under(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.parametrize("store", ["disk", "ram"])
def test_two_sharded_ranks_equal_one_process(tmp_path, store):
    tc = SHARDED.replace(store=store)
    ranks = run_sharded(tmp_path, [("new", 3)], tc)
    reference = single_process(tmp_path, 3, tc.replace(data_parallel="replicated"))
    assert _max_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0  # the same gathered weights on every rank
    diff = _max_diff(ranks[0]["state"], reference["state"])
    print("max abs difference vs one process", diff)
    assert diff <= 1e-5
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], abs=2e-6)


@pytest.mark.slow
def test_sharded_resume_equals_one_process_and_each_store_is_half(tmp_path):
    ranks = run_sharded(tmp_path, [("new", 2), ("open", 1)])
    reference = single_process(tmp_path, 3)
    assert _max_diff(ranks[1]["state"], reference["state"]) <= 1e-5
    replicated = tmp_path / "replicated"
    replicated.mkdir()
    run_sharded(replicated, [("new", 1)], TC)
    whole = _bytes_under(replicated / "run" / "rank0")
    halves = [_bytes_under(tmp_path / "run" / f"rank{r}") for r in range(2)]
    print("per-rank store bytes: replicated", whole, "sharded", halves)
    assert all(0.45 * whole <= half <= 0.55 * whole for half in halves)


def _open_alone(run: Path) -> None:
    StreamingTrainer.open(run)


@pytest.mark.slow
def test_sharded_run_refuses_another_number_of_processes(tmp_path):
    run_sharded(tmp_path, [("new", 1)])
    with pytest.raises(StoreError, match=r"2 process\(es\) and this is 1; resume it with torchrun --nproc-per-node 2"):
        StreamingTrainer.open(tmp_path / "run")
    with pytest.raises(StoreError, match=r"holds 1/2 of a run's state .* torchrun --nproc-per-node 2"):
        StreamingTrainer.open(tmp_path / "run" / "rank0")
    assert len(list((tmp_path / "run" / "rank0" / "slabs").iterdir())) > 0  # nothing was deleted
