"""A run that cannot fit its --budget is refused before anything is written, with alternatives that fit."""
from __future__ import annotations

import json
import re
import time

import pytest
import torch

from layers import GPTJConfig
from memory_model import DeviceOutOfMemory, format_size
from streamer.advice import check_fits, ledger_advice
from streamer.run import RunConfig
from streamer.trainer import StreamingTrainer
from test_cli import run_cli

RERUN = ["--steps", "1", "--sample-tokens", "0", "--eval-every", "0", "--dtype", "fp32"]


def _train(capsys, *args: object) -> tuple[int, str]:
    """`streamer train ARGS` through the CLI in this process (an interpreter's and torch's start would be most
    of each run's time): its exit status and stderr."""
    rc, _, err = run_cli(capsys, "train", *args)
    return rc, err


# A model of neither preset's shape, given as a config.json: three layers, a wider embedding than gptj-debug.
CUSTOM = GPTJConfig(vocab_size=384, n_positions=64, n_embd=96, n_layer=3, n_head=4, rotary_dim=8)


@pytest.mark.parametrize("model,batch,seq,budget,extra", [
    ("gptj-demo", 8, 128, "3MiB", ()), ("gptj-demo", 8, 128, "7MiB", ()), ("gptj-demo", 8, 128, "16MiB", ()),
    ("gptj-demo", 8, 128, "40MiB", ("--activations", "resident")),  # batch, checkpoint and budget alternatives
    ("gptj-demo", 8, 128, "100MiB", ("--activations", "resident")),
    ("gptj-debug", 8, 64, "1MiB", ()), ("gptj-debug", 8, 64, "4MiB", ("--activations", "resident")),
    ("custom", 6, 48, "1MiB", ()),
])
def test_too_small_budget_exits_fast_and_its_first_alternative_trains(capsys, tmp_path, model, batch, seq, budget,
                                                                       extra):
    run = tmp_path / "run"
    if model == "custom":
        model = tmp_path / "config.json"
        model.write_text(json.dumps(CUSTOM.adapter().to_hf()))
    base = ["--model", model, "--batch", batch, "--seq", seq, "--run-dir", run, *RERUN, *extra]
    started = time.monotonic()
    rc, refused = _train(capsys, *base, "--budget", budget)
    assert rc == 2, refused
    assert time.monotonic() - started < 60  # seconds: no tokenizer, no store (2-3 s measured on a shared box)
    assert not run.exists() and "Traceback" not in refused
    message = refused.strip()
    assert len(message.splitlines()) == 1 and "by the planner" in message and "activations" in message
    first = re.search(r"one of: (--[a-z-]+ [^;\s]+)", message).group(1).split()
    rc, err = (_train(capsys, *base, "--budget", budget, *first) if first[0] != "--budget"
               else _train(capsys, *base, "--budget", first[1]))
    assert rc == 0, err


def test_every_alternative_trains(capsys, tmp_path):
    """Each listed alternative (not only the first) fits when applied alone."""
    base = ["--model", "gptj-demo", "--batch", 8, "--seq", 128, *RERUN, "--activations", "resident"]
    _, refused = _train(capsys, *base, "--budget", "100MiB", "--run-dir", tmp_path / "r")
    options = [o.split(" (")[0].split() for o in refused.split("one of: ")[1].strip().split("; or ")]
    assert len(options) >= 3
    for i, option in enumerate(options[1:]):
        rc, err = _train(capsys, *base, "--budget", "100MiB", *option, "--run-dir", tmp_path / f"ok{i}")
        assert rc == 0, (option, err)


def test_out_of_memory_mid_step_is_advised_by_the_planner():
    """A budget the pre-check would refuse, forced on a trainer: the ledger's error names the planner's fits."""
    model = GPTJConfig(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)
    cfg = RunConfig.of({"model": "gptj-debug", "batch": 4, "seq": 32, "dtype": "fp32", "activations": "resident",
                        "budget": "300KiB", "store": "ram"})
    trainer = StreamingTrainer(model, cfg.trainer)
    trainer.ledger.hint_context["advise"] = ledger_advice(model, cfg)
    with pytest.raises(DeviceOutOfMemory) as caught:
        trainer.step(torch.randint(0, 256, (4, 32)))
    trainer.close()
    assert "the planner puts a step's peak at" in str(caught.value)
    assert re.search(r"--budget \d+(K|M)iB", str(caught.value))


def test_a_grpo_rollout_over_the_budget_is_refused_and_each_alternative_trains(capsys, tmp_path, monkeypatch):
    """A GRPO run whose step fits --budget but whose rollout cannot generate within it (a prompt's rows, the KV
    cache at --seq, the units streamed) is refused in one line, before anything is written, naming the flags that
    fit; each of them, applied alone, passes that check, and fewer generations trains a step within it."""
    from memory_model.rollout import generation_peak
    from streamer.advice import planned_peak

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Say a word:"}\n{"prompt": "Name a color:"}\n')
    (tmp_path / "advice_rewards.py").write_text("def short(prompts, completions, **kw):\n"
                                                "    return [-len(c) / 10 for c in completions]\n")
    settings = {"model": "llama-debug", "method": "grpo", "batch": 8, "num_generations": 8,
                "max_completion_length": 16, "seq": 64, "grad_accum": 8, "activations": "checkpoint", "lora_rank": 4,
                "dtype": "fp32", "budget": "640KiB"}
    cfg = RunConfig.of(settings)
    step, generation = planned_peak(cfg.model_config(), cfg), generation_peak(cfg.model_config(), cfg.plan_config())
    assert step < cfg.budget_bytes() < generation  # the step fits, the generation does not
    base = [f for k, v in settings.items() for f in (f"--{k.replace('_', '-')}", v)] + [
        "--data", "prompts.jsonl", "--reward-funcs", "advice_rewards:short", "--eval-fraction", 0, *RERUN]
    rc, refused = _train(capsys, *base, "--run-dir", tmp_path / "r")
    message = refused.strip()
    assert rc == 2 and len(message.splitlines()) == 1 and not (tmp_path / "r").exists(), refused
    assert message.startswith("error: --budget 640KiB (640 KiB) is too small for a GRPO rollout: generating a "
                              "prompt's 8 completions (a KV cache of --seq 64 positions) needs "), message
    options = [o.split(" (")[0].split() for o in message.split("one of: ")[1].split("; or ")]
    assert ["--num-generations", "4"] in options and ["--prefetch", "0"] in options
    assert options[0] == ["--budget", f"{-(-generation // 1024)}KiB"]
    for option in options[1:]:  # each fits the planner's check alone
        value = int(option[1]) if option[1:] else True  # (--load-in-4bit is a switch)
        check_fits(cfg.model_config(), RunConfig.of({**settings, option[0][2:].replace("-", "_"): value}))
    rc, err = _train(capsys, *base, "--num-generations", 4, "--store", "ram", "--run-dir", tmp_path / "ok")
    assert rc == 0, err  # and trains within the budget


def test_streamer_plan_says_a_grpo_rollout_does_not_fit_and_what_would(capsys):
    """`streamer plan --method grpo` on a target whose memory holds the step but not a prompt's generation: the
    rollout line says so and names the flags with which it fits, each re-planned; in JSON as
    `rollout.does_not_fit`."""
    import dataclasses

    from memory_model import device_spec
    from memory_model.allocator import workspace_bytes
    from memory_model.rollout import generation_peak, rollout_plan

    settings = {"model": "llama-debug", "method": "grpo", "batch": 8, "num_generations": 8,
                "max_completion_length": 16, "seq": 64, "grad_accum": 8, "activations": "checkpoint", "lora_rank": 4,
                "dtype": "fp32", "update_on": "device"}
    cfg = RunConfig.of(settings)
    h100 = device_spec("h100-sxm")
    memory = h100.reserve_bytes + workspace_bytes(h100.cuda_arch) + 640 * 1024  # 640 KiB for tensors
    device = dataclasses.replace(h100, memory_bytes=memory)
    flags = ["plan", "--target", "h100-sxm", "--set", f"memory_bytes={memory}",
             *[f for k, v in settings.items() for f in (f"--{k.replace('_', '-')}", v)]]
    rc, out, err = run_cli(capsys, *flags, "--json")
    assert rc == 0, err
    planned = json.loads(out)
    why = planned["rollout"]["does_not_fit"]
    need = generation_peak(cfg.model_config(), cfg.plan_config())
    assert planned["does_not_fit"] is None and why.startswith(
        f"a prompt's generation needs {format_size(need)} with its units streamed, over the 640 KiB h100-sxm "
        "leaves to tensors; to fit: --seq "), why
    assert "--num-generations 4 (" in why and "--prefetch 0" in why
    seq = int(why.split("--seq ")[1].split()[0])
    for fixed in ({"seq": seq}, {"num_generations": 4}, {"prefetch": 0}):
        trial = RunConfig.of({**settings, **fixed}).plan_config()
        assert rollout_plan(cfg.model_config(), device, trial).does_not_fit is None
    assert rollout_plan(cfg.model_config(), device, RunConfig.of({**settings, "seq": seq + 1}).plan_config()
                        ).does_not_fit
    rc, out, err = run_cli(capsys, *flags)
    assert rc == 0 and f"The rollout does NOT fit: {why}" in " ".join(out.split()), err
