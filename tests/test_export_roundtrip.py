"""A faithful Hugging Face round trip: the exported folder's tokenizer is the source's, byte for byte, and
transformers' greedy generation from it is `streamer generate`'s."""
from __future__ import annotations

import json

import tokenizers
import torch
import transformers

from streamer.cli.generate import open_trainer
from streamer.generate import Sampling, generate
from streamer.io.tokenizer import load_tokenizer, train_bpe
from streamer.run_dir import RunDir
from tests.conftest import TINY_RUN_MODEL
from tests.test_cli import run_cli

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
PROMPT = "The for statement is used"
END = "<|end|>"
# Fields of a user's config.json that no model config holds: an export keeps them.
USERS_FIELDS = {"my_project": {"dataset": "docs", "revision": 3}, "finetuning_task": "summarization"}


def _source_folder(tmp_path, tiny_hf_model, texts):
    """A tiny HF GPT-J folder with a tokenizer whose config carries what a real one does, and an end token of
    its own (the last id), so that no default id could pass for it."""
    folder = tmp_path / "source-hf"
    tiny_hf_model(TINY_RUN_MODEL, seed=1).save_pretrained(folder)
    tokenizer = train_bpe(texts, vocab_size=TINY_RUN_MODEL.vocab_size - 1)
    tokenizer.backend.add_special_tokens([tokenizers.AddedToken(END, special=True)])
    tokenizer.save(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(chat_template=CHAT_TEMPLATE, model_max_length=TINY_RUN_MODEL.n_positions, padding_side="left",
                  eos_token=END)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (folder / "special_tokens_map.json").unlink()
    model_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**model_config, **USERS_FIELDS}))
    return folder


def test_export_keeps_the_tokenizer_and_generates_what_streamer_generates(capsys, tmp_path, tiny_setup,
                                                                          tiny_hf_model):
    source = _source_folder(tmp_path, tiny_hf_model, (tiny_setup / "train.txt").read_text().split("\n\n"))
    run, out = tmp_path / "run", tmp_path / "exported"
    rc, _, err = run_cli(capsys, "train", "--from-pretrained", source, "--data", tiny_setup / "train.txt",
                         "--run-dir", run, "--steps", 1, "--batch", 4, "--seq", 32, "--dtype", "fp32",
                         "--sample-tokens", 0, "--eval-fraction", 0)
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "export", run, out)
    assert rc == 0, err

    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    tokenizer = load_tokenizer(source)
    token_ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    assert token_ids == {"bos_token_id": 0, "eos_token_id": TINY_RUN_MODEL.vocab_size - 1}
    assert json.loads((out / "generation_config.json").read_text()) == token_ids
    exported = json.loads((out / "config.json").read_text())
    assert {k: exported[k] for k in token_ids} == token_ids
    assert {k: exported[k] for k in USERS_FIELDS} == USERS_FIELDS
    assert exported["architectures"] == ["GPTJForCausalLM"]  # transformers wrote it into the source
    assert transformers.AutoConfig.from_pretrained(out).my_project == USERS_FIELDS["my_project"]
    kept = run / "source_config.json"  # checksummed: a changed digit is refused in one line naming the file
    kept.write_text(kept.read_text().replace('"revision": 3', '"revision": 4'))
    rc, _, err = run_cli(capsys, "export", run, tmp_path / "again")
    assert rc == 2 and err.strip().splitlines()[-1].startswith(f"error: {kept} is damaged"), err
    assert not (tmp_path / "again").exists()

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer.chat_template == CHAT_TEMPLATE
    assert (hf_tokenizer.model_max_length, hf_tokenizer.padding_side) == (TINY_RUN_MODEL.n_positions, "left")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = hf_tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids[0].tolist() == tokenizer.encode(PROMPT)
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()

    with open_trainer(RunDir(run)) as trainer:  # what `streamer generate --temperature 0` runs
        ours = generate(trainer, ids, Sampling(32, temperature=0.0), stop_id=tokenizer.eos_id)[0, ids.shape[1]:]
    assert ours.tolist() == theirs and len(theirs) > 1


def test_chat_template_file_reaches_the_export(capsys, tmp_path, tiny_setup):
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    run, out = tmp_path / "run", tmp_path / "exported"
    rc, _, err = run_cli(capsys, "train", "--model", tiny_setup / "config.json", "--data", tiny_setup / "train.txt",
                         "--tokenizer", tiny_setup / "tok", "--chat-template", template, "--run-dir", run,
                         "--steps", 1, "--batch", 4, "--seq", 32, "--dtype", "fp32", "--sample-tokens", 0,
                         "--eval-fraction", 0)
    assert rc == 0, err
    assert run_cli(capsys, "export", run, out)[0] == 0
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
