"""Every registered family against transformers' own class, by its `example()`: the tests a family gets by
being registered (`layers.config.FAMILIES`). Logits, gradients and streamed training within transformers'
fp32 noise; a folder transformers wrote trained, exported, generated from and evaluated through the CLI
(`streamer eval`'s loss is transformers' on the export); planner = ledger = dry run to the byte; LoRA as PEFT
loads it; resume bit for bit; and the docs' list of families."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
import transformers

from layers import FAMILIES, PRESETS, FamilyUnits, ModelConfig, build_unit, learned_tokens, resident_model
from layers.model import family_units
from memory_model import device_spec, plan
from streamer import StreamingTrainer, TrainerConfig
from streamer.calibration.dryrun import dry_run
from streamer.cli.generate import open_trainer
from streamer.generate import Sampling, generate
from streamer.io.data import load_dataset
from streamer.io.tokenizer import load_tokenizer
from streamer.run_dir import RunDir
from tests.conftest import randomize_
from tests.test_cli import run_cli
from tests.test_runtime import (
    EAGER_EXPERTS, assert_led_by_rounding_within_adam_steps, hf_fp32_noise, hf_kernels, hf_reference, led_error,
)

ROOT = Path(__file__).resolve().parent.parent
TYPES = sorted(FAMILIES)


def example(model_type: str) -> ModelConfig:
    return FAMILIES[model_type].example()


def for_cli(model_type: str) -> ModelConfig:
    """The family's example at the tiny tokenizer's vocabulary, long enough for its sequences."""
    return example(model_type).resized(vocab_size=512, max_position_embeddings=64)


def hf_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, attn: str = "eager",
             seed: int = 0) -> transformers.PreTrainedModel:
    """transformers' model of cfg (its model_type's class), seeded weights of unit-activation scale."""
    hf_cfg = transformers.AutoConfig.for_model(**cfg.adapter().to_hf())
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attn, **EAGER_EXPERTS).eval()
    randomize_(model, seed)
    return model.to(dtype)


def test_every_family_is_documented() -> None:
    """README's list of models names each registered model_type once, and no other."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Models"):]
    section = section[:section.index("\n## ", 4)]
    assert re.findall(r"^- `(\w+)`", section, flags=re.M) == list(FAMILIES)


def test_the_from_pretrained_help_names_every_family(capsys) -> None:
    """`streamer train --help` lists the model_types --from-pretrained reads: every registered family."""
    rc, out, _ = run_cli(capsys, "train", "--help")
    assert rc == 0
    assert f"model_type is one of {', '.join(FAMILIES)}" in " ".join(out.split())


def test_readme_names_only_presets_that_exist() -> None:
    """README's Models names presets of published shapes and a tiny one: each is a preset."""
    text = (ROOT / "README.md").read_text()
    named = text[text.index("The presets `"):text.index("is a tiny one")]
    assert set(re.findall(r"`([\w.-]+)`", named)) <= set(PRESETS)


def test_every_preset_is_documented() -> None:
    """docs/CLI.md's `--model` names every preset of every family."""
    text = (ROOT / "docs" / "CLI.md").read_text()
    listed = text[text.index("The presets are"):text.index("A tokenizer is then trained")]
    assert set(re.findall(r"`([\w.-]+)`", listed)) == set(PRESETS)


@pytest.mark.parametrize("model_type", TYPES)
def test_the_family_is_its_transformers_class(model_type: str) -> None:
    """The example is its own class; its units are a FamilyUnits; its tensors, their shapes and its parameter
    count are those of transformers' class on the meta device; each block is built for its layer type."""
    cfg = example(model_type)
    assert type(cfg) is FAMILIES[model_type] and cfg.model_type == model_type
    assert isinstance(family_units(cfg), FamilyUnits)
    assert len(cfg.attention().layer_types()) == cfg.num_hidden_layers
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**cfg.adapter().to_hf()))
    ours = resident_model(cfg, init=False)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters())
    for unit in cfg.unit_names():
        module = build_unit(cfg, unit)
        assert sum(p.numel() for p in module.parameters()) == cfg.params().device(unit), unit


@pytest.mark.parametrize("model_type", TYPES)
def test_logits_and_gradients_equal_transformers_within_its_fp32_noise(model_type: str) -> None:
    """The resident model's logits and every parameter's gradient, against transformers in float64, within
    twice transformers' own fp32 error (its eager and sdpa kernels, or eager alone where its class has no sdpa)."""
    cfg = example(model_type)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))

    def run(model: torch.nn.Module, logits_of) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = logits_of(model)
        F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), ids[:, 1:].flatten()).backward()
        return logits.detach().double(), {k: p.grad.double() for k, p in model.named_parameters()}

    exact = run(hf_model(cfg, torch.float64), lambda m: m(ids).logits)
    noise = [run(hf_model(cfg, attn=attn), lambda m: m(ids).logits) for attn in hf_kernels(cfg)]
    ours = resident_model(cfg, init=False)
    ours.load_hf_state_dict(hf_model(cfg).state_dict())
    mine = run(ours, lambda m: m(ids))
    assert exact[0].abs().max() > 1.0  # logits of unit size: the comparison sees every part of the model
    bound = max((n[0] - exact[0]).abs().max().item() for n in noise)
    assert (mine[0] - exact[0]).abs().max().item() <= 2 * bound
    for k in exact[1]:
        bound = max((n[1][k] - exact[1][k]).abs().max().item() for n in noise)
        assert (mine[1][k] - exact[1][k]).abs().max().item() <= 2 * bound, k


@pytest.mark.parametrize("model_type", TYPES)
def test_streamed_training_equals_transformers_and_adamw(tmp_path: Path, model_type: str) -> None:
    """Three streamed steps (two micro-batches each, clipped, decayed) against transformers' class with torch's
    AdamW in float64, within twice transformers' own fp32 error on the same steps."""
    assert_streamed_training_equals_transformers(tmp_path, example(model_type))


class StreamedSteps(NamedTuple):
    """What `assert_streamed_training_equals_transformers` compared: the start, the steps, the settings,
    transformers' float64 weights after them and its own fp32 error on them."""

    start: dict[str, torch.Tensor]
    steps: list[tuple[torch.Tensor, torch.Tensor]]
    tc: TrainerConfig
    exact: dict[str, torch.Tensor]
    noise: float


def assert_streamed_training_equals_transformers(tmp_path: Path, cfg: ModelConfig,
                                                 **settings: object) -> StreamedSteps:
    """Three streamed steps of cfg (two micro-batches each, clipped, decayed, `settings` beside) against
    transformers' class with torch's AdamW in float64: weights within twice transformers' own fp32 error on
    the same steps, losses within twice its own (or fp32's rounding where its own is exact)."""
    tc = TrainerConfig.of(lr=1e-3, max_grad_norm=1.0, weight_decay=0.1, dtype="fp32", store="ram",
                          update_chunk=1000, grad_accum=2, **settings)
    g = torch.Generator().manual_seed(2)
    steps = [(ids, ids) for ids in (torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(3))]
    start = {k: v.clone() for k, v in hf_model(cfg).state_dict().items()}
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.load_state_dict(start)
        losses = [trainer.step(ids, labels) for ids, labels in steps]
        state = {k: v.double() for k, v in trainer.state_dict().items()}
    exact = hf_reference(start, steps, tc, cfg)
    noise = hf_fp32_noise(start, steps, tc, exact, cfg)
    assert led_error(state, exact[0], noise.led) <= 2 * noise.weights
    assert_led_by_rounding_within_adam_steps(state, start, noise.led, tc, len(steps))
    rounding = max(abs(loss) for loss in exact[1]) * torch.finfo(torch.float32).eps  # where HF's own is exact
    assert max(abs(a - b) for a, b in zip(losses, exact[1], strict=True)) <= max(2 * noise.losses, 4 * rounding)
    return StreamedSteps(start, steps, tc, exact[0], noise.weights)


@pytest.mark.parametrize("model_type", TYPES)
def test_cli_trains_a_transformers_folder_exports_and_generates(capsys, tmp_path: Path, tiny_setup: Path,
                                                                 model_type: str) -> None:
    """`streamer train --from-pretrained` on a folder transformers wrote, then `streamer export`: transformers
    loads the export as its own class with our weights and logits, greedy generation with our KV cache is
    transformers' `generate`, and `streamer eval`'s loss is transformers' on the export."""
    assert_the_cli_trains_a_transformers_folder(capsys, tmp_path, tiny_setup, for_cli(model_type))


def assert_the_cli_trains_a_transformers_folder(capsys, tmp_path: Path, tiny_setup: Path, cfg: ModelConfig) -> None:
    """Train from the folder transformers writes for cfg, export, and hold the export and the run's evaluation
    to transformers."""
    hf_model(cfg).save_pretrained(tmp_path / "hf")
    run, out = tmp_path / "run", tmp_path / "out"
    rc, _, err = run_cli(capsys, "train", "--from-pretrained", tmp_path / "hf", "--data", tiny_setup / "train.txt",
                         "--tokenizer", tiny_setup / "tok", "--run-dir", run, "--steps", 2, "--batch", 2,
                         "--seq", 16, "--dtype", "fp32", "--sample-tokens", 0, "--eval-fraction", 0)
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "export", run, out)
    assert rc == 0, err
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **EAGER_EXPERTS).eval()
    assert type(exported) is type(hf_model(cfg))
    assert_export_is_transformers(cfg, run, out, exported)
    assert_eval_is_transformers(capsys, run, tiny_setup, tmp_path, out)


def assert_eval_is_transformers(capsys, run: Path, tiny_setup: Path, tmp_path: Path, out: Path) -> None:
    """`streamer eval` prints the loss transformers gives the export on the same sequences (float64), to the
    printed digits: the run's forwards alone, every token counted once."""
    held_out = tmp_path / "held_out.txt"
    held_out.write_text((tiny_setup / "train.txt").read_text()[:600])
    rc, printed, err = run_cli(capsys, "eval", run, "--data", held_out, "--seq", 16, "--batch", 3)
    assert rc == 0, err
    loss = float(re.search(r": loss (\d+\.\d+),", printed).group(1))
    dataset = load_dataset(held_out, load_tokenizer(RunDir(run).tokenizer), 16)
    exact = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, **EAGER_EXPERTS).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids, labels, positions, _ in dataset.batches(3):
            count = learned_tokens(labels)
            total += exact(ids, labels=labels, position_ids=positions).loss.item() * count
            tokens += count
    assert abs(loss - total / tokens) <= 5e-5 + 1e-5 * loss  # the printed rounding and fp32's noise


def assert_export_is_transformers(cfg: ModelConfig, run: Path, out: Path,
                                  exported: transformers.PreTrainedModel) -> None:
    """The run's weights are the export's; its logits are within 2x transformers' own fp32 noise against
    float64, and its greedy generation with the KV cache is transformers'."""
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    with open_trainer(RunDir(run)) as trainer:
        state = trainer.state_dict()
        ours_generated = generate(trainer, ids[:, :4], Sampling(12, temperature=0.0))
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in exported.state_dict().items()}
    exact = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, **EAGER_EXPERTS).eval()
    with torch.no_grad():
        reference = exact(ids).logits
        noise = (exported(ids).logits.double() - reference).abs().max().item()
        ours = resident_model(cfg, init=False)
        ours.load_hf_state_dict(state)
        error = (ours(ids).double() - reference).abs().max().item()
        theirs_generated = exported.generate(ids[:, :4], max_new_tokens=12, do_sample=False)
    assert error <= 2 * noise + 1e-6, (error, noise)
    assert ours_generated.tolist() == theirs_generated.tolist()


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("dtype,activations,store,lora", [("fp32", "resident", "ram", 0),
                                                          ("bf16", "checkpoint", "disk", 0),
                                                          ("bf16", "resident", "ram", 4)])
def test_planner_dry_run_and_real_run_agree_to_the_byte(tmp_path: Path, model_type: str, dtype: str,
                                                        activations: str, store: str, lora: int) -> None:
    """The family's byte formulas: the planner's peak is the real run's ledger and the dry run's, and the
    real run's streamed state is the dry run's, for full fine-tuning and for LoRA on every projection. The dry
    run's activations are the real run's too, but for a LayerNorm in bf16: meta's keeps its mean and rstd in fp32
    (4 bytes more per token each) where the CPU's keeps them in bf16 (tests/test_dryrun.py). No clipping: a fused
    step that clips is made again after the backward, whose peak the plan of the fused step leaves out."""
    assert_planner_dry_run_and_real_run_agree(tmp_path, example(model_type), dtype, activations, store, lora)


def planned_peak(cfg: ModelConfig, tc: TrainerConfig) -> int:
    """The planner's peak of the byte test's step (two sequences of 24 tokens) under tc's step settings."""
    return plan(cfg, device_spec("h100-sxm"), tc.plan_config(2, 24)).peak_device_bytes


def byte_test_settings(cfg: ModelConfig, dtype: str, activations: str, store: str, lora: int) -> TrainerConfig:
    return TrainerConfig.of(dtype=dtype, activations=activations, update_chunk=5_000, store=store, max_grad_norm=0,
                            lora_rank=lora, **({"lora_targets": ",".join(cfg.lora().projections)} if lora else {}))


def assert_planner_dry_run_and_real_run_agree(tmp_path: Path, cfg: ModelConfig, dtype: str, activations: str,
                                              store: str, lora: int) -> None:
    """The planner's peak is the real run's ledger and the dry run's (see the test above)."""
    tc = byte_test_settings(cfg, dtype, activations, store, lora)
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5)))
        real = trainer.ledger.peak, dict(trainer.ledger.peak_breakdown)
    dry = dry_run(cfg, tc, 2, 24)
    assert real[0] == planned_peak(cfg, tc)
    gap = dry.peak - real[0]
    assert gap == 0 or (gap % (4 * 2 * 24) == 0 and 0 < gap <= 4 * 4 * 2 * 24 and dtype == "bf16"
                        and any(isinstance(m, torch.nn.LayerNorm) for m in build_unit(cfg, "block.0").modules()))
    assert {k: v for k, v in real[1].items() if k != "activations"} == \
        {k: v for k, v in dict(dry.peak_breakdown).items() if k != "activations"}


@pytest.mark.parametrize("model_type", TYPES)
def test_lora_on_every_projection_exports_what_peft_loads(capsys, tmp_path: Path, tiny_setup: Path,
                                                          model_type: str) -> None:
    """--lora-targets with every projection of the family, by PEFT's names: PEFT loads the adapter on
    transformers' model with the logits of our merged weights."""
    peft = pytest.importorskip("peft")
    cfg = for_cli(model_type)
    hf_model(cfg).save_pretrained(tmp_path / "hf")
    run, adapter = tmp_path / "run", tmp_path / "adapter"
    rc, _, err = run_cli(capsys, "train", "--from-pretrained", tmp_path / "hf", "--data", tiny_setup / "train.txt",
                         "--tokenizer", tiny_setup / "tok", "--run-dir", run, "--steps", 3, "--batch", 2,
                         "--seq", 16, "--dtype", "fp32", "--sample-tokens", 0, "--eval-fraction", 0, "--lr", "1e-2",
                         "--lora-rank", 4, "--lora-alpha", 8, "--lora-targets", ",".join(cfg.lora().projections))
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "export", run, adapter, "--format", "peft")
    assert rc == 0, err
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                             **EAGER_EXPERTS).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        base_logits = base(ids).logits
    loaded = peft.PeftModel.from_pretrained(base, adapter).eval()
    with open_trainer(RunDir(run)) as trainer:
        ours = resident_model(cfg, init=False)
        ours.load_hf_state_dict(trainer.state_dict())
    with torch.no_grad():
        expected = ours(ids)
        assert (base_logits - expected).abs().max().item() > 1e-2  # the adapters changed the model
        error = (loaded(input_ids=ids).logits - expected).abs().max().item()
    assert error <= 1e-4, error


@pytest.mark.parametrize("model_type", TYPES)
def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(tmp_path: Path, model_type: str) -> None:
    """Two steps, the store closed and opened again, one more step: the weights and losses of three steps in
    one go, on the disk tier with a bf16 master and int8 moments (the scale run's settings)."""
    cfg = example(model_type)
    tc = TrainerConfig.of(lr=1e-3, dtype="fp32", store="disk", master_dtype="bf16", moment_dtype="int8",
                          update_chunk=1024)
    g = torch.Generator().manual_seed(6)
    data = [torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(3)]
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "whole") as trainer:
        whole = [trainer.step(ids) for ids in data], trainer.state_dict()
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "parts") as trainer:
        first = [trainer.step(ids) for ids in data[:2]]
    with StreamingTrainer.open(tmp_path / "parts") as trainer:
        parts = first + [trainer.step(data[2])], trainer.state_dict()
    assert parts[0] == whole[0]
    assert all(torch.equal(parts[1][k], whole[1][k]) for k in whole[1])


def test_a_block_of_a_layer_type_its_family_lacks_is_refused() -> None:
    cfg = example("llama")
    with pytest.raises(ValueError, match="llama has no 'sliding_attention' layers"):
        family_units(cfg).block(cfg, "sliding_attention")
    with pytest.raises(ValueError, match=re.escape("unknown unit 'block.2'")):
        build_unit(cfg, "block.2")


def test_a_family_without_a_method_cannot_be_built() -> None:
    """ModelConfig is abstract: a family that leaves out what it must define fails at construction, naming
    it, not later with a stub's NotImplementedError."""

    @dataclasses.dataclass(frozen=True)
    class Partial(ModelConfig):
        vocab_size: int = 8

    with pytest.raises(TypeError, match="abstract"):
        Partial()
