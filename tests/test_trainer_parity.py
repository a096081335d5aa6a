"""`streamer train` beside Hugging Face's own training: transformers.Trainer on the same tiny GPT-J.

A step's loss and gradient are the mean over every learned token of the step, over its micro-batches (Trainer's
num_items_in_batch). The examples learn unequal token counts, so a mean of the micro-batches' own means would
differ. The reference runs in float64; the tolerances are set from HF's own fp32 kernels against it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from layers import weight_decayed
from streamer.cli.eval import evaluate_dataset
from streamer.cli.generate import open_trainer
from streamer.cli.main import main
from streamer.io.data import Dataset, load_dataset
from streamer.io.tokenizer import Tokenizer, train_bpe
from streamer.run_dir import RunDir
from conftest import TINY_RUN_MODEL, randomize_

SEQ = 48
STEPS = 3
WORDS = ("the model streams one layer at a time from host memory while the device computes the next gradient "
         "and the optimizer updates every weight in chunks").split()
# The settings both trainers get: full-batch steps of two micro-batches, warmup then cosine, clipping, decay.
LR, WARMUP, DECAY, CLIP, BETAS, EPS = 3e-3, 1, 0.1, 1.0, (0.9, 0.95), 1e-8


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(0, len(WORDS), 3)]
    return train_bpe(texts, vocab_size=TINY_RUN_MODEL.vocab_size)


@pytest.fixture(scope="module")
def source(tmp_path_factory, tokenizer) -> Path:
    """A Hugging Face GPT-J folder (random weights, the local tokenizer) and prompt/completion data.jsonl beside it:
    8 examples whose completions grow from 1 to 22 words, so each learns a different number of tokens."""
    root = tmp_path_factory.mktemp("parity")
    model = transformers.GPTJForCausalLM(transformers.GPTJConfig(**TINY_RUN_MODEL.adapter().to_hf()))
    randomize_(model, seed=0)
    model.save_pretrained(root / "hf")
    tokenizer.save(root / "hf")
    records = [{"prompt": " ".join(WORDS[i:2 * i + 2]) + ":", "completion": " " + " ".join(WORDS[i:2 + 3 * i])}
               for i in range(8)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def streamer_train(source: Path, run: Path, *extra: str) -> list[dict]:
    """`streamer train` on the whole data set per step (--batch 8, two micro-batches); its metrics.jsonl records."""
    assert main(["train", "--from-pretrained", str(source / "hf"), "--data", str(source / "data.jsonl"),
                 "--run-dir", str(run), "--steps", str(STEPS), "--batch", "8", "--grad-accum", "2",
                 "--seq", str(SEQ), "--dtype", "fp32", "--lr", str(LR), "--schedule", "cosine",
                 "--warmup", str(WARMUP), "--weight-decay", str(DECAY), "--max-grad-norm", str(CLIP),
                 "--betas", *map(str, BETAS), "--eps", str(EPS), "--eval-fraction", "0", "--eval-every", "0",
                 "--sample-tokens", "0", "--store", "ram", *extra]) == 0
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def hf_trainer(source: Path, data: Dataset, out: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """transformers.Trainer in float64 with the same settings: (per-step logs, final weights)."""
    model = transformers.GPTJForCausalLM.from_pretrained(source / "hf", dtype=torch.float64,
                                                         attn_implementation="eager")
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=len(data) // 2, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=WARMUP, weight_decay=DECAY,
        max_grad_norm=CLIP, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, optim="adamw_torch_fused",
        average_tokens_across_devices=True, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True)
    rows = [{"input_ids": ids, "labels": labels} for ids, labels in zip(data.input_ids, data.labels, strict=True)]
    steps: list[dict] = []

    class Logs(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs) -> None:
            if "loss" in logs:
                steps.append(dict(logs))

    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[Logs()])
    # The same parameters decay: matrices and embeddings, not biases or LayerNorms.
    assert set(trainer.get_decay_parameter_names(model)) == {
        name for name, p in model.named_parameters() if weight_decayed(p.shape)}
    trainer.train()
    return steps, {k: v.float() for k, v in model.state_dict().items()}


def test_streamer_train_equals_hf_trainer(tmp_path, source, tokenizer):
    data = load_dataset(source / "data.jsonl", tokenizer, SEQ)
    learned = (data.labels[:, 1:] != -100).sum(1)
    assert len(data) == 8 and len(set(learned.tolist())) == 8  # unequal: the normalization matters

    records = streamer_train(source, tmp_path / "run")
    with open_trainer(RunDir(tmp_path / "run")) as trainer:
        ours = trainer.state_dict()
    logs, theirs = hf_trainer(source, data, tmp_path / "hf-trainer")

    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and len(logs) == STEPS
    # Against the float64 Trainer, measured: losses 4.8e-7, gradient norms 1.0e-6; Trainer itself in fp32 on the
    # same steps (eager and sdpa alike): losses 9.5e-7, norms 1.0e-6.
    assert [r["loss"] for r in records] == pytest.approx([log["loss"] for log in logs], abs=2e-6)
    assert [r["grad_norm"] for r in records] == pytest.approx([log["grad_norm"] for log in logs], abs=2e-6)
    assert [r["lr"] for r in records] == pytest.approx([log["learning_rate"] for log in logs], rel=1e-12)
    # Weights, measured 1.0e-5; Trainer itself in fp32: 2.4e-5 (eager) / 2.5e-5 (sdpa), where Adam divides tiny
    # gradients. The steps moved them by up to 5.9e-3.
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 4e-5

    # The semantics matter here: the mean of the two micro-batches' own means is another number (by 4.0e-3).
    with torch.no_grad():
        model = transformers.GPTJForCausalLM.from_pretrained(source / "hf", dtype=torch.float64)
        means = [model(ids, labels=labels).loss.item() for ids, labels in zip(data.input_ids.chunk(2),
                                                                              data.labels.chunk(2), strict=True)]
    assert abs(sum(means) / 2 - records[0]["loss"]) > 1e-3


def streamer_train_packed(source: Path, run: Path, data: Path, rows: int, pack: list[str]) -> list[dict]:
    """One full-batch `streamer train --pack` step (every packed sequence once); its metrics.jsonl records."""
    assert main(["train", "--from-pretrained", str(source / "hf"), "--data", str(data), *pack,
                 "--run-dir", str(run), "--steps", "1", "--batch", str(rows), "--seq", str(SEQ),
                 "--dtype", "fp32", "--lr", str(LR), "--eval-fraction", "0", "--eval-every", "0",
                 "--sample-tokens", "0", "--store", "ram"]) == 0
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def hf_alone(source: Path, pieces: list[tuple[torch.Tensor, torch.Tensor]],
             weights: dict[str, torch.Tensor] | None = None) -> tuple[float, float]:
    """(loss, gradient norm) of HF's token mean over `pieces` (input ids, labels), each run alone in float64;
    with the source's weights or `weights` (HF-keyed)."""
    model = transformers.GPTJForCausalLM.from_pretrained(source / "hf", dtype=torch.float64)
    if weights is not None:
        model.load_state_dict({k: v.double() for k, v in weights.items()})
    tokens = sum(int((labels[1:] != -100).sum()) for _, labels in pieces)
    total = 0.0
    for ids, labels in pieces:
        learned = int((labels[1:] != -100).sum())
        if learned:
            loss = model(ids[None], labels=labels[None]).loss * learned / tokens  # its share of the token mean
            loss.backward()
            total += loss.item()
    return total, torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def test_a_packed_step_equals_hf_on_each_example_alone(tmp_path, source, tokenizer):
    """`--pack` puts several examples in a sequence, each attending only to itself with positions from 0: step 1's
    loss and gradient norm are HF's token mean over the same examples, each run alone (float64)."""
    packed = load_dataset(source / "data.jsonl", tokenizer, SEQ, pack="examples")
    assert len(packed) < 8 and packed.positions is not None  # sequences do hold several examples
    records = streamer_train_packed(source, tmp_path / "run", source / "data.jsonl", len(packed), ["--pack"])
    alone = load_dataset(source / "data.jsonl", tokenizer, SEQ)  # one example a sequence, padded after it
    ends = [int((labels != -100).nonzero().max()) + 1 for labels in alone.labels]  # each example without padding
    pieces = [(ids[:end], labels[:end]) for ids, labels, end in zip(alone.input_ids, alone.labels, ends, strict=True)]
    loss, norm = hf_alone(source, pieces)
    # Measured: loss 6.0e-8, gradient norm 2.4e-7 apart; the bounds of the unpacked steps above (HF's own fp32
    # kernels against float64: 9.5e-7 and 1.0e-6).
    assert records[0]["loss"] == pytest.approx(loss, abs=2e-6)
    assert records[0]["grad_norm"] == pytest.approx(norm, abs=2e-6)
    # Packing as before (examples seeing each other, positions running on) is another number (by 5.6e-2).
    with torch.no_grad():
        model = transformers.GPTJForCausalLM.from_pretrained(source / "hf", dtype=torch.float64)
        assert abs(model(packed.input_ids, labels=packed.labels).loss.item() - loss) > 1e-4
    # Evaluation (streamer eval's) keeps the examples apart too: the trained weights' loss, as HF's alone.
    with open_trainer(RunDir(tmp_path / "run")) as trainer:
        evaluated, _ = evaluate_dataset(trainer, packed, len(packed))
        weights = trainer.state_dict()
    trained, _ = hf_alone(source, pieces, weights)
    assert evaluated == pytest.approx(trained, abs=2e-6)  # measured 6.6e-7 (the loss is 5.16)


def test_pack_documents_gives_each_text_document_its_own_attention(tmp_path, source, tokenizer):
    """Plain text with `--pack documents`: each document's piece of a sequence attends only to itself, positions
    from 0, so step 1 is HF's token mean over those pieces run alone. Without it, text runs as it always has."""
    path = tmp_path / "notes.txt"
    path.write_text("\n\n".join(" ".join((WORDS * 3)[i:i + 6 + 3 * i]) for i in range(8)) + "\n")
    data = load_dataset(path, tokenizer, SEQ, pack="documents")
    assert load_dataset(path, tokenizer, SEQ, pack="examples").positions is None  # text untouched by --pack
    starts = [(row == 0).nonzero().flatten().tolist() + [SEQ] for row in data.positions]
    pieces = [(ids[a:b], labels[a:b]) for ids, labels, cut in zip(data.input_ids, data.labels, starts, strict=True)
              for a, b in zip(cut, cut[1:], strict=False)]
    assert len(pieces) > len(data) > 1  # sequences hold several documents, and documents cross sequences
    records = streamer_train_packed(source, tmp_path / "run", path, len(data), ["--pack", "documents"])
    loss, norm = hf_alone(source, pieces)
    # Measured: loss 3.0e-8, gradient norm 1.1e-6 apart; the bounds above.
    assert records[0]["loss"] == pytest.approx(loss, abs=2e-6)
    assert records[0]["grad_norm"] == pytest.approx(norm, abs=2e-6)
