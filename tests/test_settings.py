"""Every setting reachable as a flag and a run.toml key, validated once, errors that name the key and its source."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layers import PRESETS
from memory_model import PlanConfig
from benchmarks.worker import RunSpec
from benchmarks.bench import add_arguments as bench_arguments
from streamer.cli.main import build_parser
from streamer.session import fit_vocabulary
from memory_model.lora import LoraConfig
from memory_model.objective import ObjectiveConfig
from memory_model.settings import flat_fields, flatten
from streamer.cli.flags import given as given_flags
from streamer.run import _toml_value, CHOICES, FLAGS, INT_MINIMUMS, RESUMABLE, RunConfig, RunError, resolve
from streamer.run_dir import RunDir
from streamer.config import ConfigError, TrainerConfig
from streamer.io.data import DataConfig
from streamer.reporting import ReportConfig
from streamer.runtime.hardware import DeviceConfig
from streamer.runtime.optim import LRSchedule, OptimizerConfig
from memory_model.step import Placement, StepConfig
from memory_model.units import Precision
from streamer.io.tokenizer import MIN_VOCAB

from tests.test_cli import fails, run_cli, tiny_args


# --- settings files: wrong types, out-of-range values, unknown keys ---------------------------------------------
def _toml(value: object) -> str:
    return _toml_value(tuple(value) if isinstance(value, list) else value)


WRONG = st.one_of(
    # an integer setting given a string, a float, a boolean, a list, or a value below its minimum
    st.sampled_from(sorted(INT_MINIMUMS)).flatmap(lambda key: st.tuples(st.just(key), st.one_of(
        st.integers(-10**6, -1).map(lambda v: v + min(0, INT_MINIMUMS[key])).map(
            lambda v: min(v, INT_MINIMUMS[key] - 1)),
        st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
        st.lists(st.integers(), max_size=2)))),
    # a choice setting given a value outside its choices (or another type); `pack = true` and `pack = false` are
    # still read, as an older config.toml's switch
    st.sampled_from(sorted(CHOICES)).flatmap(lambda key: st.tuples(st.just(key), st.one_of(
        st.text(max_size=8).filter(lambda v: v not in CHOICES[key]), st.integers(),
        *(() if key == "pack" else (st.booleans(),))))),
    # numbers out of range
    st.tuples(st.sampled_from(["lr", "eps"]), st.floats(max_value=0.0, allow_nan=False)),
    st.tuples(st.sampled_from(["weight_decay", "max_grad_norm"]), st.floats(max_value=-1e-9, allow_nan=False)),
    st.tuples(st.just("eval_fraction"), st.one_of(st.floats(min_value=1.0), st.floats(max_value=-1e-9))),
    st.tuples(st.just("min_lr_ratio"), st.floats(min_value=1.001, allow_infinity=False)),
    st.tuples(st.just("betas"), st.one_of(st.lists(st.floats(0, 0.99), max_size=3).filter(lambda v: len(v) != 2),
                                          st.lists(st.floats(1.0, 10.0), min_size=2, max_size=2), st.text(max_size=4))),
    st.tuples(st.sampled_from(["lr", "sample_prompt", "budget", "pack"]), st.lists(st.integers(), max_size=2)),
    # unknown keys
    st.tuples(st.from_regex(r"[a-z][a-z_]{0,12}", fullmatch=True).filter(
        lambda k: k not in FLAGS), st.integers()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=WRONG, good_steps=st.integers(1, 5))
def test_a_wrong_setting_in_a_file_is_one_line_naming_file_and_key(capsys, tmp_path, monkeypatch, bad, good_steps):
    monkeypatch.chdir(tmp_path)
    key, value = bad
    toml = tmp_path / "run.toml"
    lines = [f"steps = {good_steps}", f"run_dir = {_toml(str(tmp_path / 'run'))}"]
    toml.write_text("\n".join([line for line in lines if not line.startswith(key + " ")] + [f"{key} = {_toml(value)}"]))
    before = sorted(tmp_path.iterdir())
    line = fails(capsys, "train", "--config", toml)
    assert line.startswith(f"error: --config {toml}: {key} "), line
    assert "Traceback" not in line
    assert sorted(tmp_path.iterdir()) == before  # no run folder, nothing else


# Each flag's owner: (owner, owner's name, flag).
OPTIMIZER = ("lr", "betas", "eps", "weight_decay", "max_grad_norm", "nonfinite")
STEP = ("grad_accum", "activations", "prefetch", "update_on", "update_chunk", "update_timing", "clipped_steps",
        "data_parallel", "expert_group_size", "store")
SHARED = [(StepConfig, name, name) for name in STEP] + \
    [(OptimizerConfig, name, name) for name in OPTIMIZER] + \
    [(Precision, "compute", "dtype"), (Precision, "master", "master_dtype"), (Precision, "moments", "moment_dtype")] + \
    [(DeviceConfig, name, name) for name in ("device", "budget", "set", "pin_memory")] + \
    [(DataConfig, name, name) for name in ("data", "tokenizer", "vocab_size", "pack", "eval_fraction")] + \
    [(TrainerConfig, name, name) for name in ("seed", "trace_steps", "trace_every")] + \
    [(LoraConfig, name, f"lora_{name}") for name in ("rank", "alpha", "dropout", "targets")] + \
    [(ObjectiveConfig, name, name) for name in ("method", "beta", "loss_type", "label_smoothing")] + \
    [(ReportConfig, "report_to", "report_to")] + \
    [(LRSchedule, "kind", "schedule"), (LRSchedule, "warmup_steps", "warmup"),
     (LRSchedule, "min_lr_ratio", "min_lr_ratio")]


def test_every_setting_is_declared_once_and_checked_alike_everywhere():
    leaves = flat_fields(RunConfig)
    assert set(FLAGS) == set(leaves) - {"total_steps"}  # --steps is the schedule's end
    for name in FLAGS:
        assert leaves[name][1].metadata["help"] and "check" in leaves[name][1].metadata, name
    for owner, name, flag in SHARED:  # the tree holds the owner's own declaration
        assert leaves[flag][1] is owner.__dataclass_fields__[name], flag
    planned = flat_fields(PlanConfig)
    for name in (*STEP, "master_dtype", "moment_dtype"):  # the planner's step is the trainer's: one declaration
        assert planned[name][1] is leaves[name][1], name
    assert planned["compute_dtype"][1] is leaves["dtype"][1]  # the same precision, by the planner's name
    assert leaves["batch"][1].metadata["check"] is planned["batch"][1].metadata["check"]
    run = RunConfig.of({"lr": 3e-4, "eps": 1e-6, "pack": "examples", "eval_fraction": 0.1, "budget": "64MiB"})
    assert run.data == DataConfig(pack="examples", eval_fraction=0.1)
    assert run.trainer.device == DeviceConfig(budget="64MiB")
    assert run.trainer.optimizer == OptimizerConfig(lr=3e-4, eps=1e-6)
    # the same wrong value reads the same from the run's settings, the trainer API, the planner and bench
    wrong = [(RunError, lambda: RunConfig.of({"grad_accum": 0})), (ConfigError, lambda: TrainerConfig.of(grad_accum=0)),
             (ValueError, lambda: PlanConfig.of(batch=1, seq=2, grad_accum=0)),
             (ValueError, lambda: RunSpec(label="a", contender="hf", model={}, batch=0, seq=2))]
    messages = []
    for error, make in wrong:
        with pytest.raises(error) as caught:
            make()
        messages.append(str(caught.value).split(" ", 1)[1])
    assert set(messages) == {"must be a positive integer, got 0"}, messages
    # an owner's own check reads under the flag's name, from the run's settings and the trainer API
    with pytest.raises(RunError, match="^--lora-rank must be an integer >= 0"):
        RunConfig.of({"lora_rank": -1})
    with pytest.raises(RunError, match="^--schedule must be one of constant"):
        RunConfig.of({"schedule": "step"})
    with pytest.raises(ConfigError, match="^warmup must be an integer >= 0"):
        TrainerConfig.of(warmup=-1)


def test_the_settings_tree_holds_each_owners_config_as_the_trainer_gets_it():
    given = {"model": "gptj-debug", "dtype": "fp32", "batch": 4, "grad_accum": 2, "lr": 3e-4, "betas": (0.8, 0.9),
             "schedule": "cosine", "warmup": 3, "steps": 9, "moment_dtype": "bf16", "store": "ram",
             "update_chunk": 4096, "budget": "64MiB", "pack": "examples", "max_grad_norm": 0}
    cfg = RunConfig.of(given)
    tc = cfg.trainer
    assert tc.optimizer == OptimizerConfig(lr=3e-4, betas=(0.8, 0.9), max_grad_norm=0)
    assert tc.schedule == LRSchedule("cosine", 3, 9)  # it decays over --steps
    assert tc.step == StepConfig(grad_accum=2, update_chunk=4096, precision=Precision("fp32", moments="bf16"))
    assert tc.step.store == Placement.of("ram")
    assert tc.device == DeviceConfig(budget="64MiB") and cfg.data == DataConfig(pack="examples")
    assert cfg.plan_config() == PlanConfig.of(batch=4, seq=128, grad_accum=2, compute_dtype="fp32", store="ram",
                                              update_chunk=4096, moment_dtype="bf16", packed=True)
    # every flag lands in its owner's config, and comes back by its flat name
    flat = flatten(cfg)
    assert {k: flat[k] for k in given if k != "store"} == {k: v for k, v in given.items() if k != "store"}
    assert cfg.flat()["store"] == "ram" and list(cfg.flat()) == list(FLAGS)
    assert RunConfig.of(cfg.flat()) == cfg and cfg.replace(steps=12).trainer.schedule.total_steps == 12
    assert cfg.name() == "gptj-debug" and RunConfig.of({"data": "/d/reports.jsonl"}).name() == "reports"
    with pytest.raises(ValueError, match="resolve --dtype auto"):
        RunConfig().plan_config()


OLD_CONFIG_TOML = """# weight-streaming run settings: the keys are `streamer train`'s flags with _ for -
model = "gptj-debug"
steps = 6
batch = 4
seq = 32
grad_accum = 2
lr = 0.003
schedule = "cosine"
warmup = 2
min_lr_ratio = 0.1
weight_decay = 0.1
max_grad_norm = 0
betas = [0.9, 0.95]
eps = 1e-08
moment_dtype = "fp32"
nonfinite = "stop"
lora_rank = 0
trace_steps = 8
dtype = "fp32"
device = "cpu"
budget = "64MiB"
store = "disk"
activations = "checkpoint"
update_on = "device"
prefetch = 1
update_chunk = 1048576
update_timing = "auto"
seed = 0
pack = true
eval_fraction = 0.05
eval_every = 50
report_to = "none"
"""


def test_an_old_flat_config_toml_loads_into_the_nested_tree(tmp_path):
    """A run folder's config.toml from before the settings nested (flat, as they still are): every key lands
    in its owner's config, and `--pack` as the switch it once was."""
    (tmp_path / "config.toml").write_text(OLD_CONFIG_TOML)
    cfg = RunDir(tmp_path).read_config()
    tc = cfg.trainer
    assert (cfg.model, cfg.steps, cfg.batch, cfg.seq) == ("gptj-debug", 6, 4, 32)
    assert tc.step == StepConfig(grad_accum=2, activations="checkpoint", update_chunk=2**20, store=Placement.of("disk"),
                                 precision=Precision("fp32"))
    assert tc.optimizer == OptimizerConfig(lr=3e-3, max_grad_norm=0)
    assert tc.schedule == LRSchedule("cosine", 2, 6, 0.1) and tc.step.store == Placement.of("disk")
    assert tc.device == DeviceConfig(budget="64MiB") and cfg.data.pack == "examples"


def test_an_old_trainer_state_loads_into_the_nested_tree():
    """The trainer settings a store's manifest holds from before they nested: `compute_dtype`, the schedule
    and the placement as tables, None for no clipping."""
    old = {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-08, "weight_decay": 0.1, "max_grad_norm": None,
           "grad_accum": 2, "compute_dtype": "bf16", "moment_dtype": "fp32", "activations": "resident",
           "store": {"compute": "ram", "state": "disk", "grad": "disk"}, "update_on": "device", "prefetch": 1,
           "device": "cpu", "budget": None, "update_chunk": 8192, "update_timing": "after-backward",
           "schedule": {"kind": "linear", "warmup_steps": 1, "total_steps": 5, "min_lr_ratio": 0.0},
           "nonfinite": "stop", "lora_rank": 0, "lora_alpha": 16.0, "lora_dropout": 0.0,
           "lora_targets": "q_proj,v_proj", "seed": 3, "trace_steps": 8, "trace_every": 0}
    tc = TrainerConfig.from_dict(old)
    assert tc.optimizer.max_grad_norm == 0 and tc.step.precision.compute == "bf16" and tc.seed == 3
    assert tc.schedule == LRSchedule("linear", 1, 5) and tc.step.store == Placement("ram", "disk", "disk")
    assert tc.step == StepConfig(grad_accum=2, update_chunk=8192, update_timing="after-backward",
                                 store=Placement("ram", "disk", "disk"), precision=Precision("bf16"))
    assert TrainerConfig.from_dict(tc.to_dict()) == tc


def test_a_wrong_setting_file_from_the_shell(tmp_path):
    (tmp_path / "run.toml").write_text('steps = "3"\n')
    done = subprocess.run([sys.executable, "-m", "streamer", "train", "--config", "run.toml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == 'error: --config run.toml: steps must be a positive integer, got "3"\n'
    assert [p.name for p in tmp_path.iterdir()] == ["run.toml"]
    (tmp_path / "hf").mkdir()
    done = subprocess.run([sys.executable, "-m", "streamer", "train", "--from-pretrained", "hf"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: --from-pretrained needs --data") and \
        done.stderr.count("\n") == 1 and "pass --data FILE" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run.toml"]


def test_flag_errors_name_the_flag_and_conflicts_are_errors(capsys, tmp_path, tiny_setup):
    assert fails(capsys, "train", "--steps", 0) == "error: --steps must be a positive integer, got 0"
    assert "--eps must be a positive number" in fails(capsys, "train", "--eps", 0)
    assert "--betas must be two numbers in [0, 1)" in fails(capsys, "train", "--betas", "0.9,1.5")
    assert "--moment-dtype must be one of fp32, bf16" in fails(capsys, "train", "--moment-dtype", "fp16")
    hf = tmp_path / "hf"
    hf.mkdir()
    assert "--model" in fails(capsys, "train", "--from-pretrained", hf, "--model", "gptj-debug", "--data", "x.txt") \
        and "conflicts with --from-pretrained" in fails(capsys, "train", "--from-pretrained", hf, "--model",
                                                        "gptj-demo", "--data", "x.txt")
    assert "pass --data" in fails(capsys, "train", "--from-pretrained", hf)
    one = tmp_path / "one.txt"
    one.write_text("just a few words of text " * 3)  # one sequence of 32 tokens
    line = fails(capsys, *tiny_args(tiny_setup, tmp_path / "r", 1, "--data", one))
    assert "--eval-fraction 0.05 holds out 0" in line and "--eval-fraction 0 to train without evaluation" in line
    assert not (tmp_path / "r").exists()
    # 18 sequences: 5% holds out one, and an evaluation batch split in --grad-accum 4 needs 4
    one.write_text("just a few words of text " * 40)
    line = fails(capsys, *tiny_args(tiny_setup, tmp_path / "r", 1, "--data", one, "--grad-accum", 4))
    assert "an evaluation needs 4; raise --eval-fraction to" in line and not (tmp_path / "r").exists()


def test_new_settings_reach_the_trainer_and_config_toml():
    cfg = RunConfig.of({"betas": [0.8, 0.99], "eps": 1e-6, "moment_dtype": "bf16", "nonfinite": "skip",
                        "trace_steps": 3})
    tc, opt = cfg.trainer, cfg.trainer.optimizer
    assert (opt.betas, opt.eps, tc.step.precision.moments, opt.nonfinite) == ((0.8, 0.99), 1e-6, "bf16", "skip")
    assert tc.trace_steps == 3
    args = build_parser().parse_args(["train", "--betas", "0.8", "0.99", "--eps", "1e-6", "--moment-dtype", "bf16",
                                      "--nonfinite", "skip", "--trace-steps", "3"])
    assert resolve(given_flags(args)) == \
        resolve({"betas": (0.8, 0.99), "eps": 1e-6, "moment_dtype": "bf16", "nonfinite": "skip", "trace_steps": 3})
    pretrained = RunConfig.of({"from_pretrained": "/ckpt", "data": "/d.txt"})
    assert "from_pretrained = " in pretrained.to_toml() and "model = " not in pretrained.to_toml()


# --- every preset on the default data ---------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_gets_a_vocabulary_and_sequence_that_fit(preset):
    cfg = resolve({"model": preset})
    model = fit_vocabulary(cfg, cfg.model_config())
    assert model.vocab_size >= MIN_VOCAB and cfg.seq <= model.attention().context()[0]
    assert model.vocab_size == max(MIN_VOCAB, PRESETS[preset].vocab_size)  # only a too-small vocabulary grows


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`streamer train --model gptj-debug` on the default data, stdout piped: per-step progress lines."""
    run = tmp_path_factory.mktemp("debug") / "run"
    done = subprocess.run([sys.executable, "-m", "streamer", "train", "--model", "gptj-debug", "--steps", "3",
                           "--run-dir", str(run), "--sample-tokens", "4", "--schedule", "linear", "--warmup", "1"],
                          capture_output=True, text=True, timeout=300)
    return run, done


def test_gptj_debug_trains_on_the_default_data_with_plain_progress(debug_run):
    run, done = debug_run
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ") and " tok/s " in line]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], done.stdout
    metrics = [m for m in RunDir(run).read_metrics() if "loss" in m]
    for line, m in zip(lines, metrics, strict=True):  # the line shows the lr the step trained with: 0 on warmup step 1
        assert f"loss {m['loss']:.4f} lr {m['lr']:.2e} " in line and " elapsed " in line and " eta " in line
    assert [m["lr"] for m in metrics] == [0.0, 1e-4, 0.5e-4]  # HF's linear warmup 1 of 3 steps
    assert "sample: The for statement is used to" in done.stdout  # the demo's data, the demo's prompt


def test_log_every_and_what_resume_may_change(capsys, debug_run):
    run, done = debug_run
    assert done.returncode == 0, done.stderr
    assert "--betas 0.8 0.9 (the run's: 0.9 0.95) cannot change" in fails(capsys, "train", "--resume", run,
                                                                          "--betas", "0.8,0.9")
    assert "--moment-dtype bf16 (the run's: fp32) cannot change" in fails(capsys, "train", "--resume", run,
                                                                         "--moment-dtype", "bf16")
    rc, out, err = run_cli(capsys, "train", "--resume", run, "--steps", 7, "--eps", 1e-6, "--log-every", 2,
                           "--sample-tokens", 0)
    assert rc == 0, err
    assert [line.split()[1] for line in out.splitlines() if " tok/s " in line and line.startswith("step ")] == \
        ["4/7", "6/7", "7/7"]
    assert RunDir(run).read_config().trainer.optimizer.eps == 1e-6
    assert {"eps", "nonfinite", "trace_steps", "log_every"} <= set(RESUMABLE)
    assert not {"betas", "moment_dtype"} & set(RESUMABLE)


def test_sample_prompt_comes_from_the_data(capsys, tmp_path, tiny_setup):
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Question {i}:", "completion": " an answer"}) for i in range(20)))
    rc, out, err = run_cli(capsys, *tiny_args(tiny_setup, tmp_path / "r", 1, "--data", data, "--sample-tokens", 2))
    assert rc == 0, err
    assert "sample: Question 0:" in out and RunDir(tmp_path / "r").read_config().sample_prompt == "Question 0:"


# --- one name per concept across subcommands --------------------------------------------------------------------
def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def test_flags_shared_between_subcommands_agree():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    bench = argparse.ArgumentParser()
    bench_arguments(bench)
    train, plan, generate = (_flags(commands[c]) for c in ("train", "plan", "generate"))
    step = {"--dtype", "--store", "--activations", "--update-on", "--grad-accum", "--prefetch", "--batch", "--seq",
            "--model", "--update-chunk", "--expert-group-size"}
    # plan's and bench's shared flags are generated from the same declarations as train's: type, metavar, arity
    # (bench's --steps is its own: timed steps per block)
    for other, shared in ((plan, step), (_flags(bench), {"--model", "--batch", "--seq", "--dtype"})):
        assert shared <= set(other) & set(train)
        for flag in shared:
            ours, trains = other[flag], train[flag]
            assert (ours.type, ours.metavar, ours.nargs, ours.choices) == \
                (trains.type, trains.metavar, trains.nargs, trains.choices), flag
    # plan resolves its settings as train does: a flag not given is absent, so --config and the defaults apply
    assert all(plan[flag].default is argparse.SUPPRESS for flag in step)
    defaults = RunConfig().flat()
    for flag in {"--device", "--budget", "--seed"}:
        assert flag in generate and flag in train
        # generate's None means "the run's own setting", the only other default allowed
        assert generate[flag].default in (defaults[flag[2:]], None), flag
    assert "--device" not in plan  # plan's simulated device is --target; --device is always the torch device
    assert "--warmup" not in _flags(bench)  # train's --warmup is the lr warmup; bench's are --untimed-steps


def test_a_tier_name_is_parsed_once_into_its_record(tmp_path: Path) -> None:
    """`--store` and a placement take tier names; the settings hold the records, which a manifest and a pickle
    give back as names and the same records."""
    import pickle

    from memory_model.settings import SettingError
    from memory_model.tiers import DISK, RAM

    placement = TrainerConfig.of(store=Placement("ram", "disk", "disk")).step.store
    assert (placement.compute, placement.state, placement.grad) == (RAM, DISK, DISK)
    assert placement.state.journaled and placement.compute.zero_copy and not placement.compute.durable
    assert placement.to_dict() == {"compute": "ram", "state": "disk", "grad": "disk"}
    assert json.loads(json.dumps(placement.to_dict())) == placement.to_dict()
    assert pickle.loads(pickle.dumps(placement)).state is DISK
    with pytest.raises(SettingError, match="'ram', 'disk' or a Placement, got 'cxl'"):
        Placement.of("cxl")
    out = subprocess.run([sys.executable, "-m", "streamer", "plan", "--store", "cxl"], capture_output=True, text=True)
    assert out.returncode != 0 and "--store" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_compute_is_master_is_decided_once_honouring_a_frozen_base(lora_rank: int) -> None:
    """One rule (`Precision.compute_is_master`): the planner and the store agree, and a frozen base has no master."""
    from layers import ModelConfig

    tc = TrainerConfig.of(dtype="fp32", master_dtype="fp32", lora_rank=lora_rank)
    plan_cfg, spec = tc.plan_config(2, 8), tc.store_spec(ModelConfig.named("gptj-debug"), 1)
    assert plan_cfg.precision == spec.precision
    assert plan_cfg.compute_is_master == spec.compute_is_master == (lora_rank == 0)
