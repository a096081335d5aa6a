"""Data as users bring it, through `streamer train`: tokenizers that add BOS (Llama 3) or none (Qwen) held against
transformers and TRL's tokenization, examples longer than --seq, --epochs (and a run stopped mid-epoch), learned
tokens/s and MFU."""
from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from layers import IGNORE_INDEX, learned_tokens
from memory_model.shapes import step_model_flops
from streamer.io.data import BatchStream, Example, load_dataset, tokenize
from streamer.io.tokenizer import load_tokenizer
from streamer.run_dir import RunDir
from tests.conftest import TINY_RUN_MODEL
from tests.test_cli import fails, run_cli
from tests.test_lifecycle import ENV, kill_when, metric_lines
from tests.test_llama import CONFIGS, hf_model

HEADERS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
PAIRS = [{"prompt": "Question: what does the for statement do?", "completion": " It repeats a block."},
         {"prompt": "Question: what is a class?", "completion": " A template for objects."},
         {"prompt": "Question: what does import do?", "completion": " It loads a module."},
         {"prompt": "Question: what is None?", "completion": " The absence of a value."}]
CHAT = [{"role": "user", "content": "What is a list?"}, {"role": "assistant", "content": "An ordered sequence."}]


def write_tokenizer(folder: Path, style: str) -> None:
    """A byte-level BPE saved as transformers saves one: Llama 3's adds <|begin_of_text|> before a text (a
    TemplateProcessing post-processor, add_bos_token in its config); Qwen's adds nothing."""
    from pydoc_data.topics import topics

    bos, eos = ("<|begin_of_text|>", "<|end_of_text|>") if style == "llama3" else (None, "<|endoftext|>")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = [eos, *([bos] if bos else []), *HEADERS]
    backend.train_from_iterator([topics[k] for k in sorted(topics)[:20]], trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "chat_template": LLAMA3_CHAT}
    if bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))])
        config.update(bos_token=bos, add_bos_token=True)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", params=["llama3", "qwen"])
def hf_folder(request, tmp_path_factory) -> tuple[str, Path]:
    """A tiny Llama (or Qwen2) transformers wrote, with that family's style of tokenizer beside it."""
    style = request.param
    folder = tmp_path_factory.mktemp(style) / "hf"
    cfg = CONFIGS["llama-linear" if style == "llama3" else "qwen2"]
    hf_model(dataclasses.replace(cfg, vocab_size=448, max_position_embeddings=64)).save_pretrained(folder)
    write_tokenizer(folder, style)
    return style, folder


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trl_examples(hf: transformers.PreTrainedTokenizerBase, bos: bool = True) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of PAIRS as TRL's SFT tokenizes them: tokenizer(prompt) against tokenizer(prompt +
    completion + eos), the prompt's tokens masked (completion-only loss); `bos=False`: without the BOS."""
    out = []
    for row in PAIRS:
        prompt = hf(row["prompt"], add_special_tokens=bos)["input_ids"]
        ids = hf(row["prompt"] + row["completion"] + hf.eos_token, add_special_tokens=bos)["input_ids"]
        out.append((ids, [IGNORE_INDEX] * len(prompt) + ids[len(prompt):]))
    return out


def test_tokenized_ids_are_transformers_and_trls(hf_folder, tmp_path):
    """Our ids and labels are TRL's: BOS where the tokenizer adds one, a conversation through its chat template
    once (the template's own BOS, no second), and a generation prompt begun as training began."""
    style, folder = hf_folder
    hf, ours = transformers.AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    data = load_dataset(_jsonl(tmp_path / "pc.jsonl", PAIRS), ours, seq=64)
    for row, (ids, labels) in enumerate(trl_examples(hf)):
        assert data.input_ids[row, :len(ids)].tolist() == ids
        assert data.labels[row, :len(labels)].tolist() == labels
        assert set(data.labels[row, len(labels):].tolist()) <= {IGNORE_INDEX}
    assert (ids[0] == hf.bos_token_id) == (style == "llama3")
    chat = tokenize([Example("", messages=tuple(CHAT))], ours, seq=64)
    theirs = hf.apply_chat_template(CHAT, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert chat.input_ids[0, :len(theirs)].tolist() == theirs
    if style == "llama3":  # the template's BOS alone
        assert chat.input_ids[0].tolist().count(ours.bos_id) == 1
    assert ours.prompt_ids(PAIRS[0]["prompt"]) == hf(PAIRS[0]["prompt"])["input_ids"]
    rendered = hf.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    assert ours.prompt_ids(rendered) == hf(rendered, add_special_tokens=False)["input_ids"]


def test_step_one_loss_is_transformers_on_trls_tokenization(capsys, hf_folder, tmp_path):
    """`streamer train`'s step-1 loss on prompt/completion data equals transformers' model on the ids TRL makes
    (BOS included where the tokenizer adds it), within transformers' own fp32 noise; without the BOS it is not."""
    style, folder = hf_folder
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--from-pretrained", folder, "--data", _jsonl(tmp_path / "pc.jsonl", PAIRS),
                         "--run-dir", run, "--steps", 1, "--batch", len(PAIRS), "--seq", 64, "--dtype", "fp32",
                         "--eval-fraction", 0, "--sample-tokens", 0, "--eval-every", 0)
    assert rc == 0, err
    ours = RunDir(run).read_metrics()[0]["loss"]
    hf = transformers.AutoTokenizer.from_pretrained(folder)

    def loss(dtype: torch.dtype, bos: bool = True) -> float:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for ids, labels in trl_examples(hf, bos):
                logits = model(torch.tensor([ids])).logits[0, :-1].double()
                total += F.cross_entropy(logits, torch.tensor(labels[1:]), reduction="sum").item()
                count += sum(label != IGNORE_INDEX for label in labels[1:])
        return total / count  # the token mean over the batch, as HF Trainer's num_items_in_batch gives it

    exact = loss(torch.float64)
    noise = abs(loss(torch.float32) - exact)
    assert abs(ours - exact) <= 2 * noise + 1e-5, (ours, exact, noise)
    if style == "llama3":
        assert abs(ours - loss(torch.float64, bos=False)) > 100 * (2 * noise + 1e-5)


def streamer(*argv: object) -> subprocess.CompletedProcess:
    """The command as a user types it."""
    return subprocess.run([sys.executable, "-m", "streamer", *map(str, argv)], env=ENV, capture_output=True,
                          text=True, timeout=300)


def pairs(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}: what comes next?", "completion": f" The number {i + 1}."} for i in range(n)]


def tiny(setup: Path, run: Path, data: Path, *extra: object) -> list[object]:
    return ["train", "--model", setup / "config.json", "--tokenizer", setup / "tok", "--data", data, "--run-dir", run,
            "--batch", 4, "--seq", 32, "--dtype", "fp32", "--lr", 3e-3, "--sample-tokens", 0, "--eval-every", 0,
            "--eval-fraction", 0, *extra]


def test_long_examples_are_truncated_or_dropped_and_said_once(capsys, tiny_setup, tmp_path, monkeypatch):
    """One row far longer than --seq no longer ends the run: truncated by default (dropped with `drop`), in one
    line; a wrong value is one line naming the flag. With no peak FLOP/s known, the report says so."""
    rows = pairs(8)
    rows[3] = {"prompt": "Tell me a long story.", "completion": " once upon a time" * 40}
    data = _jsonl(tmp_path / "ragged.jsonl", rows)
    monkeypatch.chdir(tmp_path)  # no runs/ calibration cache here
    rc, out, err = run_cli(capsys, *tiny(tiny_setup, tmp_path / "cut", data, "--steps", 1))
    assert rc == 0, err
    said = [line for line in out.splitlines() if "longer than --seq" in line]
    assert said == [f"{data}: 1 example is longer than --seq 32: 1 truncated to their first 32 tokens "
                    "(--long-examples truncate; --long-examples drop or a longer --seq to change that)"]
    assert "8 train" in out and "no MFU: no peak FLOP/s is known for this device" in out
    done = streamer(*tiny(tiny_setup, tmp_path / "drop", data, "--steps", 2, "--long-examples", "drop"))
    assert done.returncode == 0, done.stderr
    assert "1 example is longer than --seq 32: 1 dropped (--long-examples drop;" in done.stdout
    assert "7 train" in done.stdout
    bad = streamer(*tiny(tiny_setup, tmp_path / "bad", data, "--long-examples", "cut"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "--long-examples must be one of truncate, drop" in bad.stderr


def test_epochs_set_the_steps_and_a_run_stopped_mid_epoch_continues_as_if_uninterrupted(capsys, tiny_setup,
                                                                                          tmp_path):
    """--epochs 2 over 10 sequences in batches of 4 is 5 steps. Killed after step 2 (mid-way through epoch 1),
    the same command continues with the uninterrupted run's losses; so does a run stopped by --steps 3 and
    resumed with --epochs 2. --epochs beside --steps, or 0, is one line naming --epochs."""
    data = _jsonl(tmp_path / "pc.jsonl", pairs(10))
    reference = tmp_path / "reference"
    done = streamer(*tiny(tiny_setup, reference, data, "--epochs", 2))
    assert done.returncode == 0, done.stderr
    saved = RunDir.open(reference).read_config()
    assert (saved.epochs, saved.steps) == (2, 5) and "10 train / 0 held-out sequences of 32 tokens (2 epochs: 5 " \
        "steps)" in done.stdout

    def losses(run: Path) -> dict[int, float]:
        records = [r for r in RunDir(run).read_metrics() if "loss" in r]
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
        return {r["step"]: r["loss"] for r in records}

    killed = tmp_path / "killed"
    argv = tiny(tiny_setup, killed, data, "--epochs", 2)
    assert kill_when(argv, lambda: metric_lines(killed) >= 2).returncode == -signal.SIGKILL
    assert streamer(*argv).returncode == 0
    assert losses(killed) == losses(reference)
    stopped = tmp_path / "stopped"
    assert streamer(*tiny(tiny_setup, stopped, data, "--steps", 3)).returncode == 0
    done = streamer("train", "--resume", stopped, "--epochs", 2)
    assert done.returncode == 0, done.stderr
    assert losses(stopped) == losses(reference)
    assert "--epochs conflicts with --steps" in fails(capsys, *tiny(tiny_setup, tmp_path / "bad", data, "--epochs",
                                                                    2, "--steps", 3))
    assert "--epochs conflicts with --steps" in fails(capsys, "train", "--resume", stopped, "--epochs", 3,
                                                      "--steps", 9)
    assert "--epochs must be" in fails(capsys, *tiny(tiny_setup, tmp_path / "bad", data, "--epochs", 0))


def test_tokens_per_s_counts_learned_tokens_and_mfu_reads_the_measured_peak(capsys, tiny_setup, tmp_path,
                                                                            monkeypatch):
    """tokens/s is the learned tokens of each step's batch (not its padding) over its time; MFU is the step's model
    FLOPs over its time and this cpu's matmul peak as its calibration measured it, logged and printed."""
    import streamer.calibration.calibrate as calibrate
    from tests.test_devices import TINY

    monkeypatch.setattr(calibrate, "DEFAULT_SIZES", TINY)
    monkeypatch.chdir(tmp_path)  # the local calibration is cached under ./runs
    local = calibrate.local_spec(Path("runs"), TINY_RUN_MODEL, "fp32")  # what `streamer calibrate` caches
    data = _jsonl(tmp_path / "pc.jsonl", pairs(10))
    rc, out, err = run_cli(capsys, *tiny(tiny_setup, tmp_path / "run", data, "--steps", 2))
    assert rc == 0, err
    tokenizer = load_tokenizer(RunDir(tmp_path / "run").tokenizer)
    stream = BatchStream(load_dataset(data, tokenizer, 32), 4, RunDir.open(tmp_path / "run").read_config().trainer.seed)
    records = [r for r in RunDir(tmp_path / "run").read_metrics() if "loss" in r]
    flops = step_model_flops(TINY_RUN_MODEL, 4, 32)
    for record in records:
        learned = learned_tokens(next(stream)[1])
        assert learned < 4 * 32 / 2  # the rows are mostly padding, and their prompts are not learned
        assert record["tokens_per_s"] * record["step_s"] == pytest.approx(learned, rel=1e-9)
        assert record["mfu"] == pytest.approx(flops / record["step_s"] / local.flops["fp32"], rel=1e-9)
        assert 0 < record["mfu"] < 1
    line = next(line for line in out.splitlines() if line.startswith("throughput: "))
    assert "learned tokens/s" in line and f"of local's fp32 peak {local.flops['fp32'] / 1e9:,.1f} GFLOP/s" in line
