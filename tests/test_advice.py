"""A run that cannot fit its --budget is refused before anything is written, with alternatives that fit."""
from __future__ import annotations

import json
import re
import time

import pytest
import torch

from layers import GPTJConfig
from memory_model import DeviceOutOfMemory
from streamer.advice import ledger_advice
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
