"""Held-out data end to end: --eval-data, the evaluation at step 0, `streamer eval`, chat data with its template."""
from __future__ import annotations

import json
import math
import re

from streamer.io.tokenizer import load_tokenizer
from streamer.run_dir import RunDir
from tests.test_cli import fails, run_cli, tiny_args

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_eval_data_is_evaluated_at_step_0_and_streamer_eval_agrees(capsys, tmp_path, tiny_setup):
    run, held_out = tmp_path / "run", tmp_path / "held-out.txt"
    held_out.write_text((tiny_setup / "train.txt").read_text()[:1500])  # a few sequences: every one evaluated
    rc, out, err = run_cli(capsys, *tiny_args(tiny_setup, run, 1, "--eval-data", held_out, "--eval-every", 1,
                                             "--eval-batches", 100))
    assert rc == 0, err
    evals = [m for m in RunDir(run).read_metrics() if "eval_loss" in m]
    assert [m["step"] for m in evals] == [0, 1]  # before the first step, and at the end
    assert "step 0: eval loss" in out

    rc, out, err = run_cli(capsys, "eval", run, "--data", held_out, "--batch", 3)
    assert rc == 0, err
    loss, perplexity = map(float, re.search(r"loss ([\d.]+), perplexity ([\d.,]+)", out).groups())
    # Every sequence of plain text predicts seq - 1 tokens: the token-weighted mean is the per-batch one.
    assert math.isclose(loss, evals[-1]["eval_loss"], rel_tol=1e-4)
    assert math.isclose(perplexity, math.exp(loss), rel_tol=1e-3)
    assert "not a run directory" in fails(capsys, "eval", tmp_path, "--data", held_out)
    assert "does not exist" in fails(capsys, "eval", run, "--data", tmp_path / "absent.jsonl")


def test_chat_data_trains_with_chat_template_file_which_the_run_keeps(capsys, tmp_path, tiny_setup):
    conversation = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": conversation}) + "\n" for _ in range(8)))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    args = ["train", "--model", tiny_setup / "config.json", "--data", data, "--tokenizer", tiny_setup / "tok",
            "--steps", 1, "--batch", 4, "--seq", 64, "--dtype", "fp32", "--sample-tokens", 0, "--eval-fraction", 0]
    error = fails(capsys, *args, "--run-dir", tmp_path / "no-template")
    assert "chat.jsonl line 1 is a chat record but the tokenizer has no chat_template" in error
    assert not (tmp_path / "no-template").exists()

    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, *args, "--run-dir", run, "--chat-template", template)
    assert rc == 0, err
    assert load_tokenizer(RunDir(run).tokenizer).chat_template == CHATML  # resume and export read it there
