"""A step that clips, made norm-first: a norm pass, then the fused step clipped by the coefficient it gives.

The fused pass recomputes the norm pass's gradients bit for bit on the CPU, so a norm-first run ends with the
weights, moments and losses of the update after the backward. These tests compare the two schedules on the
disk tier's placements, count the store's bytes against the planner's, check the refusals, the choice of
`auto`, and a SIGKILL in either pass.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import DEBUG_MODEL, assert_same_tensors, debug_batches, run_child, train_debug
from crash_driver import Job, Kill
from memory_model import PlanConfig, device_spec
from memory_model.planner import clipped_schedule, clipped_steps
from streamer import Placement, StreamingTrainer, TrainerConfig
from streamer.errors import ConfigError

STEPS = 4
DISK = TrainerConfig.of(store="disk", dtype="fp32", update_chunk=5000, lr=3e-3)


def state_files(store: Path) -> dict[str, bytes]:
    """Every unit's state file: masters and Adam moments, as stored."""
    return {p.name: p.read_bytes() for p in sorted((store / "slabs").glob("*.state"))}


@pytest.mark.parametrize("settings", [dict(), dict(dtype="bf16", moment_dtype="bf16"),
                                      dict(store=Placement("ram", "disk", "disk"), dtype="bf16"),
                                      dict(update_on="host", activations="offload", prefetch=2)],
                         ids=["fp32", "bf16-moments", "compute-in-ram", "host-update-offloaded-inputs"])
def test_norm_first_is_bit_identical_to_the_update_after_the_backward(tmp_path, settings):
    base = DISK.replace(**settings)
    norms = sorted(train_debug(tmp_path / "free", base.replace(max_grad_norm=0), STEPS).norms)
    limit = (norms[1] + norms[2]) / 2  # some steps clip, some do not
    after = train_debug(tmp_path / "after", base.replace(max_grad_norm=limit, update_timing="after-backward"), STEPS)
    first = train_debug(tmp_path / "first", base.replace(max_grad_norm=limit, clipped_steps="norm-first"), STEPS)
    assert 0 < sum(n > limit for n in after.norms) < STEPS
    assert after.losses == first.losses and after.norms == first.norms
    assert_same_tensors(after.weights, first.weights)
    assert state_files(tmp_path / "after") == state_files(tmp_path / "first")  # the moments too


def test_a_norm_first_steps_store_bytes_are_the_planners(tmp_path):
    """Every step clips: after the first (a speculative fused attempt undone), each is a norm pass and a fused
    step, whose store bytes are exactly the planner's for the norm-first schedule."""
    tc = DISK.replace(moment_dtype="bf16", max_grad_norm=1e-3, clipped_steps="norm-first")
    run = train_debug(tmp_path / "run", tc, 2)
    planned = clipped_steps(DEBUG_MODEL, device_spec("h100-sxm"),
                            PlanConfig.of(batch=2, seq=16, compute_dtype="fp32", update_chunk=5000, store="disk",
                                          moment_dtype="bf16"))
    assert run.redos == 1
    norm_first = planned["norm-first"]
    assert run.step_bytes == (norm_first.disk_read_bytes, norm_first.disk_write_bytes)
    # It writes no gradient: less than the journaled step (whose bytes test_fused_update checks).
    assert norm_first.disk_write_bytes < planned["after-backward"].disk_write_bytes


@pytest.mark.parametrize("settings,flag", [(dict(store="ram"), "--store disk"), (dict(grad_accum=2), "--grad-accum 1"),
                                           (dict(lora_rank=4), "--store disk")])
def test_norm_first_where_it_cannot_run_is_one_line(settings, flag):
    with pytest.raises(ConfigError) as err:
        TrainerConfig.of(store="disk", clipped_steps="norm-first").replace(**settings)
    message = str(err.value)
    assert "\n" not in message and "--clipped-steps" in message and flag in message


def test_auto_takes_the_schedule_the_planner_prices_faster(tmp_path):
    """On a --price-on device preset, or the cpu's calibrated target (`local_target`, which `streamer train` reads
    from runs/): the planner's choice for that target; with no target known, after-backward."""
    for priced, local in (("h100-sxm", None), ("rtx4090", None), (None, None), (None, "a100-80g")):
        tc = DISK.replace(price_on=priced)
        with StreamingTrainer(DEBUG_MODEL, tc, store_dir=tmp_path / f"{priced}{local}") as trainer:
            trainer.local_target = None if local is None else device_spec(local)
            chosen = trainer.clipped_schedule(2, 16)
        if priced is None and local is None:
            assert chosen == "after-backward"
            continue
        plans = clipped_steps(DEBUG_MODEL, device_spec(priced or local), tc.plan_config(2, 16))
        assert chosen == min(plans.values(), key=lambda p: p.step_s).schedule
        assert chosen == clipped_schedule(plans, "auto").schedule


def test_price_on_names_the_priced_device_apart_from_the_budget(tmp_path, capsys):
    """--budget stays a memory limit; --price-on names the device `auto` is priced on. A wrong name is one line
    naming the flag."""
    from test_cli import fails

    tc = DISK.replace(budget="64MiB", price_on="rtx4090")
    assert tc.device.budget_bytes() == 64 * 2**20
    with StreamingTrainer(DEBUG_MODEL, tc, store_dir=tmp_path / "run") as trainer:
        assert trainer.target() == device_spec("rtx4090")
        plans = clipped_steps(DEBUG_MODEL, device_spec("rtx4090"), tc.plan_config(2, 16))
        assert trainer.clipped_schedule(2, 16) == clipped_schedule(plans, "auto").schedule
    assert "--price-on" in fails(capsys, "train", "--price-on", "h900", "--run-dir", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_budget_preset_alone_prices_nothing(capsys, tmp_path, tiny_setup):
    """--budget h100-sxm is a memory limit only: the run is priced as without it, on this cpu's calibrated device
    where one is given, else on none (no MFU, and `auto` clips after the backward); --price-on h100-sxm prices it."""
    from streamer.run_dir import RunDir
    from test_cli import run_cli, tiny_args

    tc = DISK.replace(budget="h100-sxm")
    assert tc.device.budget_bytes() == device_spec("h100-sxm").memory_bytes - device_spec("h100-sxm").reserve_bytes
    with StreamingTrainer(DEBUG_MODEL, tc, store_dir=tmp_path / "api") as trainer:
        assert trainer.target() is None and trainer.clipped_schedule(2, 16) == "after-backward"
        trainer.local_target = device_spec("a100-80g")
        assert trainer.target() == device_spec("a100-80g")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)  # no runs/ calibration cache here
        mfu = {}
        for flag in ("--budget", "--price-on"):
            args = tiny_args(tiny_setup, tmp_path / flag, 1, flag, "h100-sxm", "--store", "disk")
            rc, out, err = run_cli(capsys, *args)
            assert rc == 0, err
            mfu[flag] = [m.get("mfu") for m in RunDir(tmp_path / flag).read_metrics() if "loss" in m]
            assert ("no MFU: no peak FLOP/s is known for this device" in out) == (flag == "--budget")
    assert mfu["--budget"] == [None] and mfu["--price-on"][0] > 0


@pytest.mark.parametrize("kill", [Kill("backward", 3, step=3), Kill("update", 5, step=3), Kill("pwritev", 4, step=3)],
                         ids=["norm-pass", "fused-update", "fused-write"])
def test_a_norm_first_step_killed_resumes_bit_identically(tmp_path, forkserver, kill):
    """SIGKILL in step 3's norm pass (nothing written yet) or in its fused pass (a speculative step): the run
    returns to step 2 and ends with the uninterrupted run's weights, losses and state files."""
    def job(store: Path, **extra) -> Job:
        return Job(str(store), 5, "fp32", "disk", "norm-first", **extra)

    assert run_child(forkserver, job(tmp_path / "ref", out=str(tmp_path / "ref.pt"))) == 0
    assert run_child(forkserver, job(tmp_path / "run", kill=kill)) == -9
    assert not (tmp_path / "run" / "journal.json").exists()
    assert run_child(forkserver, job(tmp_path / "run", out=str(tmp_path / "run.pt"))) == 0
    ref, resumed = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    assert_same_tensors(resumed["state"], ref["state"])
    assert resumed["losses"] == ref["losses"]
    assert state_files(tmp_path / "run") == state_files(tmp_path / "ref")


def test_gptj_6b_on_a_gpu_takes_norm_first():
    """docs/MEMORY_MODEL.md: on h100-sxm's disk tier the gradients' round trip costs more than a second forward
    and backward, and a norm-first step writes 4 B/param less."""
    from layers import GPTJConfig

    shape = GPTJConfig.preset("gptj-6b")
    pc = PlanConfig.of(batch=1, seq=2048, activations="checkpoint", store="disk")
    plans = clipped_steps(shape, device_spec("h100-sxm"), pc)
    assert clipped_schedule(plans, "auto").schedule == "norm-first"
    assert plans["norm-first"].step_s < plans["after-backward"].step_s
    written = {name: p.disk_write_bytes / shape.num_params() for name, p in plans.items()}
    assert written == {"norm-first": 12.0, "after-backward": 16.0}


def test_a_tied_model_norm_first_is_bit_identical_and_its_bytes_are_planned(tmp_path):
    """A tied head folds the embedding's part of its gradient into the embedding's accumulator, which the norm
    pass persists for the embedding's own backward, as a fused step does: the same bits as after the backward,
    and the store's bytes of each norm-first step are the plan's."""
    import dataclasses

    from layers import PRESETS

    cfg = dataclasses.replace(PRESETS["llama-debug"], tie_word_embeddings=True)
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, cfg.vocab_size, (2, 24), generator=g) for _ in range(3)]
    runs = {}
    for schedule in ("after-backward", "norm-first"):
        tc = DISK.replace(max_grad_norm=1e-3, clipped_steps=schedule)
        with StreamingTrainer(cfg, tc, store_dir=tmp_path / schedule) as trainer:
            losses = [trainer.step(ids) for ids in data]
            runs[schedule] = losses, trainer.state_dict(), trainer.step_bytes
            planned = clipped_steps(cfg, device_spec("h100-sxm"), tc.plan_config(2, 24))[schedule]
            assert trainer.step_bytes == (planned.disk_read_bytes, planned.disk_write_bytes)
    assert runs["after-backward"][0] == runs["norm-first"][0]
    assert_same_tensors(runs["after-backward"][1], runs["norm-first"][1])
    assert state_files(tmp_path / "after-backward") == state_files(tmp_path / "norm-first")


def test_streamer_train_prices_auto_on_this_machines_cached_calibration(capsys, tmp_path, tiny_setup):
    """`streamer train` gives the trainer the `local` calibration cached in runs/ (none is measured to train),
    with its --set figures: on a disk slow to write, every step that clips after one that did is made
    norm-first, as the planner prices it; with nothing cached, after the backward."""
    import streamer.calibration.calibrate as calibrate
    from memory_model.devices import with_sets
    from streamer.calibration.calibrate import cached_local_spec, local_spec
    from streamer.run_dir import RunDir
    from test_cli import run_cli, tiny_args
    from test_devices import TINY

    slow_writes = ("--set", "disk_write_bw=1e4")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate, "DEFAULT_SIZES", TINY)
        patch.chdir(tmp_path)
        args = tiny_args(tiny_setup, tmp_path / "r", 2, "--store", "disk", "--max-grad-norm", 1e-6, *slow_writes)
        assert run_cli(capsys, *args)[0] == 0
        steps = [m for m in RunDir(tmp_path / "r").read_metrics() if "loss" in m]
        assert [m["schedule"] for m in steps] == ["after-backward"] * 2
        cfg = RunDir.open(tmp_path / "r").read_config()
        local_spec(Path("runs"), cfg.model_config(), "fp32")  # what `streamer plan --target local` caches
        target = with_sets(cached_local_spec(Path("runs"), cfg.model_config(), "fp32"), slow_writes[1:])
        args[args.index(tmp_path / "r")] = tmp_path / "s"
        assert run_cli(capsys, *args)[0] == 0
    steps = [m for m in RunDir(tmp_path / "s").read_metrics() if "loss" in m]
    assert clipped_schedule(clipped_steps(cfg.model_config(), target, cfg.plan_config()), "auto").schedule \
        == "norm-first"
    assert [(m["schedule"], m["redone"]) for m in steps] == [("norm-first", True), ("norm-first", False)]


def test_a_fused_pass_that_still_clips_is_made_after_the_backward(tmp_path, monkeypatch):
    """Where a device's recomputed gradients cross the threshold the norm pass did not (its coefficient 1),
    the fused pass is undone as a speculative one is, and the step is made after the backward: the same bits."""
    import streamer.step_policy as step_policy

    tc = DISK.replace(max_grad_norm=1e-3)
    after = train_debug(tmp_path / "after", tc.replace(clipped_steps="after-backward"), 2)
    monkeypatch.setattr(step_policy, "clip_coefficient", lambda *args: 1.0)  # the norm pass's only
    with StreamingTrainer(DEBUG_MODEL, tc.replace(clipped_steps="norm-first"), store_dir=tmp_path / "nf") as trainer:
        for ids in debug_batches(2):
            trainer.step(ids)
        assert (trainer.last_schedule, trainer.last_redone, trainer.clipped_redos) == ("after-backward", True, 3)
        assert trainer.losses == after.losses
        assert_same_tensors(trainer.state_dict(), after.weights)
