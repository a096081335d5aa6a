"""End to end on CPU: a Hugging Face GPT-J folder -> `streamer train` -> `streamer export` -> transformers.

The checkpoint is made here with transformers (single-file and sharded safetensors, and a weights-only
pickle); after a few streamed steps the export must load in `GPTJForCausalLM.from_pretrained` with the
trainer's own weights, and its logits must equal `layers.GPTJ` run on `trainer.state_dict()`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from pydoc_data.topics import topics

from layers import GPTJ, IGNORE_INDEX, GPTJConfig
from streamer import StreamingTrainer, TrainerConfig
from streamer.cli.main import main
from streamer.cli.generate import open_trainer
from streamer.io.data import load_dataset
from streamer.run_dir import RunDir
from streamer.io.tokenizer import Tokenizer, load_tokenizer, train_bpe

CFG = GPTJConfig(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)
SEQ = 64
TEXT = "Grüße — the for statement iterates over a sequence;\n\ttabs, 🙂 and <|endoftext|> too."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_bpe([topics[k] for k in sorted(topics)[:60]], vocab_size=CFG.vocab_size)


@pytest.fixture(scope="module")
def summaries(tmp_path_factory, tokenizer) -> Path:
    """Prompt/completion JSONL: a help topic's opening words -> its name (a stand-in for summarization)."""
    path = tmp_path_factory.mktemp("data") / "summaries.jsonl"
    records = []
    for name in sorted(topics)[:60]:
        prompt, completion = f"{' '.join(topics[name].split()[:10])}\nTopic:", f" {name}"
        if len(tokenizer.encode(prompt + completion)) < SEQ:
            records.append({"prompt": prompt, "completion": completion})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def save_checkpoint(model: transformers.GPTJForCausalLM, path: Path, layout: str) -> None:
    if layout == "bin":  # what older checkpoints ship: read back with torch.load(weights_only=True)
        path.mkdir()
        (path / "config.json").write_text(json.dumps(CFG.adapter().to_hf()))
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    else:
        model.save_pretrained(path, max_shard_size="60KB" if layout == "sharded" else "2GB")


@pytest.mark.parametrize("layout", ["single", "sharded", "bin"])
def test_hf_folder_trains_exports_and_loads_in_transformers(layout, tmp_path, tiny_hf_model, tokenizer, summaries):
    original = tiny_hf_model(CFG, seed=1)
    source, run, out = tmp_path / "source", tmp_path / "run", tmp_path / "exported"
    save_checkpoint(original, source, layout)
    tokenizer.save(source)
    assert (layout == "sharded") == (source / "model.safetensors.index.json").is_file()

    assert main(["train", "--from-pretrained", str(source), "--data", str(summaries), "--run-dir", str(run),
                 "--steps", "3", "--batch", "4", "--seq", str(SEQ), "--dtype", "fp32", "--lr", "3e-3",
                 "--eval-every", "0", "--sample-tokens", "4", "--activations", "checkpoint",
                 "--budget", "2.4MiB"]) == 0  # below the model's 16 B/param (2.5 MiB): it must stream
    assert main(["export", str(run), str(out), *(["--max-shard-size", "60KB"] if layout == "sharded" else [])]) == 0
    assert (layout == "sharded") == (out / "model.safetensors.index.json").is_file()

    with open_trainer(RunDir(run)) as trainer:
        assert trainer.step_count == 3
        state = trainer.state_dict()
    exported = transformers.GPTJForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    loaded = exported.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    before = original.state_dict()
    assert any(not torch.equal(before[k], v) for k, v in state.items())  # the steps changed the weights

    reference = GPTJ(CFG, init=False)
    reference.load_hf_state_dict(state)
    ids = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (exported(ids).logits - reference(ids)).abs().max().item()
    assert diff < 1.4e-5, diff  # measured 1.19e-6 (native) / 1.43e-6 (AVX2 cap); 10x margin

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(out)
    assert hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"] == ours.encode(TEXT)
    assert ours.decode(ours.encode(TEXT)) == TEXT


def test_completion_only_loss_matches_transformers_with_masked_labels(tiny_hf_model, tokenizer, summaries):
    data = load_dataset(summaries, tokenizer, SEQ)
    first = json.loads(summaries.read_text().splitlines()[0])
    prompt_len = len(tokenizer.encode(first["prompt"]))
    answer = tokenizer.encode(first["completion"]) + [tokenizer.eos_id]
    labels = data.labels[0].tolist()
    assert labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert labels[prompt_len:prompt_len + len(answer)] == answer
    assert set(labels[prompt_len + len(answer):]) <= {IGNORE_INDEX}  # padding is not learned either

    model = tiny_hf_model(CFG, seed=2)
    ids, labels = data.input_ids[:4], data.labels[:4]
    with StreamingTrainer(CFG, TrainerConfig.of(dtype="fp32")) as trainer:
        trainer.load_state_dict(model.state_dict())
        masked, full = trainer.evaluate(ids, labels), trainer.evaluate(ids, ids)
    with torch.no_grad():
        # measured 1.43e-6 (native) / 0 (AVX2 cap); 7x margin
        assert masked == pytest.approx(model(ids, labels=labels).loss.item(), abs=1e-5)
    assert masked != pytest.approx(full, abs=1e-3)  # they differ by 0.136 (measured): a real difference, not noise


def test_export_refuses_a_folder_with_files_unless_told(capsys, tmp_path, tiny_hf_model, tokenizer, summaries):
    source, run, out = tmp_path / "source", tmp_path / "run", tmp_path / "out"
    save_checkpoint(tiny_hf_model(CFG, seed=3), source, "single")
    tokenizer.save(source)
    assert main(["train", "--from-pretrained", str(source), "--data", str(summaries), "--run-dir", str(run),
                 "--steps", "1", "--batch", "2", "--seq", str(SEQ), "--eval-every", "0", "--sample-tokens", "0",
                 "--store", "ram"]) == 0
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(run), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert main(["export", str(run), str(out), "--dtype", "bf16", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists()
    exported = transformers.GPTJForCausalLM.from_pretrained(out)
    assert exported.transformer.h[0].attn.q_proj.weight.dtype in (torch.bfloat16, torch.float32)
