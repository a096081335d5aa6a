"""Data parallel with the state sharded: 2 gloo processes, each storing and updating half of every unit, equal
one process on the same global batch, resume (after a SIGKILL too), store half the bytes each, are read by one
process and refuse to be trained by another number of processes."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from layers import PRESETS, ModelConfig
from memory_model import PlanConfig, device_spec, plan
from streamer import StreamingTrainer
from streamer.resources import DISK_HEADROOM, HostNeed
from streamer.errors import StoreError
from streamer.runtime.distributed import leave_process_group
from tests.test_distributed import (CFG, TC, _free_port, _max_diff, _rank_main, global_batches, prompt_masked,
                                   single_process)

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
    assert diff <= 1e-5  # measured 4.3e-6 (native) / 2.6e-6 (AVX2 cap), both tiers
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], abs=2e-6)
    # Each rank's device peak (the whole unit all-gathered, the padded fp32 gradient and its reduce-scattered
    # slice included) is what the planner predicts for sharded ranks.
    planned = plan(CFG, device_spec("h100-sxm"), PlanConfig.of(
        batch=4, seq=32, compute_dtype="fp32", store=store, update_chunk=10_000, devices=2,
        data_parallel="sharded")).peak_device_bytes
    assert [r["peak"] for r in ranks] == [planned, planned]


@pytest.mark.slow
def test_sharded_resume_store_size_and_one_process_reading_it(tmp_path):
    ranks = run_sharded(tmp_path, [("new", 2), ("open", 1)])
    reference = single_process(tmp_path, 3)
    assert _max_diff(ranks[1]["state"], reference["state"]) <= 1e-5
    # One process's store is what each replicated rank keeps; each sharded rank keeps half of it.
    whole = _bytes_under(tmp_path / "single")
    halves = [_bytes_under(tmp_path / "run" / f"rank{r}") for r in range(2)]
    print("per-rank store bytes: replicated", whole, "sharded", halves)
    assert all(0.45 * whole <= half <= 0.55 * whole for half in halves)
    with StreamingTrainer.open(tmp_path / "run") as alone:  # every rank's slice: how generate and export read it
        assert alone.step_count == 3
        assert _max_diff(alone.state_dict(), ranks[0]["state"]) == 0.0
        with pytest.raises(StoreError, match=r"sharded over 2 processes, read here by one; train it with torchrun "
                                             r"--nproc-per-node 2"):
            alone.step(global_batches(1)[0])
    with pytest.raises(StoreError, match=r"holds 1/2 of a run's state .* or train with torchrun --nproc-per-node 2"):
        StreamingTrainer.open(tmp_path / "run" / "rank0")
    assert _bytes_under(tmp_path / "run" / "rank0") == halves[0]  # refusing changed nothing


def _killed_main(rank: int, world: int, port: int, run: str, cfg: ModelConfig = CFG) -> None:
    """Two steps; rank 1 SIGKILLs itself at its second state write of step 2, after every rank journaled it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    data = global_batches(2)
    trainer = StreamingTrainer(cfg, SHARDED, store_dir=run)
    trainer.step(data[0], prompt_masked(data[0]))
    if rank == 1:
        write_back, writes = trainer.executor.updater._write_back, []

        def dying(*args: object) -> None:
            writes.append(args)
            if len(writes) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            write_back(*args)

        trainer.executor.updater._write_back = dying
    trainer.step(data[1], prompt_masked(data[1]))
    trainer.step(data[1], prompt_masked(data[1]))  # rank 0 waits here for rank 1, which is gone


def _resumed_main(rank: int, world: int, port: int, run: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    with StreamingTrainer.open(run) as trainer:
        steps = trainer.step_count
        ids = global_batches(3)[2]
        trainer.step(ids, prompt_masked(ids))
        torch.save({"state": trainer.state_dict(), "steps": steps}, f"{out}.{rank}")
    leave_process_group()


@pytest.mark.slow
def test_a_rank_killed_mid_update_resumes_to_the_uninterrupted_result(tmp_path):
    run = str(tmp_path / "run")
    with pytest.raises(mp.ProcessExitedException):
        mp.spawn(_killed_main, args=(2, _free_port(), run), nprocs=2, join=True)
    out = str(tmp_path / "result")
    mp.spawn(_resumed_main, args=(2, _free_port(), run, out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    assert [r["steps"] for r in ranks] == [2, 2]  # the journaled step 2 was rolled forward on rank 1
    assert _max_diff(ranks[0]["state"], single_process(tmp_path, 3)["state"]) <= 1e-5


@pytest.mark.slow
def test_lora_on_a_sharded_base_equals_one_process_and_resumes(tmp_path):
    tc = TC.replace(lr=1e-2, lora_rank=4, lora_targets="q_proj,v_proj,fc_out")
    ranks = run_sharded(tmp_path, [("new", 2), ("open", 1)], tc.replace(data_parallel="sharded"))
    # The adapters, whole on every rank, are all-reduced (not scattered); the frozen base is gathered.
    assert _max_diff(ranks[0]["state"], single_process(tmp_path, 3, tc)["state"]) <= 1e-5  # measured 0


def test_the_resource_check_and_the_planner_count_each_processes_slice():
    replicated = HostNeed.of(CFG, TC, stores_on_disk=2, stores_in_ram=2)
    sharded = HostNeed.of(CFG, SHARDED, stores_on_disk=2, stores_in_ram=2)
    margin = DISK_HEADROOM[0]  # the fixed part of the headroom; the rest is a fraction of the stores
    assert sharded.disk - margin == pytest.approx((replicated.disk - margin) / 2, rel=0.01)
    step = PlanConfig.of(batch=8, seq=2048, devices=4)
    whole = plan(PRESETS["gptj-6b"], device_spec("a100-80g"), step).host_store_bytes
    quarter = plan(PRESETS["gptj-6b"], device_spec("a100-80g"), step.replace(data_parallel="sharded")).host_store_bytes
    assert quarter == pytest.approx(whole / 4, rel=1e-6)
