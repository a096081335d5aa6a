"""The `streamer` command: the demo, resume, run settings and directories, one-line errors, plan, bench."""
from __future__ import annotations

import json
import os
import shlex
import sys
import tomllib
import subprocess
from pathlib import Path

import pytest

import streamer.cli.bench as cli_bench
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layers import GPTJConfig
from memory_model import format_size, peak_device_bytes
from streamer.advice import planned_peak
from streamer.cli.main import main
from streamer.cli.generate import open_trainer
from streamer.run import DEMO_DEFAULTS, RunConfig, RunError, read_toml, resolve
from streamer.run_dir import RunDir


def run_cli(capsys, *argv: object) -> tuple[int, str, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse: --help and usage errors
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def fails(capsys, *argv: object) -> str:
    """The command fails with exit status 2 and exactly one line on stderr, no traceback."""
    rc, _, err = run_cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def tiny_args(setup: Path, run: Path, steps: int, *extra: object) -> list[object]:
    return ["train", "--model", setup / "config.json", "--data", setup / "train.txt", "--tokenizer", setup / "tok",
            "--run-dir", run, "--steps", steps, "--batch", 4, "--seq", 32, "--dtype", "fp32", "--lr", 3e-3,
            "--sample-tokens", 0, "--eval-every", 0, *extra]


# --- the demo ----------------------------------------------------------------------------------------------------
def test_demo_runs_reports_and_its_run_serves_every_command(capsys, tmp_path):
    run = tmp_path / "demo"
    rc, out, err = run_cli(capsys, "train", "--steps", 3, "--run-dir", run, "--eval-every", 2, "--sample-tokens", 8)
    assert rc == 0, err
    trained_out = out
    for expected in ("device memory by layer", "16 B/param baseline", "the planner predicts", "eval loss",
                     "sample: ", "trace.json", "store: disk (streamer train's default: the state on disk"):
        assert expected in out
    saved = RunDir.open(run).read_config()
    assert saved.steps == 3 and saved.trainer.device.budget == DEMO_DEFAULTS["budget"]
    assert saved.trainer.step.activations == "checkpoint"
    metrics = RunDir(run).read_metrics()
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3]
    assert any("eval_loss" in m for m in metrics)
    budget = RunConfig.of({"budget": DEMO_DEFAULTS["budget"]}).budget_bytes()
    assert max(m.get("device_peak_bytes", 0) for m in metrics) <= budget
    for name in ("trace.json", "trace.chrome.json", "memory.png"):
        assert (run / name).stat().st_size > 0

    rc, out, _ = run_cli(capsys, "trace", run, "--out", tmp_path / "plot.png")
    assert rc == 0 and "device memory by layer" in out and (tmp_path / "plot.png").is_file()
    rc, out, _ = run_cli(capsys, "trace", run, "--json")
    summary = json.loads(out)
    assert summary["step"] == summary["peak_step"] and 0 < summary["peak_bytes"] <= 64 * 2**20

    greedy = ("generate", run, "--prompt", "The for statement", "--max-new-tokens", 6, "--temperature", 0)
    rc, cached, _ = run_cli(capsys, *greedy)
    assert rc == 0 and cached.startswith("The for statement")
    rc, recomputed, _ = run_cli(capsys, *greedy, "--no-cache")
    assert rc == 0 and recomputed.splitlines()[0] == cached.splitlines()[0]

    # The hint's commands are pasted one per line: each runs as printed (generation kept short).
    hint = trained_out[trained_out.index("next (one command per line):"):].splitlines()[1:4]
    commands = [shlex.split(line) for line in hint]
    assert [c[:2] for c in commands] == [["streamer", "generate"], ["streamer", "export"], ["streamer", "train"]]
    assert "|" not in "".join(hint)
    rc, out, err = run_cli(capsys, *commands[0][1:], "--max-new-tokens", 2)
    assert rc == 0, err
    rc, out, err = run_cli(capsys, *commands[1][1:])
    assert rc == 0 and (Path(commands[1][3]) / "config.json").is_file(), err

    rc, out, _ = run_cli(capsys, "train", "--steps", 3, "--run-dir", run)  # the same command again
    assert rc == 0 and "is at step 3, finished" in out


def test_a_disk_tier_run_whose_fused_steps_clip_stays_within_the_planned_peak(capsys, tmp_path, tiny_setup):
    """Clipping (on by default) undoes a fused step and makes it again after the backward, whose peak can be
    the higher one: the planned peak the run reports (and its budget check uses) covers both schedules."""
    run = tmp_path / "r"
    args = tiny_args(tiny_setup, run, 2, "--store", "disk", "--max-grad-norm", 1e-6)
    args[args.index("--batch") + 1] = 1
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0, err
    cfg = RunDir.open(run).read_config()
    measured = max(m["device_peak_bytes"] for m in RunDir(run).read_metrics() if "device_peak_bytes" in m)
    fused = cfg.plan_config()
    after = fused.replace(update_timing="after-backward")
    assert fused.fused and peak_device_bytes(cfg.model_config(), fused) < measured  # the redo peaked higher
    assert measured <= planned_peak(cfg.model_config(), cfg) == peak_device_bytes(cfg.model_config(), after)
    assert f"the planner predicts {format_size(planned_peak(cfg.model_config(), cfg))}" in out


@pytest.mark.parametrize("schedule", ["after-backward", "norm-first"])
def test_a_clipped_steps_traced_peak_is_plans_figure_for_it(capsys, tmp_path, tiny_setup, schedule: str):
    """A step that clips after one that did: its traced peak is `plan`'s figure for a step that clips on its
    schedule, to the byte. The first step, whose fused attempt was undone, lies between that figure and the
    planned peak (the fused step's, higher here than after-backward's)."""
    run, step = tmp_path / "r", ["--batch", 4, "--seq", 32, "--dtype", "fp32", "--store", "disk", "--update-on",
                                 "device", "--clipped-steps", schedule]
    args = tiny_args(tiny_setup, run, 2, *step, "--max-grad-norm", 1e-6)
    rc, _, err = run_cli(capsys, *args)
    assert rc == 0, err
    rc, out, err = run_cli(capsys, "plan", "--model", tiny_setup / "config.json", *step, "--json")
    assert rc == 0, err
    planned = json.loads(out)
    clipped = planned["clipped_steps"][schedule]["peak_bytes"]

    def traced(n: int) -> int:
        rc, out, err = run_cli(capsys, "trace", run, "--step", n, "--json")
        assert rc == 0, err
        return json.loads(out)["peak_bytes"]

    assert [(m["schedule"], m["redone"]) for m in RunDir(run).read_metrics() if "loss" in m] == [
        (schedule, True), (schedule, False)]
    assert traced(2) == clipped
    assert clipped <= traced(1) <= planned["peak_device_bytes"]
    if schedule == "after-backward":
        assert clipped < planned["peak_device_bytes"]  # the fused step peaks higher: the planned peak is its


def test_a_run_whose_steps_clip_norm_first_logs_each_steps_schedule(capsys, tmp_path, tiny_setup):
    """--clipped-steps norm-first: the first step's speculative fused attempt is undone and the step made
    norm-first, as is every later step that follows one that clipped; each record says so, and the run's peak
    stays within the planned one."""
    run = tmp_path / "r"
    args = tiny_args(tiny_setup, run, 3, "--store", "disk", "--max-grad-norm", 1e-6, "--clipped-steps", "norm-first")
    args[args.index("--batch") + 1] = 1
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0, err
    steps = [m for m in RunDir(run).read_metrics() if "loss" in m]
    assert [(m["schedule"], m["redone"]) for m in steps] == [("norm-first", True), ("norm-first", False),
                                                             ("norm-first", False)]
    cfg = RunDir.open(run).read_config()
    assert max(m["device_peak_bytes"] for m in steps) <= planned_peak(cfg.model_config(), cfg)


# --- resume ------------------------------------------------------------------------------------------------------
def test_resume_sees_the_batches_an_uninterrupted_run_sees(capsys, tmp_path, tiny_setup):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_cli(capsys, *tiny_args(tiny_setup, straight, 4))[0] == 0
    assert run_cli(capsys, *tiny_args(tiny_setup, split, 2))[0] == 0
    rc, out, err = run_cli(capsys, "train", "--resume", split, "--steps", 4)
    assert rc == 0, err
    losses = [[m["loss"] for m in RunDir(r).read_metrics() if "loss" in m] for r in (straight, split)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    with open_trainer(RunDir(straight)) as a, open_trainer(RunDir(split)) as b:
        assert a.step_count == b.step_count == 4
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert RunDir(split).read_config().steps == 4

    rc, out, _ = run_cli(capsys, "train", "--resume", split, "--steps", 4)
    assert rc == 0 and "nothing to train" in out
    assert "--batch 8 (the run's: 4) cannot change" in fails(capsys, "train", "--resume", split, "--batch", 8)
    assert "drop --config and --run-dir" in fails(capsys, "train", "--resume", split, "--run-dir", tmp_path / "x")
    assert "not a run directory" in fails(capsys, "train", "--resume", tmp_path / "nothing")


# --- one-line errors ---------------------------------------------------------------------------------------------
def test_bad_input_is_one_line_with_the_fix(capsys, tmp_path, tiny_setup):
    run = tmp_path / "r"
    assert "unknown unit 'XB'" in fails(capsys, "train", "--budget", "3XB", "--run-dir", run)
    assert "--steps must be a positive integer" in fails(capsys, "train", "--steps", 0, "--run-dir", run)
    assert "--steps must be a positive integer" in fails(capsys, "train", "--steps", -4, "--run-dir", run)
    assert "invalid int value" in fails(capsys, "train", "--steps", "many")
    assert "--seq 1000 exceeds" in fails(capsys, "train", "--seq", 1000, "--run-dir", run)
    assert "neither a preset" in fails(capsys, "train", "--model", "gptj-huge", "--run-dir", run)
    assert "does not split" in fails(capsys, "train", "--batch", 6, "--grad-accum", 4, "--run-dir", run)
    # The update timing's errors name the flags, as typed.
    fused = fails(capsys, "train", "--update-timing", "fused", "--store", "ram", "--run-dir", run)
    assert "--update-timing fused needs the state on disk (--store disk)" in fused and "not --store ram" in fused
    assert "--update-timing after-backward" in fused and "update_timing=" not in fused
    assert "planned only" in fails(capsys, "train", "--update-timing", "overlapped", "--run-dir", run)
    norm_first = fails(capsys, "train", "--clipped-steps", "norm-first", "--grad-accum", 2, "--run-dir", run)
    assert "--clipped-steps norm-first" in norm_first and "--grad-accum 1" in norm_first
    assert "add --update-on host" in fails(capsys, "plan", "--update-timing", "overlapped", "--update-on", "device")
    assert not run.exists()  # nothing was created for a run that could not start

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "thesis.txt").write_text("precious")
    assert "never overwritten" in fails(capsys, "train", "--steps", 1, "--run-dir", occupied)
    assert [p.name for p in occupied.iterdir()] == ["thesis.txt"]
    assert (occupied / "thesis.txt").read_text() == "precious"

    oom = fails(capsys, *tiny_args(tiny_setup, tmp_path / "oom", 1, "--budget", "8KiB"))
    assert "is too small" in oom and "by the planner" in oom and "--budget" in oom  # refused before set-up
    assert not (tmp_path / "oom").exists()
    assert "unknown device" in fails(capsys, "plan", "--target", "abacus")
    assert "exceeds the model's context" in fails(capsys, "plan", "--seq", 4096)
    assert "not a run directory" in fails(capsys, "generate", tmp_path, "--prompt", "x")
    assert "not a run directory" in fails(capsys, "trace", tmp_path / "oom")


def test_bench_runs_the_checkouts_benchmarks_or_says_where_they_are(capsys, monkeypatch, tmp_path):
    # Nothing in streamer imports benchmarks/: `streamer bench` runs it as its own process.
    done = subprocess.run([sys.executable, "-m", "streamer", "bench", "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and "usage: streamer bench" in done.stdout and "--quick" in done.stdout
    monkeypatch.setattr(cli_bench, "CHECKOUT", tmp_path)
    assert "runs from a source checkout" in fails(capsys, "bench")


def test_every_command_has_help_with_examples(capsys):
    for command in ([], ["train"], ["plan"], ["generate"], ["export"], ["trace"]):
        rc, out, _ = run_cli(capsys, *command, "--help")
        assert rc == 0 and "examples:" in out


# --- plan --------------------------------------------------------------------------------------------------------
def test_plan_json_for_gptj_6b(capsys):
    rc, out, _ = run_cli(capsys, "plan", "--model", "gptj-6b", "--target", "cs2", "--batch", 1, "--seq", 2048, "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["params"] == 6_050_882_784 and plan["baseline_bytes"] == 16 * 6_050_882_784
    assert isinstance(plan["peak_device_bytes"], int) and plan["fits"] is True and plan["step_time_s"] > 0
    assert sum(plan["peak_breakdown"].values()) == plan["peak_device_bytes"] and len(plan["rows"]) == 30
    rc, out, _ = run_cli(capsys, "plan", "--model", "gptj-6b", "--target", "cs2")
    assert rc == 0 and "16 B/param baseline" in out


def test_plan_pack_counts_each_blocks_attention_mask(capsys):
    """`streamer plan --pack`: every block keeps its packed rows' attention mask, B x T x T in the compute dtype,
    and sin and cos gathered per row (B x T x R instead of T x R); the dry run charges what the planner does."""
    step = ["plan", "--model", "gptj-demo", "--target", "rtx4090", "--batch", 2, "--seq", 128, "--dtype", "bf16",
            "--activations", "resident", "--dry-run", "--json"]
    plans = [json.loads(run_cli(capsys, *step, *pack)[1]) for pack in ([], ["--pack"])]
    rotary_dim = GPTJConfig.preset("gptj-demo").rotary_dim
    blocks = [(plain, packed) for plain, packed in zip(plans[0]["rows"], plans[1]["rows"], strict=True)
              if plain["unit"].startswith("block")]
    for plain, packed in blocks:
        assert packed["activation_bytes"] - plain["activation_bytes"] == 2 * 128 * 128 * 2 + 128 * rotary_dim * 2
    assert plans[1]["peak_device_bytes"] - plans[0]["peak_device_bytes"] == len(blocks) * 69632
    # The dry run stands above the plan by the same bytes packed or not (meta's LayerNorm statistics, as
    # test_dryrun states): measured 7,168 both.
    assert len({plan["dry_run_peak_device_bytes"] - plan["peak_device_bytes"] for plan in plans}) == 1
    assert "--pack must be one of examples, documents" in fails(capsys, "plan", "--pack", "rows")


def test_plan_dry_run_reports_the_runtime_ledger(capsys):
    rc, out, err = run_cli(capsys, "plan", "--model", "gptj-demo", "--target", "rtx4090", "--batch", 4, "--seq", 128,
                           "--activations", "checkpoint", "--dry-run", "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["dry_run_peak_device_bytes"] == sum(plan["dry_run_peak_breakdown"].values()) > 0
    # Planner and runtime agree, but for the meta LayerNorm's mean and rstd, kept in fp32 where the CPU kernel
    # keeps the input dtype (bf16 here): B x T x 4 bytes more per LayerNorm whose activations the peak holds.
    ln_stats = 4 * 128 * 4
    assert plan["dry_run_peak_device_bytes"] - plan["peak_device_bytes"] in (0, ln_stats)


def test_plan_loads_settings_as_train_does(capsys, tmp_path):
    """Defaults, then the demo's, then --config, then flags: the step `streamer train` would run."""
    def planned(*args: object) -> dict:
        rc, out, err = run_cli(capsys, "plan", "--target", "rtx4090", "--json", *args)
        assert rc == 0, err
        return json.loads(out)["config"]

    demo = planned()
    assert (demo["batch"], demo["seq"], demo["activations"], demo["update_chunk"]) == (8, 128, "checkpoint", 2**20)
    toml = tmp_path / "run.toml"
    toml.write_text('model = "gptj-debug"\nbatch = 4\ngrad_accum = 2\nactivations = "checkpoint"\nsteps = 9\n')
    from_file = planned("--config", toml, "--batch", 6)
    assert (from_file["batch"], from_file["grad_accum"], from_file["activations"]) == (6, 2, "checkpoint")
    assert from_file["seq"] == 64 and from_file["update_chunk"] == 16 * 2**20  # gptj-debug's context; no demo
    assert fails(capsys, "plan", "--config", toml, "--batch", 5) == \
        "error: --batch 5 does not split into --grad-accum 2 micro-batches; use a multiple of 2"
    toml.write_text("batch = 0\n")
    assert fails(capsys, "plan", "--config", toml) == f"error: --config {toml}: batch must be a positive integer, got 0"


def test_plan_keeps_the_store_train_would_and_says_why(capsys, tmp_path):
    """plan resolves the store as `streamer train` does (`resolve`) and prints it with its reason; a RAM store
    that the target's host cannot hold does not fit."""
    def store(*args: object) -> tuple[str, dict]:
        rc, out, err = run_cli(capsys, "plan", "--model", "gptj-debug", "--target", "h100-sxm", "--json", *args)
        assert rc == 0, err
        planned = json.loads(out)
        return planned["store_reason"], planned

    assert resolve({"model": "gptj-debug"}).trainer.step.store.tier == "disk"  # train's own choice
    reason, planned = store()
    assert planned["config"]["store"] == "disk" and reason == (
        "store: disk (streamer train's default: the state on disk, committed every step; --store ram keeps it in "
        "host RAM, saved every --save-every steps), on h100-sxm's host")
    reason, planned = store("--store", "ram")
    assert planned["config"]["store"] == "ram" and reason == "store: ram (--store ram), on h100-sxm's host"
    toml = tmp_path / "run.toml"
    toml.write_text('store = "ram"\n')
    assert store("--config", toml)[0] == f"store: ram (store = ram in --config {toml}), on h100-sxm's host"
    rc, out, _ = run_cli(capsys, "plan", "--model", "gptj-debug", "--target", "cs2")
    assert rc == 0 and "store: disk (streamer train's default" in out and "on cs2's host" in out
    # Two ranks on a 128 GiB workstation each keep GPT-J-6B's 101 GiB RAM store: the host cannot hold them.
    rc, out, _ = run_cli(capsys, "plan", "--model", "gptj-6b", "--target", "rtx4090", "--batch", 2, "--seq", 128,
                         "--store", "ram", "--ranks", 2, "--json")
    planned = json.loads(out)
    assert rc == 0 and planned["fits"] and not planned["host_fits"]
    assert planned["does_not_fit"] == ("its RAM-tier store needs 2 stores of 101 GiB of host RAM and rtx4090's host "
                                       "has 128 GiB; to fit: --store disk")


def test_a_plan_that_does_not_fit_says_why_and_prints_no_throughput(capsys):
    step = ("plan", "--model", "gptj-6b", "--target", "rtx4090", "--batch", 128, "--seq", 2048, "--activations",
            "checkpoint", "--store", "ram", "--ranks", 2)
    rc, out, _ = run_cli(capsys, *step, "--json")
    planned = json.loads(out)
    assert rc == 0 and planned["fits"] is False and planned["host_fits"] is False
    assert planned["does_not_fit"] == (
        "its device peak 49.81 GiB exceeds the 23.28 GiB rtx4090 leaves to tensors; to fit: --batch 54 (the largest "
        "that fits at --seq 2048), or more --grad-accum than 1 (smaller micro-batches, the same batch), or a "
        "--target with more memory; and its RAM-tier store needs 2 stores of 101 GiB of host RAM and rtx4090's host "
        "has 128 GiB; to fit: --store disk")
    for key in ("step_s", "step_time_s", "tokens_per_s", "model_flops_per_s", "mfu", "utilisation", "scaling"):
        assert planned[key] is None, key
    rc, out, _ = run_cli(capsys, *step)
    text = " ".join(out.split())
    assert rc == 0 and "does NOT fit" in text and "does not fit, so no throughput: its device peak" in text
    assert "tokens/s" not in text and "data-parallel scaling" not in text
    # One that fits says nothing of the kind.
    rc, out, _ = run_cli(capsys, "plan", "--model", "gptj-6b", "--target", "rtx4090", "--batch", 2, "--seq", 512,
                         "--activations", "checkpoint", "--json")
    planned = json.loads(out)
    assert planned["does_not_fit"] is None and planned["tokens_per_s"] > 0


def test_plan_overlaps_memoryx_updates_on_cs2_and_cs3(capsys):
    """--update-timing overlapped needs the update on the host, which is where cs2 and cs3 run it unless told:
    the target's place is taken before the step is checked."""
    step = ("plan", "--model", "gptj-6b", "--batch", 8, "--seq", 2048, "--activations", "checkpoint", "--store",
            "ram", "--json")
    for target in ("cs2", "cs3"):
        rc, out, err = run_cli(capsys, *step, "--target", target, "--update-timing", "overlapped")
        assert rc == 0, err
        overlapped = json.loads(out)
        assert overlapped["config"]["update_on"] == "host" and overlapped["config"]["update_timing"] == "overlapped"
        after = json.loads(run_cli(capsys, *step, "--target", target, "--update-timing", "after-backward")[1])
        assert overlapped["step_s"] < after["step_s"]
    assert fails(capsys, *step, "--target", "h100-sxm", "--update-timing", "overlapped") == (
        "error: cannot plan this step: --update-timing overlapped overlaps a host update with the backward: add "
        "--update-on host, or use --update-timing auto")


# --- settings ----------------------------------------------------------------------------------------------------
def test_sizes_in_both_units_and_validation():
    assert RunConfig.of({"budget": "3GB"}).budget_bytes() == 3 * 10**9
    assert RunConfig.of({"budget": "3GiB"}).budget_bytes() == 3 * 2**30
    assert RunConfig.of({"budget": "a100-40g"}).budget_bytes() == (40960 - 723) * 2**20  # less the CUDA context
    for bad in ({"budget": "3XB"}, {"budget": "0"}, {"steps": 0}, {"lr": -1.0}, {"schedule": "sawtooth"},
                {"steps": True}, {"batch": 2.5}, {"dtype": "fp8"}, {"warmup": 10, "steps": 10, "schedule": "cosine"},
                {"eval_fraction": 1.0}, {"device": "tpu"}):
        with pytest.raises(RunError):
            RunConfig.of(bad)


def test_resolution_order_and_the_demo(tmp_path):
    assert resolve({}).steps == DEMO_DEFAULTS["steps"] and resolve({}).trainer.device.budget == DEMO_DEFAULTS["budget"]
    data = tmp_path / "d.txt"
    data.write_text("x")
    assert resolve({"data": str(data)}).trainer.device.budget is None  # demo defaults only for the demo
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 7\nlr = 1\ndata = "d.txt"\nbatch = 4\n')
    cfg = resolve({"batch": 2}, toml)
    # flags win; paths from the file
    assert (cfg.steps, cfg.trainer.optimizer.lr, cfg.batch, cfg.data.data) == (7, 1.0, 2, str(data))
    toml.write_text("stepz = 7\n")
    with pytest.raises(RunError, match="stepz is not a setting"):
        resolve({}, toml)
    toml.write_text("steps = \n")
    with pytest.raises(RunError, match="not valid TOML"):
        resolve({}, toml)


@settings(max_examples=60, deadline=None)
@given(prompt=st.text(), steps=st.integers(1, 10**6), lr=st.floats(1e-9, 10.0),
       pack=st.sampled_from([None, "examples", "documents"]),
       budget=st.one_of(st.none(), st.sampled_from(["64MiB", "3GB", "1.5GiB", "h100-sxm"])))
def test_config_toml_round_trips(prompt, steps, lr, pack, budget):
    cfg = RunConfig.of({"sample_prompt": prompt, "steps": steps, "lr": lr, "pack": pack, "budget": budget,
                        "warmup": 0})
    assert RunConfig.of(tomllib.loads(cfg.to_toml())) == cfg


def test_a_config_toml_from_when_pack_was_a_switch_still_reads(tmp_path):
    """Runs made when --pack was a switch wrote `pack = false` or `pack = true` (which packed examples)."""
    for written, read in (("false", None), ("true", "examples")):
        (tmp_path / "config.toml").write_text(f"pack = {written}\n")
        assert resolve({}, tmp_path / "config.toml").data.pack == read


def test_run_directory_is_written_with_absolute_paths_and_reread(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("d.txt").write_text("x")
    cfg = RunConfig.of({"data": "d.txt", "run_dir": "r"}).with_absolute_paths()
    run = RunDir.create(cfg.run_dir)
    run.write_config(cfg)
    assert read_toml(run.config)["data"] == str(tmp_path / "d.txt")
    assert run.read_config() == cfg and RunDir.is_run("r")
    with pytest.raises(RunError, match="already holds a run"):
        RunDir.create("r")


def test_the_same_command_continues_a_run_however_its_folder_is_named(capsys, tmp_path, tiny_setup, monkeypatch):
    """`--run-dir runs/ft` relative, absolute, under `~`, from another working directory or copied: the same
    command again continues the run; a setting that differs is named with both values."""
    import shutil
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()

    def continued(run: object, steps: int, *extra: object) -> None:
        rc, out, err = run_cli(capsys, *tiny_args(tiny_setup, run, steps, *extra))
        assert rc == 0 and f"holds this run at step {steps - 1}: continuing it to step {steps}" in " ".join(
            out.split()), err

    assert run_cli(capsys, *tiny_args(tiny_setup, "runs/ft", 1))[0] == 0
    continued("runs/ft", 2)
    continued(tmp_path / "runs" / "ft", 3)
    continued("~/runs/ft", 4)  # as `--run-dir=~/runs/ft`, which no shell expands
    monkeypatch.chdir(tmp_path / "elsewhere")
    continued("../runs/ft", 5)
    continued("~/runs/ft", 6, "--lr", 0.5)  # a setting a resume may change applies
    assert RunDir.open(tmp_path / "runs" / "ft").read_config().trainer.optimizer.lr == 0.5
    shutil.copytree(tmp_path / "runs", tmp_path / "elsewhere" / "runs")
    continued("runs/ft", 7, "--lr", 0.5)  # the copy, named from its own parent
    assert RunDir.open("runs/ft").committed_step() == 7 and RunDir.open(tmp_path / "runs" / "ft").committed_step() == 6
    other = fails(capsys, *tiny_args(tiny_setup, "runs/ft", 8, "--seq", 16, "--betas", 0.8, 0.9))
    assert "(--seq 32 there, 16 here; --betas 0.9 0.95 there, 0.8 0.9 here)" in other
    resumed = fails(capsys, "train", "--resume", "~/runs/ft", "--betas", 0.8, 0.9)
    assert "--betas 0.8 0.9 (the run's: 0.9 0.95) cannot change when resuming" in resumed
    # Typed in a shell, where `~` is the shell's to expand.
    done = subprocess.run(["bash", "-c", " ".join(map(shlex.quote, [sys.executable, "-m", "streamer", *map(
        str, tiny_args(tiny_setup, "RUN", 7))])).replace("RUN", "~/runs/ft")], capture_output=True, text=True,
        timeout=120, env={**os.environ, "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and "continuing it to step 7" in " ".join(done.stdout.split()), done.stderr


def test_a_copied_run_folder_is_the_copy_s_own(capsys, tmp_path, tiny_setup):
    """config.toml keeps the run's own paths relative to its folder: a copy (the original moved away) serves
    generate, eval and resume, and `--config COPY/config.toml` or `--run-dir COPY` continue the copy."""
    import shutil
    setup = tmp_path / "setup"
    shutil.copytree(tiny_setup, setup)
    original, copy = tmp_path / "run", tmp_path / "elsewhere" / "copy"
    assert run_cli(capsys, *tiny_args(setup, original, 2))[0] == 0
    saved = read_toml(original / "config.toml")
    assert (saved["run_dir"], saved["data"]) == (str(original), str(setup / "train.txt"))
    assert 'run_dir = "."' in (original / "config.toml").read_text()  # what the raw file holds
    shutil.copytree(original, copy)
    original.rename(tmp_path / "moved")  # nothing may reach the original's path any more
    rc, out, err = run_cli(capsys, "generate", copy, "--prompt", "The for statement", "--max-new-tokens", 3)
    assert rc == 0 and "tokens in" in out, err
    rc, out, err = run_cli(capsys, "eval", copy, "--data", setup / "train.txt")
    assert rc == 0 and f"step 2 of {copy}" in out, err
    # Before any command rewrites config.toml: the copy's own file names the copy.
    rc, out, err = run_cli(capsys, "train", "--config", copy / "config.toml", "--steps", 3)
    assert rc == 0 and f"{copy} holds this run at step 2: continuing it to step 3" in " ".join(out.split()), err
    rc, out, err = run_cli(capsys, *tiny_args(setup, copy, 4))
    assert rc == 0 and f"{copy} holds this run at step 3: continuing it to step 4" in " ".join(out.split()), err
    rc, out, err = run_cli(capsys, "train", "--resume", copy, "--steps", 5)
    assert rc == 0 and f"run {copy}" in out, err
    assert not original.exists() and RunDir.open(copy).committed_step() == 5
    assert RunDir.open(copy).read_config().run_dir == str(copy)


def test_plan_devices_prices_the_all_reduce_and_prints_the_scaling_curve(capsys):
    args = ("plan", "--model", "gptj-6b", "--target", "h100-sxm", "--batch", 64, "--seq", 2048,
            "--activations", "checkpoint", "--store", "ram")  # on disk every rank waits on its own drive
    rc, out, _ = run_cli(capsys, *args, "--ranks", 4, "--json")
    curve = json.loads(out)["scaling"]
    assert rc == 0 and [row["devices"] for row in curve] == [1, 2, 4]
    assert curve[0]["tokens_per_s"] < curve[1]["tokens_per_s"] < curve[2]["tokens_per_s"]
    rc, out, _ = run_cli(capsys, *args, "--ranks", 4)
    assert rc == 0 and "data-parallel scaling" in out
