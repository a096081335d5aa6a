"""Crash safety and resume, disk full, and non-finite values (issue #6).

The kill tests fork children from a forkserver that has imported torch (tests/crash_driver.py). Each chain
kills one run again and again at targeted points (in forward, backward, update, mid-write of a gradient or
state slab, before an fsync, right after a rename, during the roll-forward of a previous crash) and at random
times; after every kill the store on disk is checked to hold one step or a journaled step and its successor,
and every other time it is opened here and compared with the reference run's weights at that step.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from crash_driver import CFG, Job, Kill
from streamer import NonFiniteError, StoreError, StreamingTrainer, TrainerConfig
from streamer.store import direct
from streamer.store.slabfile import TRAILER_BYTES, Trailer, file_checksum
from benchmarks.soak import soak
from conftest import assert_same_tensors, poison_gradient, run_child

STEPS, KILLS = 20, 12  # per chain


def steps_on_disk(store: Path) -> tuple[dict[str, int], dict | None]:
    """The step each unit's state file holds, read without changing anything, and the pending journal.

    Every file used must be whole (trailer, size, checksum); without a pending journal all units hold the
    manifest's step, with one each unit holds that step or the journaled next one.
    """
    manifest = json.loads((store / "manifest.json").read_text())
    journal_path = store / "journal.json"
    journal = json.loads(journal_path.read_text()) if journal_path.exists() else None
    if journal is not None and journal["step"] <= manifest["step"]:
        journal = None  # committed; only its removal was cut short
    steps = {}
    for unit, generation in manifest["units"].items():
        path, step = store / "slabs" / f"{unit}.{generation}.state", manifest["step"]
        if journal is not None:
            assert journal["step"] == manifest["step"] + 1
            rolled = store / "slabs" / f"{unit}.{journal['generation']}.state"
            if rolled.exists():
                path, step = rolled, journal["step"]
        trailer = Trailer.read(path, unit)
        assert path.stat().st_size == trailer.data_bytes + TRAILER_BYTES
        assert file_checksum(path, trailer.data_bytes) == trailer.checksum
        steps[unit] = step
    if journal is None:
        assert set(steps.values()) == {manifest["step"]}
    return steps, journal


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differ: {different}"


def state_files(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((store / "slabs").glob("*.state"))}


def kill_plan(rnd: random.Random, calls: dict[str, dict[str, int]], done: int, units_pending: int | None
              ) -> Kill | float:
    """The next kill: often in the roll-forward when a crash left one (`units_pending` not None), else a
    target in the next step or two, or a random time (seconds)."""
    if units_pending is not None and rnd.random() < 0.5:
        if units_pending:  # each pending unit writes, syncs and renames a file; then comes the manifest
            target = rnd.choice(["pwritev", "replace", "fdatasync", "fsync"])
            return Kill(target, 1 if target == "fdatasync" else rnd.randint(1, 2), step=None)
        return Kill(rnd.choice(["replace", "fsync"]), 1, step=None)  # only the manifest is left to write
    step = done + rnd.choice([1, 1, 2])
    counts = calls[str(step)]
    target = rnd.choice(["forward", "backward", "update", "pwritev-grad", "pwritev-state", "fdatasync", "fsync",
                         "replace", "time"])
    if target == "time":
        return rnd.uniform(0.0, 0.3)
    grad_writes = (CFG.n_layer + 2) * 2  # units x micro-batches: the first pwritev calls of a step
    if target == "pwritev-grad":
        return Kill("pwritev", rnd.randint(1, grad_writes), step)
    if target == "pwritev-state":
        return Kill("pwritev", rnd.randint(grad_writes + 1, counts["pwritev"]), step)
    return Kill(target, rnd.randint(1, counts[target]), step)


KILL_SETTINGS = [("bf16", "disk", "fused"), ("fp32", "disk", "after-backward"), ("bf16", "ram", "after-backward"),
                 ("fp32", "ram", "fused")]


def test_the_readme_counts_the_trials_this_file_runs() -> None:
    trials = len(KILL_SETTINGS) * (KILLS + 1)  # KILLS per chain, and one before the first commit
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f"{trials} SIGKILL trials in `tests/test_reliability.py`: {len(KILL_SETTINGS)} settings × {KILLS + 1}" \
        in " ".join(readme.split())


@pytest.mark.parametrize("dtype,compute,timing", KILL_SETTINGS)
def test_sigkill_anywhere_then_resume_is_bit_identical(tmp_path, forkserver, dtype, compute, timing):
    ref = tmp_path / "ref"
    ref.mkdir()
    job = Job(str(ref / "store"), STEPS, dtype, compute, timing, record=str(ref), out=str(ref / "out.pt"))
    assert run_child(forkserver, job) == 0
    calls = json.loads((ref / "calls.json").read_text())
    reference = torch.load(ref / "out.pt")
    store, rnd = tmp_path / "store", random.Random(f"kill-{dtype}-{compute}-{timing}")

    # A kill before the first commit leaves a folder that says so, and is never taken for a store.
    first_write = Kill("pwritev", 3, step=None)
    assert run_child(forkserver, Job(str(store), STEPS, dtype, compute, timing, kill=first_write)) == -9
    with pytest.raises(StoreError, match="nothing was committed"):
        StreamingTrainer.open(store)
    shutil.rmtree(store)
    assert run_child(forkserver, Job(str(store), 1, dtype, compute, timing)) == 0

    done, journal, steps, kills, log = 1, None, {}, 0, []
    while kills < KILLS:
        assert done < STEPS - 2, f"the run ended before {KILLS} kills: {log}"
        pending = None if journal is None else sum(s != journal["step"] for s in steps.values())
        kill = kill_plan(rnd, calls, done, pending)
        if isinstance(kill, Kill):
            assert run_child(forkserver, Job(str(store), STEPS, dtype, compute, timing, kill=kill)) == -9, (kill, log)
        else:  # a random instant of a run of two more steps (it may also finish them)
            code = run_child(forkserver, Job(str(store), done + 2, dtype, compute, timing), kill_after=kill)
            assert code in (-9, 0), f"child failed ({code})"
            kill = kill if code == -9 else None
        kills += kill is not None
        steps, journal = steps_on_disk(store)
        done = max(steps.values()) if journal is None else journal["step"]  # the next open finishes it
        log.append((kill, steps, journal is not None))
        if kills % 2 == 0:  # resume here: roll forward and compare with the reference at that step
            with StreamingTrainer.open(store) as trainer:
                done, journal = trainer.step_count, None
                assert_same_weights(trainer.state_dict(), torch.load(ref / f"state.{done}.pt"))

    assert run_child(forkserver, Job(str(store), STEPS, dtype, compute, timing, out=str(tmp_path / "out.pt"))) == 0
    resumed = torch.load(tmp_path / "out.pt")
    assert_same_weights(resumed["state"], reference["state"])
    assert resumed["losses"] == reference["losses"] and resumed["extra"] == reference["extra"]
    assert state_files(store) == state_files(ref / "store")  # Adam moments and compute weights too


# --- disk full ------------------------------------------------------------------------------------------

DEBUG_TC = TrainerConfig.of(store="disk", dtype="bf16", grad_accum=2, update_chunk=8192, lr=3e-3,
                            update_timing="after-backward")  # the journaled commit; fused below


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, CFG.vocab_size, (4, 32), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict[str, torch.Tensor], list[float]]:
    return _run_through(DEBUG_TC, tmp_path_factory.mktemp("ref") / "run")


@pytest.fixture(scope="module")
def uninterrupted_unclipped(tmp_path_factory) -> tuple[dict[str, torch.Tensor], list[float]]:
    return _run_through(DEBUG_TC.replace(max_grad_norm=0), tmp_path_factory.mktemp("ref") / "run")


def _run_through(tc: TrainerConfig, root: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    with StreamingTrainer(CFG, tc, store_dir=root) as trainer:
        for ids in batches(4):
            trainer.step(ids)
        return trainer.state_dict(), trainer.losses


def fail_on_call(monkeypatch, name: str, n: int, error: int = errno.ENOSPC) -> None:
    """os.<name> raises `error` from its n-th call on (the disk stays full)."""
    original, count = getattr(os, name), [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] >= n:
            raise OSError(error, os.strerror(error))
        return original(*args, **kwargs)

    monkeypatch.setattr(os, name, failing)


def fill_disk_in_step_3(trainer: StreamingTrainer, data: list[torch.Tensor], monkeypatch, name: str, n: int) -> None:
    """Two steps, then a third whose n-th call of os.<name> on finds the disk full."""
    for ids in data[:2]:
        trainer.step(ids)
    with monkeypatch.context() as patch:
        fail_on_call(patch, name, n)
        with pytest.raises(StoreError, match="disk full.*last committed step is intact"):
            trainer.step(data[2])


# Step 3's pwritev calls 1-8 write gradients (before the journal), 9-19 the new state files (after it: per unit
# its staged data, its unaligned tail and its trailer). Its
# fdatasyncs: 1-4 the gradients, 5-8 the units' new files; fsyncs: 1-2 the journal and its folder, 3-10 the
# units' trailers and the folder, 11-12 the manifest.
@pytest.mark.parametrize("name,n,committed", [("pwritev", 5, 2), ("pwritev", 12, 3), ("pwritev", 19, 3),
                                              ("fdatasync", 2, 2), ("fsync", 1, 2), ("fdatasync", 6, 3),
                                              ("fsync", 11, 3)])
def test_disk_full_is_a_clear_error_and_the_run_resumes_identically(tmp_path, monkeypatch, uninterrupted,
                                                                    name, n, committed):
    data = batches(4)
    with StreamingTrainer(CFG, DEBUG_TC, store_dir=tmp_path / "run") as trainer:
        fill_disk_in_step_3(trainer, data, monkeypatch, name, n)
        if committed == 3:  # the journal holds step 3: this process must not train on a half-updated model
            with pytest.raises(StoreError, match="reopen the run"):
                trainer.step(data[3])
    assert not list((tmp_path / "run" / "slabs").glob("*.tmp")) or committed == 3
    with StreamingTrainer.open(tmp_path / "run") as trainer:  # space is back: roll forward if journaled
        assert trainer.step_count == committed
        for ids in data[committed:]:
            trainer.step(ids)
        assert_same_weights(trainer.state_dict(), uninterrupted[0])
        assert trainer.losses == uninterrupted[1]


def test_a_failed_stage_write_on_the_writer_thread_is_the_same_clear_error(tmp_path, monkeypatch, uninterrupted):
    """With stages smaller than a state file, full stages are written on a helper thread while the next fills:
    the disk filling up under that thread's write reaches the step as any write's error does, and the run
    resumes identically."""
    monkeypatch.setattr(direct, "STAGE_BYTES", 8 * 4096)
    original, full = os.pwritev, []

    def filling_on_the_writer_thread(*args: Any) -> int:
        if threading.current_thread().name.startswith("store-direct-write"):
            full.append(True)
        if full:  # from the writer thread's first write on, the disk stays full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(*args)

    data = batches(4)
    with StreamingTrainer(CFG, DEBUG_TC, store_dir=tmp_path / "run") as trainer:
        for ids in data[:2]:
            trainer.step(ids)
        with monkeypatch.context() as patch:
            patch.setattr(os, "pwritev", filling_on_the_writer_thread)
            with pytest.raises(StoreError, match="disk full.*last committed step is intact"):
                trainer.step(data[2])
        assert full
    with StreamingTrainer.open(tmp_path / "run") as trainer:  # space is back: the journaled step rolls forward
        assert trainer.step_count == 3
        trainer.step(data[3])
        assert_same_weights(trainer.state_dict(), uninterrupted[0])
        assert trainer.losses == uninterrupted[1]


# A fused step (no clipping, so that every step is one) writes the first micro-batch's gradients with pwritev
# calls 1-4, then the units' new state files; fdatasync 1-4 flush those files, fsync their trailers and folder.
@pytest.mark.parametrize("name,n", [("pwritev", 3), ("pwritev", 10), ("fdatasync", 2), ("fsync", 3)])
def test_disk_full_in_a_fused_step_rolls_it_back_and_training_goes_on(tmp_path, monkeypatch,
                                                                      uninterrupted_unclipped, name, n):
    """A fused step has no journal: a failed write returns every unit to the previous step, in this process
    too, which trains on once space is back and ends as the uninterrupted run (after the backward) did."""
    data = batches(4)
    fused = DEBUG_TC.replace(update_timing="fused", max_grad_norm=0)
    with StreamingTrainer(CFG, fused, store_dir=tmp_path / "run") as trainer:
        fill_disk_in_step_3(trainer, data, monkeypatch, name, n)
        assert trainer.step_count == 2 and trainer.clipped_redos == 0
        assert not list((tmp_path / "run" / "slabs").glob("*.tmp"))
        for ids in data[2:]:
            trainer.step(ids)
        assert_same_weights(trainer.state_dict(), uninterrupted_unclipped[0])
        assert trainer.losses == uninterrupted_unclipped[1]


# --- non-finite values ------------------------------------------------------------------------------------

def test_nonfinite_gradient_stops_naming_the_first_unit_and_commits_nothing(tmp_path, monkeypatch):
    data = batches(2)
    with StreamingTrainer(CFG, DEBUG_TC, store_dir=tmp_path / "run") as trainer:
        trainer.step(data[0])
        before = trainer.state_dict()
        with monkeypatch.context() as patch:
            poison_gradient(patch, "block.0")
            with pytest.raises(NonFiniteError, match="block.0"):
                trainer.step(data[1])
        assert trainer.step_count == 1
    assert not (tmp_path / "run" / "journal.json").exists()
    with StreamingTrainer.open(tmp_path / "run") as trainer:
        assert trainer.step_count == 1 and len(trainer.losses) == 1
        state = trainer.state_dict()
        assert all(torch.isfinite(t).all() for t in state.values())
        assert_same_weights(state, before)


def test_nonfinite_loss_names_the_head(tmp_path):
    with StreamingTrainer(CFG, DEBUG_TC, store_dir=tmp_path / "run") as trainer:
        weights = trainer.state_dict()
        weights["lm_head.bias"][3] = float("inf")
        trainer.load_state_dict(weights)
        with pytest.raises(NonFiniteError, match="head|loss"):
            trainer.step(batches(1)[0])
        assert trainer.step_count == 0


def test_nonfinite_skip_drops_the_step_and_training_goes_on(tmp_path, monkeypatch):
    data = batches(3)
    with StreamingTrainer(CFG, DEBUG_TC, store_dir=tmp_path / "clean") as trainer:
        for ids in (data[0], data[2]):
            trainer.step(ids)
        clean = trainer.state_dict()
    with StreamingTrainer(CFG, DEBUG_TC.replace(nonfinite="skip"), store_dir=tmp_path / "run") as trainer:
        trainer.step(data[0])
        with monkeypatch.context() as patch:
            poison_gradient(patch, "block.1")
            assert torch.isnan(torch.tensor(trainer.step(data[1])))
        assert trainer.step_count == 1
        trainer.step(data[2])
        assert trainer.step_count == 2
        assert_same_weights(trainer.state_dict(), clean)


# --- soak ---------------------------------------------------------------------------------------------------

def test_short_soak_disk_tier_is_flat_and_matches_the_ram_tier():
    """The 500-step soak (python -m benchmarks.soak, docs/STORE.md) in small: 40 steps, watched after 10."""
    report = soak(steps=40, warmup=10)
    assert report.soaked.store == "disk" and report.other is not None and report.other.store == "ram"
    assert report.same_loss, "the disk tier's loss curve differs from the RAM tier's"
    assert report.fd_growth == 0, f"open file descriptors grew: {report.soaked.fds}"
    assert report.rss_growth < 0.05, report.summary()
    assert report.soaked.losses[-1] < report.soaked.losses[0] - 1.0  # it trains
    assert report.passed


@pytest.mark.parametrize("timing,kill", [("after-backward", Kill("update", 5, step=3)),
                                         ("fused", Kill("update", 9, step=3))])
@pytest.mark.parametrize("dtype,master,moments", [("fp32", "fp32", "int8"), ("bf16", "bf16", "int8")],
                         ids=["int8-moments", "bf16-master-int8-moments"])
def test_the_opt_in_precisions_killed_mid_update_resume_bit_identically(tmp_path, forkserver, timing, kill, dtype,
                                                                          master, moments):
    """A SIGKILL in step 3's update: the journaled step rolls forward from its gradients, the fused one returns
    to step 2; either way the quantized moments and the stochastic rounding come out the same again, and the
    run ends with the uninterrupted run's weights, losses and state files."""
    def job(store: Path, **extra: Any) -> Job:
        return Job(str(store), 5, dtype, "disk", timing, master=master, moments=moments, **extra)

    assert run_child(forkserver, job(tmp_path / "ref", out=str(tmp_path / "ref.pt"))) == 0
    assert run_child(forkserver, job(tmp_path / "run", kill=kill)) == -9
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["step"] == 2
    assert (manifest["spec"]["master_dtype"], manifest["spec"]["moment_dtype"]) == (master, moments)
    assert (tmp_path / "run" / "journal.json").exists() == (timing == "after-backward")
    assert run_child(forkserver, job(tmp_path / "run", out=str(tmp_path / "run.pt"))) == 0
    ref, resumed = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    assert_same_tensors(resumed["state"], ref["state"])
    assert resumed["losses"] == ref["losses"]
    files = [{p.name: p.read_bytes() for p in sorted((root / "slabs").glob("*.state"))}
             for root in (tmp_path / "ref", tmp_path / "run")]
    assert files[0] == files[1]  # the quantized moments and their scales too
