"""A run that cannot fit its --budget is refused before anything is written, with alternatives that fit."""
from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import time

import pytest
import torch

from layers import GPTJConfig
from memory_model import DeviceOutOfMemory
from streamer.advice import ledger_advice
from streamer.cli.main import main
from streamer.run import RunConfig
from streamer.trainer import StreamingTrainer

RERUN = ["--steps", "1", "--sample-tokens", "0", "--eval-every", "0", "--dtype", "fp32"]


def _train(*args: object) -> subprocess.CompletedProcess:
    """`streamer train ARGS` through the CLI's main in this process (the start of an interpreter and of torch
    would be most of each run's time)."""
    argv = ["train", *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's own refusals
            rc = exc.code
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


# A model of neither preset's shape, given as a config.json: three layers, a wider embedding than gptj-debug.
CUSTOM = GPTJConfig(vocab_size=384, n_positions=64, n_embd=96, n_layer=3, n_head=4, rotary_dim=8)


@pytest.mark.parametrize("model,batch,seq,budget,extra", [
    ("gptj-demo", 8, 128, "3MiB", ()), ("gptj-demo", 8, 128, "7MiB", ()), ("gptj-demo", 8, 128, "16MiB", ()),
    ("gptj-demo", 8, 128, "40MiB", ("--activations", "resident")),  # batch, checkpoint and budget alternatives
    ("gptj-demo", 8, 128, "100MiB", ("--activations", "resident")),
    ("gptj-debug", 8, 64, "1MiB", ()), ("gptj-debug", 8, 64, "4MiB", ("--activations", "resident")),
    ("custom", 6, 48, "1MiB", ()),
])
def test_too_small_budget_exits_fast_and_its_first_alternative_trains(tmp_path, model, batch, seq, budget, extra):
    run = tmp_path / "run"
    if model == "custom":
        model = tmp_path / "config.json"
        model.write_text(json.dumps(CUSTOM.to_hf()))
    base = ["--model", model, "--batch", batch, "--seq", seq, "--run-dir", run, *RERUN, *extra]
    started = time.monotonic()
    refused = _train(*base, "--budget", budget)
    assert refused.returncode == 2, refused.stderr
    assert time.monotonic() - started < 60  # seconds: no tokenizer, no store (2-3 s measured on a shared box)
    assert not run.exists() and "Traceback" not in refused.stderr
    message = refused.stderr.strip()
    assert len(message.splitlines()) == 1 and "by the planner" in message and "activations" in message
    first = re.search(r"one of: (--[a-z-]+ [^;\s]+)", message).group(1).split()
    done = _train(*base, "--budget", budget, *first) if first[0] != "--budget" else _train(*base, "--budget", first[1])
    assert done.returncode == 0, done.stderr


def test_every_alternative_trains(tmp_path):
    """Each listed alternative (not only the first) fits when applied alone."""
    base = ["--model", "gptj-demo", "--batch", 8, "--seq", 128, *RERUN, "--activations", "resident"]
    refused = _train(*base, "--budget", "100MiB", "--run-dir", tmp_path / "r")
    options = [o.split(" (")[0].split() for o in refused.stderr.split("one of: ")[1].strip().split("; or ")]
    assert len(options) >= 3
    for i, option in enumerate(options[1:]):
        done = _train(*base, "--budget", "100MiB", *option, "--run-dir", tmp_path / f"ok{i}")
        assert done.returncode == 0, (option, done.stderr)


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
