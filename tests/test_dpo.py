"""DPO on the streamed step against TRL's DPOTrainer (the reference, test-only): the same tiny Llama that
transformers wrote, the same pairs, tokenized and collated as TRL does it. One step: the loss, every LoRA gradient
and TRL's logged metrics, within twice TRL's own fp32 noise (TRL in float32 against TRL in float64); three steps
with accumulation and clipping against TRL with AdamW, LoRA and full fine-tuning; two data-parallel ranks against
one process; LoRA's reference computed in the step, on the units it loads; the planner equal to the ledger and
the dry run for a DPO step; pairs read, tokenized and cut (max_length, truncation_mode) as TRL does it; bad input
as one line."""
from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from layers import FAMILIES, IGNORE_INDEX
from memory_model import device_spec, plan
from memory_model.units import format_size
from streamer import StreamingTrainer, TrainerConfig
from streamer.advice import planned_peak
from streamer.errors import ConfigError, StreamerError
from streamer.errors import DataError
from streamer.io.preference import pair_rows, tokenize_pairs
from streamer.io.records import Pair, read_pairs
from streamer.io.tokenizer import load_tokenizer
from streamer.run_dir import RunDir
from tests.test_cli import fails
from tests.test_data_cli import write_tokenizer
from tests.test_families import hf_model
from tests.conftest import PREFERENCE_CFG

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

CFG = PREFERENCE_CFG
PAIRS = [
    {"prompt": "Question: what is a list?", "chosen": " An ordered sequence.", "rejected": " A kind of fish."},
    {"prompt": "Question: what does import do?", "chosen": " It loads a module.", "rejected": " Nothing"},
    {"prompt": "Say hello.", "chosen": " Hello there, friend.", "rejected": " No."},
    {"prompt": "Question: what is None?", "chosen": " The absence of a value.", "rejected": " A number."},
]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
TARGETS = ("q_proj", "v_proj", "down_proj")


def _trl(folder: Path, dtype: torch.dtype, loss_type: str, beta: float, label_smoothing: float = 0.0,
         lora: bool = True, attention: str = "eager", **config: Any) -> dict[str, Any]:
    """One DPOTrainer step over PAIRS as one batch: its loss, gradients (by PEFT key), metrics, the batch its
    collator made and the adapters it started from."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attention)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.eos_token
    peft_config = None
    if lora:
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(TARGETS),
                                      init_lora_weights=False, task_type="CAUSAL_LM")
    config = {"per_device_train_batch_size": len(PAIRS), "max_steps": 1, "max_grad_norm": 0.0, **config}
    args = trl.DPOConfig(output_dir=str(folder.parent / f"trl-{dtype}"), learning_rate=1e-3, logging_steps=1,
                         report_to="none", use_cpu=True, beta=beta, loss_type=[loss_type],
                         label_smoothing=label_smoothing, save_strategy="no", disable_dropout=True, seed=0,
                         bf16=False, fp16=False, train_sampling_strategy="sequential", **config)
    torch.manual_seed(0)
    trainer = trl.DPOTrainer(model=model, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(PAIRS), peft_config=peft_config)
    out: dict[str, Any] = {"initial": {k: v.detach().clone() for k, v in trainer.model.named_parameters()
                                       if v.requires_grad}}
    compute_loss = trainer.compute_loss

    def recorded(model: Any, inputs: dict[str, torch.Tensor], *rest: Any, **kw: Any) -> torch.Tensor:
        out["batch"] = {k: v.detach().clone() for k, v in inputs.items()}
        loss = compute_loss(model, inputs, *rest, **kw)
        out["loss"] = float(loss)
        return loss
    trainer.compute_loss = recorded

    record_gradients(trainer, out)
    trainer.train()
    out["metrics"] = {k: trainer.state.log_history[0][k] for k in METRICS}
    out["grad_norm"] = float(trainer.state.log_history[0]["grad_norm"])
    out["losses"] = [float(record["loss"]) for record in trainer.state.log_history if "loss" in record]
    out["final"] = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    return out


def _ours(folder: Path, reference: dict[str, Any], loss_type: str, beta: float, label_smoothing: float = 0.0,
          **flat: Any) -> dict[str, Any]:
    batch = reference["batch"]
    ids = batch["input_ids"]
    labels = ids.masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    flat = {"lora_rank": 4, "lora_alpha": 8.0, "lora_targets": ",".join(TARGETS), **flat}
    tc = TrainerConfig.of(dtype="fp32", method="dpo", beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                          max_grad_norm=0.0, lr=1e-3, **flat)
    out: dict[str, Any] = {}
    with StreamingTrainer.from_pretrained(folder, tc) as trainer:
        if trainer.adapters is None:
            out["loss"] = trainer.step(ids, labels, reference=trainer.reference_logps(ids, labels))
            out["metrics"], out["grad_norm"] = dict(trainer.metrics), trainer.grad_norm
            return out
        leaves = _set_adapters(trainer, reference["initial"])
        step = trainer.adapters.step

        def recorded(lr: float, clip_coef: float) -> None:
            out["grads"] = {name: t.grad.detach().clone() for name, t in leaves.items()}
            step(lr, clip_coef)
        trainer.adapters.step = recorded
        out["loss"] = trainer.step(ids, labels)  # the reference, the base, computed in the step
        out["metrics"] = dict(trainer.metrics)
        out["grad_norm"] = trainer.grad_norm
    return out


def _rows(folder: Path, max_length: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer = load_tokenizer(folder)
    pairs = [Pair(**pair) for pair in PAIRS]
    return pair_rows(tokenize_pairs(pairs, tokenizer, max_length), tokenizer.eos_id, max_length)


def test_truncated_rows_are_trls_collator(llama_folder: Path) -> None:
    """--max-length cuts prompt and completion from the end (keep_start), as TRL's collator; a pair whose prompt
    fills it is dropped, as TRL drops it."""
    tokenizer = load_tokenizer(llama_folder)
    pairs = tokenize_pairs([Pair(**pair) for pair in PAIRS], tokenizer, 1024)
    max_length = 9
    collated = trl.trainer.dpo_trainer.DataCollatorForPreference(tokenizer.eos_id, max_length)(
        [{"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected} for p in pairs])
    ids, labels = pair_rows(pairs, tokenizer.eos_id, max_length)
    assert torch.equal(ids, collated["input_ids"])
    assert torch.equal(labels, collated["input_ids"].masked_fill(collated["completion_mask"] == 0, IGNORE_INDEX))
    shortest = min(len(p.prompt) for p in pairs)
    kept = tokenize_pairs([Pair(**pair) for pair in PAIRS], tokenizer, shortest + 1)
    assert [len(p.prompt) for p in kept] == [shortest] * len(kept)


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_max_length_and_truncation_mode_are_trls(llama_folder: Path, tmp_path: Path, mode: str) -> None:
    """--max-length and --truncation-mode as TRL's DPOTrainer applies them: the pairs it keeps (keep_start drops
    one whose prompt fills max_length; keep_end none) and the rows its collator cuts. --max-prompt-length (TRL's
    before 1.0) under keep_end keeps a prompt's last tokens: TRL's collator over the prompts so cut."""
    import transformers
    tokenizer = load_tokenizer(llama_folder)
    whole = tokenize_pairs([Pair(**pair) for pair in PAIRS], tokenizer, 1024)
    max_length = sorted(len(p.prompt) for p in whole)[2]  # the two longest prompts fill it
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(llama_folder)
    hf_tokenizer.pad_token = hf_tokenizer.eos_token
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, save_strategy="no",
                         max_length=max_length, truncation_mode=mode)
    prepared = trl.DPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(llama_folder), args=args,
                              processing_class=hf_tokenizer,
                              train_dataset=datasets.Dataset.from_list(PAIRS)).train_dataset
    ours = tokenize_pairs([Pair(**pair) for pair in PAIRS], tokenizer, max_length, mode)
    assert [(p.prompt, p.chosen, p.rejected) for p in ours] == [
        (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) for row in prepared]
    assert len(ours) == (len(PAIRS) if mode == "keep_end" else 2)

    def collated(pairs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = trl.trainer.dpo_trainer.DataCollatorForPreference(tokenizer.eos_id, max_length, mode)(
            [{"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected} for p in pairs])
        return batch["input_ids"], batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    ids, labels = pair_rows(ours, tokenizer.eos_id, max_length, truncation_mode=mode)
    expected_ids, expected_labels = collated(ours)
    assert torch.equal(ids, expected_ids) and torch.equal(labels, expected_labels)
    if mode == "keep_end":
        cut = tokenize_pairs([Pair(**pair) for pair in PAIRS], tokenizer, max_length, mode, max_prompt_length=3)
        assert [p.prompt for p in cut] == [p.prompt[-3:] for p in whole]
        ids, labels = pair_rows(cut, tokenizer.eos_id, max_length, truncation_mode=mode)
        expected_ids, expected_labels = collated([dataclasses.replace(p, prompt=p.prompt[-3:]) for p in whole])
        assert torch.equal(ids, expected_ids) and torch.equal(labels, expected_labels)


CHATS = [{"prompt": [{"role": "user", "content": "What is a list?"}],
          "chosen": [{"role": "assistant", "content": "An ordered sequence."}],
          "rejected": [{"role": "assistant", "content": "A fish."}]},
         {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
          "chosen": [{"role": "assistant", "content": "Hello there."}],
          "rejected": [{"role": "assistant", "content": "No."}]}]


def _implicit(record: dict[str, Any]) -> dict[str, Any]:
    """A pair with its prompt folded into both completions: TRL's implicit-prompt format."""
    return {"chosen": record["prompt"] + record["chosen"], "rejected": record["prompt"] + record["rejected"]}


@pytest.mark.parametrize("implicit", [False, True], ids=["explicit", "implicit"])
def test_conversational_pairs_tokenize_as_trls(tmp_path: Path, implicit: bool) -> None:
    """Conversational pairs rendered by the tokenizer's chat template (Llama 3's, which adds its own BOS): the
    prompt, chosen and rejected ids TRL's DPOTrainer prepares, the prompt given or implicit (taken out of both
    conversations)."""
    records = [_implicit(c) for c in CHATS] if implicit else CHATS
    folder = tmp_path / "hf"
    hf_model(CFG).save_pretrained(folder)
    write_tokenizer(folder, "llama3")
    _assert_tokenized_as_trls(folder, tmp_path, records)


def test_implicit_prompt_text_pairs_tokenize_as_trls(llama_folder: Path, tmp_path: Path) -> None:
    """Plain-text pairs without a prompt (TRL's implicit prompt, the two texts' common start): the ids TRL's
    DPOTrainer prepares."""
    _assert_tokenized_as_trls(llama_folder, tmp_path, [_implicit(pair) for pair in PAIRS])


def _assert_tokenized_as_trls(folder: Path, tmp_path: Path, records: list[dict[str, Any]]) -> None:
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.eos_token
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, save_strategy="no")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    prepared = trl.DPOTrainer(model=model, args=args, processing_class=tokenizer,
                              train_dataset=datasets.Dataset.from_list(records)).train_dataset
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    ours = tokenize_pairs(read_pairs(path), load_tokenizer(folder), 1024)
    assert [(p.prompt, p.chosen, p.rejected) for p in ours] == [
        (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) for row in prepared]


def test_pairs_are_read_as_trl_reads_them(tmp_path: Path) -> None:
    """A record without a prompt has TRL's implicit one (extract_prompt); a record without `rejected` is one line
    naming the field."""
    user = {"role": "user", "content": "What color is the sky?"}
    records = [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
               {"chosen": "Same", "rejected": "Same"}, {"prompt": "Hi", "chosen": " yes", "rejected": " no"},
               {"chosen": [user, {"role": "assistant", "content": "Blue."}],
                "rejected": [user, {"role": "assistant", "content": "Green."}]}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    pairs = read_pairs(path)
    for pair, record in zip(pairs, records, strict=True):
        expected = trl.extract_prompt(record) if "prompt" not in record else record
        assert [_plain(pair.prompt), _plain(pair.chosen), _plain(pair.rejected)] == [
            expected["prompt"], expected["chosen"], expected["rejected"]]
    path.write_text(json.dumps({"prompt": "Hi", "chosen": " yes"}))
    with pytest.raises(DataError, match=r"pairs.jsonl line 1 has no 'rejected' field"):
        read_pairs(path)


def record_gradients(trainer: Any, out: dict[str, Any]) -> None:
    """A TRL trainer's gradients, before its optimizer takes them, into `out["grads"]`."""
    import transformers

    class Gradients(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            out["grads"] = {k: v.grad.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    trainer.add_callback(Gradients())


def _set_adapters(trainer: StreamingTrainer, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's adapters set to PEFT's initial ones; each leaf by its PEFT key (without `.default`)."""
    peft_keys = {unit: trainer.cfg.adapter().prefix(unit) for unit in trainer.units}
    ours = trainer.adapters.hf_state_dict(peft_keys)
    leaves = {}
    for unit, tensors in trainer.adapters.params.items():
        for key, t in tensors.items():
            name = next(k for k in ours if k.startswith(f"base_model.model.{peft_keys[unit]}") and
                        k.endswith(_peft_suffix(trainer, unit, key)))
            t.data.copy_(initial[name.replace(".weight", ".default.weight")].float())
            leaves[name] = t
    return leaves


def _plain(value: Any) -> Any:
    """A pair's field as TRL holds it: a string, or a list of messages."""
    return value if isinstance(value, str) else list(value)


def _peft_suffix(trainer: StreamingTrainer, unit: str, key: str) -> str:
    for keys in trainer.adapters.keys.values():
        if key == keys.a:
            return keys.peft_a
        if key == keys.b:
            return keys.peft_b
    raise KeyError(key)


def _scalar_noise(fp32: dict[str, Any], fp64: dict[str, Any]) -> float:
    """TRL's own fp32 noise over the step's loss and logged metrics: the largest |fp32 - fp64| among them, and at
    least one fp32 rounding of the largest (TRL's fused head computes log-probabilities in fp32 even for a float64
    model, so the two may agree to the bit: the log-probabilities at step 1 of full fine-tuning)."""
    values = [fp64["loss"], *(fp64["metrics"][k] for k in METRICS)]
    rounding = torch.finfo(torch.float32).eps * max(abs(v) for v in values)
    return max([rounding, abs(fp32["loss"] - fp64["loss"])] +
               [abs(fp32["metrics"][k] - fp64["metrics"][k]) for k in METRICS])


def _assert_losses(ours: list[float], fp64: dict[str, Any], *fp32_runs: dict[str, Any]) -> None:
    """Our three step losses within twice TRL's own fp32 noise over them: the largest |fp32 - fp64| over its fp32
    runs (eager and sdpa). A few losses a few rounding steps from float64 are a thin sample of that noise: it
    counts as at least what TRL's eager run showed on the AMD box, 6.6e-7 at a loss of 0.69 (8 machine epsilons
    of the loss)."""
    noise = max(abs(a - b) for run in fp32_runs for a, b in zip(run["losses"], fp64["losses"], strict=True))
    noise = max(noise, 8 * torch.finfo(torch.float32).eps * max(abs(x) for x in fp64["losses"]))
    assert len(fp64["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(ours, fp64["losses"], strict=True)) <= 2 * noise


def _assert_scalars(ours: dict[str, Any], fp32: dict[str, Any], fp64: dict[str, Any]) -> None:
    noise = _scalar_noise(fp32, fp64)
    assert abs(ours["loss"] - fp64["loss"]) <= 2 * noise
    for k in METRICS:
        assert abs(ours["metrics"][k] - fp64["metrics"][k]) <= 2 * noise, k


@pytest.mark.parametrize("loss_type,beta,smoothing", [("sigmoid", 0.1, 0.0), ("ipo", 0.5, 0.0),
                                                      ("hinge", 0.3, 0.0), ("robust", 0.1, 0.2)])
def test_a_lora_dpo_step_is_trls(llama_folder: Path, loss_type: str, beta: float, smoothing: float) -> None:
    """LoRA: the reference is the base with the adapters off. The loss, TRL's metrics and every adapter's
    gradient (relative to its largest entry) within twice TRL's fp32-vs-float64 difference (the largest over
    the step's scalars, and over the adapters' gradients: measured 1.2e-6 to 2.5e-6 of a gradient's largest entry
    by loss type, ours 1.6e-6 to 2.1e-6, at most 1.3 times TRL's)."""
    fp32 = _trl(llama_folder, torch.float32, loss_type, beta, smoothing)
    fp64 = _trl(llama_folder, torch.float64, loss_type, beta, smoothing)
    ours = _ours(llama_folder, fp32, loss_type, beta, smoothing, grad_accum=2)
    _assert_scalars(ours, fp32, fp64)
    ids, labels = _rows(llama_folder)  # the pairs tokenized and collated as TRL's were
    assert torch.equal(ids, fp32["batch"]["input_ids"])
    assert torch.equal(labels, fp32["batch"]["input_ids"].masked_fill(fp32["batch"]["completion_mask"] == 0,
                                                                      IGNORE_INDEX))
    assert fp64["grads"].keys() == {k.replace(".weight", ".default.weight") for k in ours["grads"]}

    def relative(grads: dict[str, torch.Tensor], name: str) -> float:
        exact = fp64["grads"][name]
        return ((grads[name].double() - exact).abs().max() / exact.abs().max()).item()
    noise = max(relative(fp32["grads"], name) for name in fp64["grads"])
    ours_grads = {k.replace(".weight", ".default.weight"): g for k, g in ours["grads"].items()}
    for name in fp64["grads"]:
        assert relative(ours_grads, name) <= 2 * noise, name


def test_three_lora_dpo_steps_with_accumulation_and_clipping_are_trls_and_adamws(llama_folder: Path) -> None:
    """Three steps of two micro-batches of two pairs each, clipped, against TRL with torch's AdamW (its default):
    each step's loss, and the adapters after the last step, within twice TRL's own fp32 noise: the larger of its
    eager and sdpa fp32 runs' differences from its float64 run (of each adapter's change, relative to the change's
    largest entry: measured 4.8e-5, ours 4.5e-5). The losses' noise is a few rounding steps, and which run has more
    turns on the CPU and the thread count: TRL's 6.6e-7 and ours 4.2e-7 on the AMD box; on one thread of an Intel
    Xeon, TRL's 2.4e-7 (eager and sdpa alike) and ours 6.0e-7."""
    config = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 3,
              "max_grad_norm": 0.05, "lr_scheduler_type": "constant", "weight_decay": 0.0}
    fp32 = _trl(llama_folder, torch.float32, "sigmoid", 0.1, **config)
    sdpa = _trl(llama_folder, torch.float32, "sigmoid", 0.1, attention="sdpa", **config)
    fp64 = _trl(llama_folder, torch.float64, "sigmoid", 0.1, **config)
    ids, labels = _rows(llama_folder)
    tc = TrainerConfig.of(dtype="fp32", method="dpo", beta=0.1, lora_rank=4, lora_alpha=8.0,
                          lora_targets=",".join(TARGETS), max_grad_norm=0.05, lr=1e-3, betas=(0.9, 0.999),
                          weight_decay=0.0, grad_accum=2)
    with StreamingTrainer.from_pretrained(llama_folder, tc) as trainer:
        leaves = _set_adapters(trainer, fp32["initial"])
        losses = [trainer.step(ids, labels) for _ in range(3)]  # each step computing its reference
        assert trainer.grad_norm > 0.05  # every step clipped (TRL's logged norms are as large)
        final = {name.replace(".weight", ".default.weight"): t.detach().clone() for name, t in leaves.items()}
    _assert_losses(losses, fp64, fp32, sdpa)

    def relative(weights: dict[str, torch.Tensor], name: str) -> float:
        start, exact = fp32["initial"][name].double(), fp64["final"][name] - fp64["initial"][name]
        return ((weights[name].double() - start - exact).abs().max() / exact.abs().max()).item()
    weight_noise = max(relative(run["final"], name) for run in (fp32, sdpa) for name in fp64["final"])
    for name in fp64["final"]:
        assert relative(final, name) <= 2 * weight_noise, name


def test_three_full_dpo_steps_with_accumulation_and_clipping_are_trls_and_adamws(llama_folder: Path) -> None:
    """Full fine-tuning: three steps of two micro-batches of two pairs each, clipped, the reference from a pass
    before step 1, against TRL (whose reference is a copy of the model before step 1) with torch's AdamW: each
    step's loss, and the weights' change over the three steps (the norm of its error over the weights, relative to
    the change's norm), within twice TRL's own fp32 noise: the larger of its eager and sdpa fp32 runs' differences
    from its float64 run (measured 6.7e-6 and 1.1e-5; ours 1.2e-5). One norm over the model, not one per tensor,
    and the key biases left out: their exact gradient is 0 (softmax ignores a shift common to a row's scores), so
    AdamW's normalisation turns rounding alone into their move."""
    config = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 3,
              "max_grad_norm": 0.05, "lr_scheduler_type": "constant", "weight_decay": 0.0}
    fp32 = _trl(llama_folder, torch.float32, "sigmoid", 0.1, lora=False, **config)
    sdpa = _trl(llama_folder, torch.float32, "sigmoid", 0.1, lora=False, attention="sdpa", **config)
    fp64 = _trl(llama_folder, torch.float64, "sigmoid", 0.1, lora=False, **config)
    ids, labels = _rows(llama_folder)
    tc = TrainerConfig.of(dtype="fp32", method="dpo", beta=0.1, max_grad_norm=0.05, lr=1e-3, betas=(0.9, 0.999),
                          weight_decay=0.0, grad_accum=2)
    with StreamingTrainer.from_pretrained(llama_folder, tc) as trainer:
        reference = trainer.reference_logps(ids, labels)
        losses = [trainer.step(ids, labels, reference=reference) for _ in range(3)]
        assert trainer.grad_norm > 0.05  # every step clipped (TRL's logged norms are as large)
        final = trainer.state_dict()
    _assert_losses(losses, fp64, fp32, sdpa)

    trained = [k for k in fp64["final"] if not k.endswith("k_proj.bias")]

    def relative(weights: dict[str, torch.Tensor]) -> float:
        exact = torch.cat([(fp64["final"][k] - fp64["initial"][k]).flatten() for k in trained])
        error = torch.cat([(weights[k].double() - fp32["initial"][k].double()).flatten() for k in trained])
        return (torch.linalg.vector_norm(error - exact) / torch.linalg.vector_norm(exact)).item()
    assert relative(final) <= 2 * max(relative(fp32["final"]), relative(sdpa["final"]))


def _dpo_rank(rank: int, world: int, port: int, folder: str, out: str, flat: dict[str, Any]) -> None:
    """One data-parallel process: three DPO steps over every pair, this process's share of each."""
    import os

    from streamer.runtime.distributed import leave_process_group
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    result = _dpo_steps(Path(folder), TrainerConfig.of(**flat), Path(out).parent / "run")
    torch.save(result, f"{out}.{rank}")
    leave_process_group()


def _dpo_steps(folder: Path, tc: TrainerConfig, store: Path) -> dict[str, Any]:
    ids, labels = _rows(folder)
    with StreamingTrainer.from_pretrained(folder, tc, store) as trainer:
        reference = None if trainer.adapters is not None else trainer.reference_logps(ids, labels)
        losses, metrics = [], []
        for _ in range(3):
            losses.append(trainer.step(ids, labels, reference=reference))
            metrics.append(dict(trainer.metrics))
        return {"losses": losses, "metrics": metrics, "state": trainer.state_dict(), "norm": trainer.grad_norm}


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_two_data_parallel_ranks_train_dpo_as_one_process(llama_folder: Path, tmp_path: Path, lora_rank: int) -> None:
    """Two gloo processes, each with two micro-batches of one pair, against one process with four: three clipped
    steps, full fine-tuning (the reference from the pass before step 1, each rank's rows gathered) and LoRA (the
    reference in each step). The losses and TRL's metrics agree to fp32 rounding of the all-reduce's order
    (measured at most 1.6e-7 apart, 5.1e-7 relative), the weights after step 3 too (measured 5.6e-6 full, 6e-8
    LoRA); both ranks hold the same weights, bit for bit."""
    import torch.multiprocessing as mp

    from tests.test_distributed import _free_port
    flat: dict[str, Any] = {"dtype": "fp32", "method": "dpo", "lr": 1e-3, "max_grad_norm": 0.05, "grad_accum": 2,
                            "lora_rank": lora_rank, "lora_targets": ",".join(TARGETS) if lora_rank else ""}
    out = str(tmp_path / "result")
    mp.spawn(_dpo_rank, args=(2, _free_port(), str(llama_folder), out, flat), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    one = _dpo_steps(llama_folder, TrainerConfig.of(**{**flat, "grad_accum": 4}), tmp_path / "one")
    assert all(torch.equal(ranks[0]["state"][k], ranks[1]["state"][k]) for k in one["state"])
    assert one["norm"] > 0.05  # clipped
    for rank in ranks:
        assert rank["losses"] == pytest.approx(one["losses"], abs=1e-6)
        for ours, theirs in zip(rank["metrics"], one["metrics"], strict=True):
            assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-6)
    # A hundredth of the most three AdamW steps move a weight (3 x lr): AdamW's normalisation turns the all-reduce's
    # rounding of a gradient entry near 0 into a move of up to lr.
    assert max((ranks[0]["state"][k] - one["state"][k]).abs().max().item() for k in one["state"]) <= 0.01 * 3e-3


def test_a_lora_step_computes_its_reference_on_the_units_it_loads(llama_folder: Path) -> None:
    """With LoRA the step's forward runs each unit for the policy and, adapters off, for the reference, on one
    load: the step loads what a step given its reference loads (the trace's load spans, the schedule's loads), and
    its reference is the pass before training's (`reference_logps`) bit for bit, its loss too. The same rows in
    both; only how they group into micro-batches differs (a step's holds pairs, the pass's consecutive rows),
    which leaves each row's arithmetic as it is on this CPU."""
    from memory_model.schedule import load_order, step_events

    ids, labels = _rows(llama_folder)
    tc = TrainerConfig.of(dtype="fp32", method="dpo", lora_rank=4, lora_alpha=8.0, lora_targets=",".join(TARGETS),
                          lr=1e-3, grad_accum=2, activations="checkpoint")
    with StreamingTrainer.from_pretrained(llama_folder, tc) as trainer:
        generator = torch.Generator().manual_seed(1)
        for tensors in trainer.adapters.params.values():
            for t in tensors.values():
                t.data.copy_(torch.randn(t.shape, generator=generator) * 0.1)  # adapters that change the model
        before = trainer.evaluate(ids, labels)
        assert trainer.evaluate(ids, labels, reference=trainer.reference_logps(ids, labels)) == before
        reference = trainer.reference_logps(ids, labels)
        loss = trainer.step(ids, labels)
        taken = torch.cat([batch.objective.reference for batch in trainer.executor.current.micro_batches])
        loads = len([s for s in trainer.trace.spans(step=1) if s.phase == "load"])
        trainer.step(ids, labels, reference=trainer.reference_logps(ids, labels))
        given_loads = len([s for s in trainer.trace.spans(step=2) if s.phase == "load"])
        planned = len(load_order(step_events(trainer.step_spec(2, fused=trainer.last_schedule == "fused")),
                                 tc.step.prefetch))
    chosen, rejected = reference.chunk(2)  # the step's micro-batches: each holds two pairs, chosen then rejected
    assert torch.equal(taken, torch.cat([chosen[:2], rejected[:2], chosen[2:], rejected[2:]]))
    assert loads == given_loads == planned
    assert loss == pytest.approx(before, rel=1e-6)


def test_a_full_dpo_step_is_trls(llama_folder: Path) -> None:
    """Full fine-tuning: the reference log-probabilities computed by a forward pass before the first step (TRL's
    precompute_ref_log_probs gives the same as its reference copy). The loss, metrics and the gradient's norm."""
    fp32 = _trl(llama_folder, torch.float32, "sigmoid", 0.1, lora=False)
    fp64 = _trl(llama_folder, torch.float64, "sigmoid", 0.1, lora=False)
    ours = _ours(llama_folder, fp32, "sigmoid", 0.1, lora_rank=0, lora_targets="")
    _assert_scalars(ours, fp32, fp64)
    # The norm of TRL's fp32 gradient minus its float64 one bounds how far an fp32 norm may stray (measured 1.8e-6;
    # ours 4.4e-7 from TRL's float64 norm of 2.52).
    noise = torch.linalg.vector_norm(torch.cat([(fp32["grads"][k].double() - g).flatten()
                                                for k, g in fp64["grads"].items()])).item()
    assert abs(ours["grad_norm"] - fp64["grad_norm"]) <= 2 * noise


def test_the_planner_prices_a_dpo_step_as_the_ledger_charges_it() -> None:
    """A batch of pairs is a step of twice the rows, plus the loss's fp32 number per row (layers/preference.py)
    and, with LoRA, the reference's hidden state through the forward (its reference computed in the step):
    planner = ledger = dry run to the byte, LoRA or not, resident (the head's saved bytes in the peak) or
    checkpointed. The reference's hidden state never raises the peak: it is freed before the head's forward,
    which saves an input as large; a block's forward holds it (the ledger's span of the last block's forward: one
    micro-batch's (4, 48, d) fp32 more than where the step is given its reference). An evaluation of the pairs
    before the step gives the step's loss."""
    from streamer.calibration.dryrun import dry_run

    cfg = dataclasses.replace(FAMILIES["llama"].example(), max_position_embeddings=64)
    ids = torch.randint(0, cfg.vocab_size, (8, 48), generator=torch.Generator().manual_seed(0))
    labels = ids.masked_fill(torch.arange(48) < 20, IGNORE_INDEX)
    for lora_rank in (0, 4):
        for activations in ("resident", "checkpoint"):
            tc = TrainerConfig.of(dtype="fp32", activations=activations, update_chunk=20_000, lora_rank=lora_rank,
                                  method="dpo", grad_accum=2)
            with StreamingTrainer(cfg, tc) as trainer:
                reference = None if lora_rank else trainer.reference_logps(ids, labels)
                before = trainer.evaluate(ids, labels, reference=reference)
                # the evaluation runs the step's forward (without autograd): the same loss
                assert trainer.step(ids, labels, reference=reference) == pytest.approx(before, rel=1e-6)
                real = trainer.ledger.peak, trainer.ledger.peak_breakdown
            predicted = plan(cfg, device_spec("h100-sxm"), tc.plan_config(8, 48))
            assert (predicted.peak_device_bytes, predicted.peak_breakdown) == real
            dry = dry_run(cfg, tc, 8, 48)
            assert (dry.peak, dry.peak_breakdown) == real
            if activations == "resident":  # the 4 rows of a micro-batch, 4 bytes each, at the head
                sft = tc.replace(method="sft").plan_config(8, 48)
                assert predicted.peak_device_bytes - plan(cfg, device_spec("h100-sxm"), sft).peak_device_bytes == 16
    tc = TrainerConfig.of(dtype="fp32", activations="checkpoint", lora_rank=4, method="dpo", grad_accum=2)
    with StreamingTrainer(cfg, tc) as trainer:
        def last_block(step: int) -> list[int]:
            return [s.peak_bytes for s in trainer.trace.spans(step) if (s.layer, s.phase) == ("block.1", "forward")]
        trainer.step(ids, labels)
        in_step = last_block(1)
        trainer.step(ids, labels, reference=trainer.reference_logps(ids, labels))
        given = last_block(2)
    assert [a - b for a, b in zip(in_step, given, strict=True)] == [4 * 48 * cfg.hidden_size * 4] * 2


def test_bad_dpo_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = dataclasses.replace(FAMILIES["llama"].example(), max_position_embeddings=64)
    ids = torch.randint(0, cfg.vocab_size, (6, 16), generator=torch.Generator().manual_seed(0))
    with StreamingTrainer(cfg, TrainerConfig.of(method="dpo", grad_accum=2, dtype="fp32")) as trainer:
        with pytest.raises(StreamerError, match="DPO needs the reference log-probability of each of the 6 rows"):
            trainer.step(ids, ids)
        with pytest.raises(StreamerError, match="3 pairs do not split into 2 micro-batches"):
            trainer.step(ids, ids, reference=torch.zeros(6))
    with pytest.raises(ConfigError, match="label_smoothing is read by --loss-type robust only"):
        TrainerConfig.of(method="dpo", label_smoothing=0.1)
    with pytest.raises(ConfigError, match="loss_type"):
        TrainerConfig.of(method="dpo", loss_type="exo_pair")
    line = fails(capsys, "train", "--run-dir", tmp_path / "run", "--steps", 1, "--method", "dpo")
    assert "--method dpo trains on preference pairs; pass --data FILE" in line
    assert not (tmp_path / "run").exists()


# --- `streamer train --method dpo` ----------------------------------------------------------------------------------
def _pairs_file(folder: Path) -> Path:
    data = folder / "pairs.jsonl"
    data.write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    return data


def _dpo_argv(llama_folder: Path, data: Path, run: Path, *extra: object) -> list[object]:
    """Full fine-tuning on PAIRS, every pair in each step's batch, evaluated on them too."""
    return ["train", "--method", "dpo", "--from-pretrained", llama_folder, "--data", data, "--eval-data", data,
            "--run-dir", run, "--steps", 3, "--batch", len(PAIRS), "--seq", 48, "--dtype", "fp32", "--lr", 1e-3,
            "--max-grad-norm", 0, "--eval-every", 0, "--sample-tokens", 0, *extra]


def _logged(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_streamer_train_method_dpo_is_the_python_apis_steps_and_trls_first(llama_folder: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's steps are the Python API's, bit for bit (the same rows, the reference from one pass before step 1);
    step 1's loss and metrics are TRL's within twice its fp32 noise; the evaluations log TRL's eval_ names."""
    from streamer.io.data import BatchStream
    from streamer.session import pair_dataset, pair_rows_of
    from tests.test_cli import run_cli

    data, run = _pairs_file(tmp_path), tmp_path / "run"
    rc, out, err = run_cli(capsys, *_dpo_argv(llama_folder, data, run))
    assert rc == 0, err
    steps = [r for r in _logged(run) if "loss" in r]
    evals = [r for r in _logged(run) if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and [r["step"] for r in evals] == [3]
    assert all(f"eval_{k}" in evals[0] for k in METRICS) and "eval_perplexity" not in evals[0]
    assert (run / "reference.json").is_file()
    # --batch counts pairs; the plan prices their two rows each, as the run's ledger charged them.
    cfg = RunDir.open(run).read_config()
    measured = max(r["device_peak_bytes"] for r in steps)
    assert planned_peak(cfg.model_config(), cfg) == measured
    assert f"the planner predicts {format_size(measured)}" in out

    tokenizer = load_tokenizer(llama_folder)
    pairs = pair_dataset(str(data), tokenizer, 48)
    everything = (pair_rows_of(pairs.input_ids), pair_rows_of(pairs.labels))
    stream = BatchStream(pairs, len(PAIRS), 0)
    tc = TrainerConfig.of(method="dpo", dtype="fp32", lr=1e-3, max_grad_norm=0.0)
    with StreamingTrainer.from_pretrained(llama_folder, tc) as trainer:
        reference = trainer.reference_logps(*everything)  # the chosen rows, then the rejected, in file order
        by_row = {(ids.numpy().tobytes(), labels.numpy().tobytes()): i for i, (ids, labels)
                  in enumerate(zip(pairs.input_ids, pairs.labels, strict=True))}
        for logged in steps:
            ids, labels, _, _ = next(stream)
            index = torch.tensor([by_row[(i.numpy().tobytes(), lab.numpy().tobytes())]
                                  for i, lab in zip(ids, labels, strict=True)])
            loss = trainer.step(pair_rows_of(ids), pair_rows_of(labels),
                                reference=torch.cat([reference[index], reference[index + len(PAIRS)]]))
            assert loss == logged["loss"] and all(trainer.metrics[k] == logged[k] for k in METRICS)

    fp32 = _trl(llama_folder, torch.float32, "sigmoid", 0.1, lora=False)
    fp64 = _trl(llama_folder, torch.float64, "sigmoid", 0.1, lora=False)
    _assert_scalars({"loss": steps[0]["loss"], "metrics": steps[0]}, fp32, fp64)


def test_a_killed_dpo_run_resumes_bit_identically(llama_folder: Path, tmp_path: Path) -> None:
    """Killed once step 1 is logged: the same command keeps the reference log-probabilities the run folder holds
    and finishes the run as an uninterrupted one, bit for bit."""
    from tests.test_lifecycle import kill_when, metric_lines, streamer

    data = _pairs_file(tmp_path)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert streamer(*map(str, _dpo_argv(llama_folder, data, whole))).returncode == 0
    argv = [str(a) for a in _dpo_argv(llama_folder, data, killed)]
    # Once its line is in: the file exists from its open on, before the line is written, and a kill then leaves
    # step 1 committed but not logged, so the resumed run logs it from the store's losses, without its metrics.
    stopped = kill_when(argv, lambda: metric_lines(killed) >= 1)
    assert stopped.returncode == -signal.SIGKILL, stopped.stderr
    reference = (killed / "reference.json").read_bytes()
    done = streamer(*argv)
    assert done.returncode == 0, done.stderr
    assert (killed / "reference.json").read_bytes() == reference == (whole / "reference.json").read_bytes()
    losses = {r["step"]: (r["loss"], r["logps/chosen"]) for r in _logged(whole) if "loss" in r}
    assert {r["step"]: (r["loss"], r["logps/chosen"]) for r in _logged(killed) if "loss" in r} == losses
    from streamer.run_dir import RunDir
    from streamer.session import open_trainer
    with open_trainer(RunDir(whole)) as a, open_trainer(RunDir(killed)) as b:
        left, right = a.state_dict(), b.state_dict()
    assert all(torch.equal(left[k], right[k]) for k in left)


def test_a_pair_without_rejected_is_refused_in_one_line(llama_folder: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"prompt": "Hi.", "chosen": " Hello."}) + "\n")
    line = fails(capsys, *_dpo_argv(llama_folder, data, tmp_path / "run"))
    assert f"{data} line 2 has no 'rejected' field" in line
    assert not (tmp_path / "run").exists()


def test_a_prompt_over_max_prompt_length_under_keep_start_is_refused_in_one_line(
        llama_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """keep_start cuts no prompt, so one over --max-prompt-length is one line naming the flag and the record; so
    are a --max-length over --seq and the flags without --method dpo. Nothing is written."""
    data, run = _pairs_file(tmp_path), tmp_path / "run"
    line = fails(capsys, *_dpo_argv(llama_folder, data, run, "--max-prompt-length", 4))
    assert f"{data} line 1: its prompt is" in line and "over --max-prompt-length 4" in line
    assert "--truncation-mode keep_end" in line
    line = fails(capsys, *_dpo_argv(llama_folder, data, run, "--max-length", 64))
    assert "--max-length 64 is over --seq 48" in line
    line = fails(capsys, "train", "--from-pretrained", llama_folder, "--data", data, "--run-dir", run, "--steps", 1,
                 "--truncation-mode", "keep_end")
    assert "--truncation-mode cuts DPO's pairs, read with --method dpo only" in line
    assert not run.exists()


def test_streamer_train_method_dpo_with_lora_computes_each_reference_in_its_step(
        llama_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With LoRA there is no pass before step 1 and no RUN/reference.json: each step's forward computes its
    reference. The run's steps are the Python API's, bit for bit, and its device peak is the plan's, to the byte;
    the pairs are cut as --max-length and --truncation-mode keep_end say."""
    from streamer.io.data import BatchStream, DataConfig
    from streamer.session import pair_dataset, pair_rows_of
    from tests.test_cli import run_cli

    data, run = _pairs_file(tmp_path), tmp_path / "run"
    lora = ("--lora-rank", 4, "--lora-alpha", 8, "--lora-targets", ",".join(TARGETS), "--max-length", 12,
            "--truncation-mode", "keep_end", "--grad-accum", 2)
    rc, out, err = run_cli(capsys, *_dpo_argv(llama_folder, data, run, *lora))
    assert rc == 0, err
    assert not (run / "reference.json").exists()
    steps = [r for r in _logged(run) if "loss" in r]
    cfg = RunDir.open(run).read_config()
    assert planned_peak(cfg.model_config(), cfg) == max(r["device_peak_bytes"] for r in steps)

    pairs = pair_dataset(str(data), load_tokenizer(llama_folder), 48,
                         DataConfig(max_length=12, truncation_mode="keep_end"))
    assert len(pairs) == len(PAIRS) and int((pairs.labels != IGNORE_INDEX).sum(dim=1).min()) > 0
    stream = BatchStream(pairs, len(PAIRS), 0)
    with StreamingTrainer.from_pretrained(llama_folder, cfg.trainer, tmp_path / "store") as trainer:  # the run's store
        for logged in steps:
            ids, labels, _, _ = next(stream)
            loss = trainer.step(pair_rows_of(ids), pair_rows_of(labels))
            assert loss == logged["loss"] and all(trainer.metrics[k] == logged[k] for k in METRICS)


def test_a_dpo_steps_time_over_an_sft_steps_is_planned_as_measured_here(tmp_path: Path) -> None:
    """On this CPU, full fine-tuning: the plan's ratio of a DPO step of B pairs (2B rows, the reference computed
    before) to an SFT step of B rows, on this machine's calibration, against the measured ratio; and a DPO step
    against an SFT step of its 2B rows (planned equal). Measured in the process's CPU time on one thread, the
    trainers' steps interleaved, a ratio the median of the pairs': on this shared 2-core box (load average 15) a
    step's wall time varied 2x, its CPU time under 10%.

    Measured (Llama d256 x 4 blocks, 4 x 64 tokens, 5 to 7 pairs of steps): 1.72 to 1.78 (pairs 1.60 to 1.82); a
    DPO step of 4 pairs against an SFT step of its 8 rows 0.985 (0.91 to 1.03). The plan's first ratio hangs on
    the calibrated fixed cost of a unit's event, the same in both steps, which a loaded box measures anywhere from
    0.8 to 5.7 ms (wall time): over four calibrations it was planned at 1.63 to 1.97, within 11% of the measured.
    So the tolerance: the pairs' spread (half their range over their median: 4% to 8% measured) and 12% for the
    calibration. A DPO step priced without its second rows (1.0, against 1.72) falls outside it."""
    import statistics
    import time

    from streamer.calibration.calibrate import CalibrationSizes, calibrate

    shape = dataclasses.replace(FAMILIES["llama"].example(), hidden_size=256, intermediate_size=1024,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_hidden_layers=4,
                                vocab_size=1024, max_position_embeddings=128)
    sizes = CalibrationSizes(matmul_n=256, probe_width=256, probe_tokens=64, compute_seconds=0.5, copy_bytes=2**18,
                             disk_bytes=2**18, update_params=2**18, allreduce_bytes=2**14, repeats=1)
    pairs, seq, steps = 4, 64, 5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        device = calibrate(tmp_path, shape, "fp32", sizes)
        steps_of = {"sft": ("sft", pairs), "dpo": ("dpo", 2 * pairs), "sft of 2B rows": ("sft", 2 * pairs)}
        planned, trainers, inputs = {}, {}, {}
        for name, (method, rows) in steps_of.items():
            tc = TrainerConfig.of(dtype="fp32", method=method, store="ram", max_grad_norm=0.0)
            planned[name] = plan(shape, device, tc.plan_config(rows, seq), limits=False).step_time_s
            trainers[name] = StreamingTrainer(shape, tc)
            ids = torch.randint(1, shape.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))
            # full fine-tuning's reference: a pass before the steps
            inputs[name] = ids, trainers[name].reference_logps(ids, ids) if method == "dpo" else None
        seconds: dict[str, list[float]] = {name: [] for name in steps_of}
        try:
            for i in range(1 + steps):  # the first steps warm up
                for name, trainer in trainers.items():
                    ids, reference = inputs[name]
                    began = time.process_time()
                    trainer.step(ids, ids, reference=reference)
                    if i:
                        seconds[name].append(time.process_time() - began)
        finally:
            for trainer in trainers.values():
                trainer.close()
        for name in steps_of:
            if name == "dpo":
                continue
            ratios = [d / s for s, d in zip(seconds[name], seconds["dpo"], strict=True)]
            measured = statistics.median(ratios)
            tolerance = (max(ratios) - min(ratios)) / 2 / measured + 0.12
            expected = planned["dpo"] / planned[name]
            assert abs(expected / measured - 1) <= tolerance, (name, expected, measured, ratios)
    finally:
        torch.set_num_threads(threads)
