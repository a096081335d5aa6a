"""The simulator's what-ifs: the device catalogue as users see it, plan's summary keys and scaling, the sweep,
and a prediction replayed against a real run."""
from __future__ import annotations

import csv
import json
import time
from dataclasses import replace

import pytest

from test_cli import fails, run_cli, tiny_args

from benchmarks import validate
from memory_model import DEVICE_PRESETS
from memory_model.catalogue import BASES, PUBLISHED_RUNS


def test_devices_json_has_a_basis_for_every_number(capsys):
    rc, out, _ = run_cli(capsys, "devices", "--json")
    listed = json.loads(out)
    assert rc == 0 and [d["name"] for d in listed] == list(DEVICE_PRESETS)
    for device in listed:
        for name, figure in device["fields"].items():
            assert set(figure) == {"value", "basis", "source"} and figure["basis"] in BASES, (device["name"], name)
            assert isinstance(figure["value"], (int, float)) and figure["source"]
    rc, out, _ = run_cli(capsys, "devices")
    assert rc == 0 and "matmul_efficiency" in out and "in-network" in out


def test_plan_json_summary_and_no_prediction_above_the_achievable(capsys):
    for target in DEVICE_PRESETS:
        rc, out, _ = run_cli(capsys, "plan", "--model", "gptj-6b", "--target", target, "--batch", 64, "--seq", 2048,
                             "--activations", "checkpoint", "--json")
        planned = json.loads(out)
        assert rc == 0
        for key in ("step_s", "peak_bytes", "tokens_per_s", "model_flops_per_s", "mfu", "h2d_bytes_per_step",
                    "d2h_bytes_per_step", "bottleneck", "does_not_fit"):
            assert key in planned, key
        if not planned["fits"]:  # 64 x 2048 at once overflows the 24-44 GB devices: no throughput, and why
            assert "--grad-accum" in planned["does_not_fit"] and planned["mfu"] is None
            continue
        assert planned["does_not_fit"] is None
        assert 0 < planned["mfu"] <= DEVICE_PRESETS[target].matmul_efficiency
        assert {a["name"] for a in planned["alternatives"]} >= {"ZeRO-3", "FSDP CPU offload"}
    # cs2 defaults to the update in MemoryX; a --set figure is used and reported as set.
    rc, out, _ = run_cli(capsys, "plan", "--model", "gptj-6b", "--target", "cs2", "--batch", 8, "--seq", 2048,
                         "--set", "host_update_bw=1e9", "--json")
    planned = json.loads(out)
    assert planned["config"]["update_on"] == "host" and planned["bottleneck"] == "host compute"
    for wrong, says in (("warp=9", "FIELD one of memory_bytes"), ("matmul_efficiency=2", "in (0, 1]"),
                        ("memory_bytes", "FIELD=NUMBER")):
        err = fails(capsys, "plan", "--target", "cs2", "--set", wrong)
        assert err.startswith("error: --set") and says in err, err


def test_sixteen_cs3_scale_as_the_validation_table_says_against_cerebras_15_3x(capsys):
    """`streamer plan --target cs3 --ranks 16` is the row of docs/VALIDATION.md that holds the planner against
    Cerebras' 16 CS-3: the same curve. SwarmX's tree costs it a little of linear; nothing MemoryX serves grows."""
    run = next(r for r in PUBLISHED_RUNS if r.metric == "speedup" and r.device == "cs3")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in run.step if k != "devices"]
    rc, out, _ = run_cli(capsys, "plan", "--model", "gptj-6b", "--target", "cs3", "--ranks", 16, "--batch", run.batch,
                         "--seq", run.seq, *flags, "--json")
    planned = json.loads(out)
    assert rc == 0 and planned["scaling"][-1]["devices"] == 16 and planned["config"]["update_on"] == "host"
    speedup = 16 * planned["scaling"][-1]["efficiency"]
    assert validate.predict(run).predicted == pytest.approx(speedup, rel=1e-12)
    assert run.measured.value < speedup < 16 and abs(speedup / run.measured.value - 1) <= validate.GOAL_CASE


def test_sweep_writes_100_points_in_under_10_seconds(capsys, tmp_path):
    began = time.perf_counter()
    rc, out, _ = run_cli(capsys, "plan", "--model", "gptj-6b", "--activations", "checkpoint", "--sweep", tmp_path)
    took = time.perf_counter() - began
    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rc == 0 and len(rows) >= 100 and took / len(rows) * 100 < 10, (len(rows), took)
    assert {"batch", "seq", "target", "tier", "update_on", "step_s", "mfu", "peak_bytes"} <= set(rows[0])
    assert (tmp_path / "roofline.png").stat().st_size > 10_000


def test_compare_replays_a_finished_run_with_its_own_set_figures(capsys, tmp_path, tiny_setup, monkeypatch):
    run, slow = tmp_path / "run", ("--set", "fp32_flops=1e8")
    assert run_cli(capsys, *tiny_args(tiny_setup, run, 3, *slow))[0] == 0
    assert 'set = ["fp32_flops=1e8"]' in (run / "config.toml").read_text()  # what --resume and --compare replay
    monkeypatch.chdir(tmp_path)  # the local calibration is cached under ./runs
    rc, out, _ = run_cli(capsys, "plan", "--compare", run, "--json")
    result = json.loads(out)
    assert rc == 0 and result["predicted_step_s"] > 0 and result["measured_step_s"] > 0
    assert abs(result["predicted_peak_bytes"] / result["measured_peak_bytes"] - 1) <= 0.05
    # Host RAM beside it (trained in this process, whose resident set is the test session's: compared in
    # tests/test_host_memory.py, on a process of its own).
    assert result["predicted_host_bytes"] > 0 and result["measured_host_bytes"] > 0
    # The command's own --set goes over the run's: a 100x faster matmul predicts a shorter step.
    rc, out, _ = run_cli(capsys, "plan", "--compare", run, "--set", "fp32_flops=1e10", "--json")
    assert rc == 0 and json.loads(out)["predicted_step_s"] < result["predicted_step_s"]
    rc, out, _ = run_cli(capsys, "plan", "--compare", run)
    assert rc == 0 and "predicted" in out and "measured" in out and "host RAM" in out
    # --resume keeps the run's figures unless it names its own.
    assert run_cli(capsys, "train", "--resume", run, "--steps", 4)[0] == 0
    assert 'set = ["fp32_flops=1e8"]' in (run / "config.toml").read_text()


def test_train_budget_preset_honours_set_and_a_wrong_set_is_one_line(capsys, tmp_path, tiny_setup):
    # rtx4090 less a reserve that leaves it 1 MiB: the tiny run's step no longer fits, refused before set-up.
    err = fails(capsys, *tiny_args(tiny_setup, tmp_path / "r", 1, "--budget", "rtx4090",
                                   "--set", f"reserve_bytes={DEVICE_PRESETS['rtx4090'].memory_bytes - 2**20}"))
    assert "--budget" in err and "by the planner" in err and not (tmp_path / "r").exists()
    err = fails(capsys, *tiny_args(tiny_setup, tmp_path / "r", 1, "--set", "bf16_flops=fast"))
    assert err.startswith("error: --set must be FIELD=NUMBER") and not (tmp_path / "r").exists()


def test_compare_prices_each_logged_step_on_the_schedule_the_trainer_ran():
    """A speculative fused step that clipped was undone (its forward, priced) and made again after the
    backward; the steps after it ran after the backward until one did not clip, and then speculated again."""
    from memory_model import device_spec, plan
    from streamer.cli.whatif import replayed_steps
    from streamer.run import resolve

    cfg = resolve({"model": "gptj-debug", "store": "disk", "max_grad_norm": 1.0, "batch": 2, "seq": 32,
                   "dtype": "fp32"})
    shape, device, pc = cfg.model_config(), device_spec("h100-sxm"), cfg.plan_config()
    assert pc.fused
    fused = plan(shape, device, pc, limits=False)
    after = plan(shape, device, pc.replace(update_timing="after-backward"), limits=False).step_time_s
    attempt = sum(row.forward_s for row in fused.rows)
    norms = [5.0, 5.0, 0.5, 0.5, 5.0]
    assert replayed_steps(shape, device, cfg, [{"grad_norm": n} for n in norms]) == [
        attempt + after, after, after, fused.step_time_s, attempt + after]
    unclipped = cfg.replace(max_grad_norm=0.0)
    assert replayed_steps(shape, device, unclipped, [{"grad_norm": n} for n in norms]) == [fused.step_time_s] * 5


def test_compare_prices_each_step_as_its_record_says_it_was_made():
    """A run's records say how each step was made: a norm-first step is priced as its norm pass and fused step,
    plus the undone speculative attempt's forward where there was one."""
    from memory_model import device_spec, plan
    from memory_model.planner import clipped_steps
    from streamer.cli.whatif import replayed_steps
    from streamer.run import resolve

    cfg = resolve({"model": "gptj-debug", "store": "disk", "batch": 2, "seq": 32, "dtype": "fp32",
                   "clipped_steps": "norm-first"})
    shape, device, pc = cfg.model_config(), device_spec("h100-sxm"), cfg.plan_config()
    fused = plan(shape, device, pc, limits=False)
    attempt = sum(row.forward_s for row in fused.rows)
    norm_first = clipped_steps(shape, device, pc)["norm-first"].step_s
    records = [{"grad_norm": 5.0, "schedule": "norm-first", "redone": True},
               {"grad_norm": 5.0, "schedule": "norm-first", "redone": False},
               {"grad_norm": 0.5, "schedule": "norm-first", "redone": False},
               {"grad_norm": 0.5, "schedule": "fused", "redone": False}]
    assert replayed_steps(shape, device, cfg, records) == [attempt + norm_first, norm_first, norm_first,
                                                           fused.step_time_s]
    assert fused.step_time_s < norm_first


def test_more_machines_over_a_slower_network_predict_a_longer_reduce(capsys):
    """`--ranks 16` on 8-GPU machines is 2 of them: the all-reduce is a ring inside each over NVLink, then
    between the machines over their network (`inter_node_bytes_per_s`, 8 x 400 Gb/s on a DGX H100)."""
    def reduce_s(*extra: object) -> float:
        rc, out, _ = run_cli(capsys, "plan", "--model", "gptj-6b", "--target", "h100-sxm", "--ranks", 16, "--batch",
                             256, "--seq", 2048, "--activations", "checkpoint", "--store", "ram", *extra, "--json")
        assert rc == 0
        return json.loads(out)["resource_s"]["interconnect"]

    one, two, four = (reduce_s("--ranks-per-node", n) for n in (16, 8, 4))
    ethernet = reduce_s("--ranks-per-node", 4, "--set", f"inter_node_bytes_per_s={100e9 / 8}")  # 100 GbE
    assert one < two < four < ethernet
    assert two == reduce_s()  # 8 per machine is the default
    # Each unit's fp32 gradient crosses 2 (m-1)/m of its bytes through each machine's link, beyond the ring inside.
    h100 = DEVICE_PRESETS["h100-sxm"]
    grad = 4 * 10**9
    inside = h100.link_time(h100.interconnect, int(2 * 3 / 4 * grad))
    assert h100.allreduce_time(grad, 16, 4) == inside + h100.link_time(h100.inter_node, int(2 * 3 / 4 * grad))
    with pytest.raises(ValueError, match=r"no figure for the network between them: --set inter_node_bytes_per_s="
                                         r".* or --ranks-per-node 16 to keep them on one"):
        replace(h100, inter_node=None).allreduce_time(grad, 16, 4)  # `local` measures none
