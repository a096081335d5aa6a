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


def test_the_logged_eval_loss_is_the_token_mean_with_a_short_last_batch(capsys, tmp_path, tiny_setup):
    """Five held-out documents of different lengths in batches of 4 and 1: the logged eval loss is the mean per
    predicted token, `streamer eval`'s and transformers' in float64, not the mean of the two batches' means."""
    import torch
    import transformers
    from streamer.io.data import load_dataset

    run, held_out, hf = tmp_path / "run", tmp_path / "held-out.jsonl", tmp_path / "hf"
    words = (tiny_setup / "train.txt").read_text().split()
    held_out.write_text("".join(json.dumps({"prompt": " ".join(words[i * 40:i * 40 + 3]), "completion": " " + " ".join(
        words[i * 40 + 3:i * 40 + 3 + n])}) + "\n" for i, n in enumerate((2, 12, 4, 8, 15))))
    rc, out, err = run_cli(capsys, *tiny_args(tiny_setup, run, 1, "--eval-data", held_out))
    assert rc == 0, err
    (logged,) = [m["eval_loss"] for m in RunDir(run).read_metrics() if "eval_loss" in m]
    assert f"eval loss {logged:.3f}" in out
    rc, out, err = run_cli(capsys, "eval", run, "--data", held_out)
    assert rc == 0, err
    assert abs(float(re.search(r"loss ([\d.]+),", out).group(1)) - logged) <= 5e-5  # printed to 4 decimals

    assert run_cli(capsys, "export", run, hf)[0] == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).double().eval()
    dataset = load_dataset(held_out, load_tokenizer(RunDir(run).tokenizer), 32)
    ids, labels, _, _ = next(dataset.batches(len(dataset)))
    assert len(dataset) == 5 and len({int((row != -100).sum()) for row in labels}) > 1
    with torch.no_grad():
        logits = model(ids).logits

    def token_mean(rows: slice) -> float:  # in float64 (transformers' loss_function casts the logits to fp32)
        return torch.nn.functional.cross_entropy(logits[rows, :-1].flatten(0, 1), labels[rows, 1:].flatten(),
                                                 ignore_index=-100).item()
    reference = token_mean(slice(None))
    # Measured 3e-8 of the loss apart (fp32 against float64); a mean of the two batches' means is 1e-3 apart.
    assert abs(logged - reference) <= 1e-5 * reference
    assert abs((token_mean(slice(0, 4)) + token_mean(slice(4, 5))) / 2 - reference) > 1e-4 * reference
