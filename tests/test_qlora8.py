"""LoRA on an 8-bit streamed base (--load-in-8bit), against transformers + bitsandbytes' Linear8bitLt + PEFT.

On a CPU in training mode bitsandbytes 0.50's Linear8bitLt dequantizes its int8 weight and runs one matmul
(MatMul8bitFp); in eval mode it quantizes the activations too. The references here run in training mode (no
dropout), the function our base computes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from layers import PRESETS
from layers.packed4 import unit_bytes
from streamer import StreamingTrainer, TrainerConfig
from streamer.cli.main import main
from tests.test_families import hf_model
from tests.test_qlora import ALPHA, CFG, RANK, TARGETS, _adapters, assert_lora_gradients_within_noise, \
    assert_planned_to_the_byte, projection_errors

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _settings(**more: object) -> TrainerConfig:
    settings = {"dtype": "fp32", "store": "ram", **more}
    return TrainerConfig.of(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=",".join(TARGETS), load_in_8bit=True,
                            **settings)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    hf_model(CFG).save_pretrained(folder)
    return folder


def _bnb_model(folder: Path, attn: str, **quant: object) -> torch.nn.Module:
    config = transformers.BitsAndBytesConfig(load_in_8bit=True, **quant)
    # Training mode: bitsandbytes' CPU path then dequantizes the weight for one matmul (eval mode quantizes the
    # activations).
    return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.float32,
                                                             device_map="cpu", attn_implementation=attn).train()


def write_bnb_8bit(hf_folder: Path, out: Path) -> Path:
    """A hub 8-bit folder as transformers saves one: `hf_folder` loaded with load_in_8bit, saved with its
    quantization_config, each weight's int8 codes and SCB; the tokenizer's files beside it."""
    _bnb_model(hf_folder, "eager").save_pretrained(out)
    for path in hf_folder.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (out / path.name).write_bytes(path.read_bytes())
    return out


def _codes(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear8bitLt's int8 codes and row absmax, wherever it keeps them (its weight, or its state after a call)."""
    weight = module.weight
    return (weight.CB, weight.SCB) if weight.SCB is not None else (module.state.CB, module.state.SCB)


def _dequantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The 8-bit model's weights as bitsandbytes dequantizes them (int8_vectorwise_dequant), in float64."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear8bitLt):
            out[f"{name}.weight"] = bnb.functional.int8_vectorwise_dequant(*_codes(module))
    for name, param in model.named_parameters():
        out.setdefault(name, param.data)
    return {k: v.double() for k, v in out.items()}


def test_import_quantizes_as_bitsandbytes_int8_vectorwise_quant(checkpoint: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
    theirs = _bnb_model(checkpoint, "eager")
    with StreamingTrainer.from_pretrained(checkpoint, _settings()) as trainer:
        layout = trainer.layouts["block.1"]
        slab = trainer.store.slab("block.1", "compute")
        assert slab.dtype == torch.uint8 and slab.numel() == unit_bytes(CFG, "block.1", 4, False, int8=True)
        pieces = layout.packed.views(slab)
        for target in TARGETS:
            key = next(s.key for s in layout.slots if s.key.endswith(f"{target}.weight"))
            module = key.rsplit(".", 1)[0]
            # Int8Params quantizes a weight from float16: so does the import.
            codes, absmax, _ = bnb.functional.int8_vectorwise_quant(hf[f"model.layers.1.{key}"].half())
            assert torch.equal(pieces[key], codes) and torch.equal(pieces[f"{module}.SCB"], absmax)
            saved = _codes(theirs.get_submodule(f"model.layers.1.{module}"))
            assert torch.equal(pieces[key], saved[0]) and torch.equal(pieces[f"{module}.SCB"], saved[1])
        norm = next(s for s in layout.slots if s.key.endswith("layernorm.weight"))
        assert torch.equal(pieces[norm.key], hf[norm.hf_key])
    # One int8 byte a weight and an fp32 scale a row: about a quarter of fp32's bytes for a block.
    assert unit_bytes(CFG, "block.1", 4, False, int8=True) < CFG.params().own("block.1") * 4 * 0.4


def test_rows_of_an_8bit_weight_are_its_dequantized_rows() -> None:
    """`dequantize_rows`, which every frozen quantization answers, gives the rows `dequantize` gives."""
    from layers.quant4 import Quant8

    quant = Quant8(torch.bfloat16)
    pieces = quant.quantize(torch.randn(12, 40, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(quant.dequantize_rows(pieces, (12, 40), 3, 5), quant.dequantize(pieces, (12, 40))[3:8])


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_an_8bit_projection_computes_as_bitsandbytes_linear8bitlt(compute: torch.dtype) -> None:
    """Our projection against bitsandbytes' Linear8bitLt (training mode, the input in `compute`) on the same codes:
    output and input gradient within twice its own error against the dequantized weight's product in float64."""
    from layers.quant4 import Linear4bit, Quant8

    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 128, generator=g), torch.randn(96, generator=g)
    x = torch.randn(5, 128, generator=g).to(compute)
    theirs = bnb.nn.Linear8bitLt(128, 96, has_fp16_weights=False)
    theirs.load_state_dict({"weight": weight, "bias": bias})
    theirs = theirs.to("cpu").train()  # quantizes, as transformers' loading does
    ours = Linear4bit(128, 96, True, Quant8(compute), compute)
    named = {**ours.quant.quantize(weight), "bias": bias.to(compute)}
    exact_weight = bnb.functional.int8_vectorwise_dequant(*_codes(theirs))
    for noise, error in projection_errors(theirs, ours, named, x, exact_weight, bias.to(compute)):
        assert 0 < noise and error <= 2 * noise


def test_lora_loss_and_gradients_equal_transformers_8bit_with_peft_within_its_fp32_noise(checkpoint: Path) -> None:
    """The loss and every adapter's gradient against transformers' 8-bit model + PEFT, within twice its own fp32
    error against the dequantized model in float64."""
    assert_lora_gradients_within_noise(checkpoint, _settings(max_grad_norm=0.0),
                                       lambda attn: _bnb_model(checkpoint, attn), _dequantized)


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_planner_ledger_and_dry_run_agree_to_the_byte(tmp_path: Path, store: str) -> None:
    tc = _settings(grad_accum=2, activations="checkpoint", store=store)
    assert_planned_to_the_byte(tmp_path, tc, store, lambda unit: unit_bytes(CFG, unit, 4, False, int8=True))


def test_bad_8bit_settings_are_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, words in (([], ("--lora-rank", "--load-in-8bit")),
                        (["--lora-rank", "4", "--load-in-4bit"], ("--load-in-8bit", "--load-in-4bit")),
                        (["--lora-rank", "4", "--bnb-4bit-use-double-quant"], ("--load-in-8bit", "--bnb-4bit")),
                        (["--lora-rank", "4", "--model", "olmoe-1b-7b"], ("--load-in-8bit", "--load-in-4bit"))):
        assert main(["train", "--model", "llama-debug", "--load-in-8bit", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_streamer_plan_prints_the_8bit_plan_beside_the_4bit_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--batch", "1", "--seq", "2048", "--lora-rank", "8",
                 "--load-in-8bit", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = PRESETS["llama-3.1-8b"]
    eight = sum(unit_bytes(cfg, u, 2, False, int8=True) for u in cfg.unit_names())
    four = sum(unit_bytes(cfg, u, 2, True) for u in cfg.unit_names())
    assert out["host_store_bytes"] == eight and out["base_4bit"]["host_store_bytes"] == four
    assert four < eight < out["base_16bit"]["host_store_bytes"]
    assert main(["plan", "--model", "llama-3.1-8b", "--batch", "1", "--seq", "2048", "--lora-rank", "8",
                 "--load-in-8bit"]) == 0
    text = capsys.readouterr().out
    assert "8-bit base" in text and "8-bit (LLM.int8 weights) (this plan)" in text
    assert "4-bit nf4 (double quant)" in text


def test_a_folder_transformers_saved_8bit_imports_its_pieces_as_saved(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' own 8-bit folder (quantization_config load_in_8bit; W int8, SCB, weight_format) trains as the
    16-bit folder quantized on import: the same bytes in the store. Other flags are one line naming the right one;
    a projection its llm_int8_skip_modules kept 16-bit is one line too (lm_head, which we keep 16-bit, trains)."""
    import dataclasses

    from tests.test_data_cli import write_tokenizer

    cfg = dataclasses.replace(CFG, vocab_size=448)  # the tokenizer's
    folders = {name: tmp_path / name for name in ("16bit", "8bit", "skip")}
    hf_model(cfg).save_pretrained(folders["16bit"])
    _bnb_model(folders["16bit"], "eager").save_pretrained(folders["8bit"])
    _bnb_model(folders["16bit"], "eager", llm_int8_skip_modules=["lm_head", "q_proj"]).save_pretrained(folders["skip"])
    slabs = []
    for folder in (folders["16bit"], folders["8bit"]):
        with StreamingTrainer.from_pretrained(folder, _settings()) as trainer:
            slabs.append({u: trainer.store.slab(u, "compute").clone() for u in cfg.unit_names()})
        write_tokenizer(folder, "qwen")
    for unit in cfg.unit_names():
        assert torch.equal(slabs[0][unit], slabs[1][unit]), unit
    write_tokenizer(folders["skip"], "qwen")
    (tmp_path / "train.txt").write_text("a few words to train on\n" * 20)
    train = ["train", "--data", str(tmp_path / "train.txt"), "--lora-rank", "4", "--seq", "16", "--steps", "1",
             "--eval-every", "0", "--sample-tokens", "0"]
    capsys.readouterr()
    assert main([*train, "--from-pretrained", str(folders["8bit"]), "--load-in-4bit", "--run-dir",
                 str(tmp_path / "r4")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "8-bit weights: train it with --lora-rank R --load-in-8bit" in err, err
    assert main([*train, "--from-pretrained", str(folders["8bit"]), "--load-in-8bit", "--run-dir",
                 str(tmp_path / "r8")]) == 0
    capsys.readouterr()
    assert main([*train, "--from-pretrained", str(folders["skip"]), "--load-in-8bit", "--run-dir",
                 str(tmp_path / "rs")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "q_proj.weight is saved in 16 bits" in err, err


def test_the_peft_export_loads_on_transformers_8bit_model_with_our_loss(tmp_path: Path, checkpoint: Path) -> None:
    from streamer.cli.export import export_peft

    ids = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with StreamingTrainer.from_pretrained(checkpoint, _settings()) as trainer:
        _adapters(trainer)
        ours = trainer.evaluate(ids)
        export_peft(trainer, tmp_path / "adapter", str(checkpoint))
    losses = []
    for attn in ("eager", "sdpa"):
        model = peft.PeftModel.from_pretrained(_bnb_model(checkpoint, attn), tmp_path / "adapter").train()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        losses.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item())
    noise = abs(losses[0] - losses[1])
    assert abs(ours - losses[0]) <= 2 * noise + 4 * abs(ours) * torch.finfo(torch.float32).eps


def test_an_8bit_run_resumes_and_exports_the_model_it_trained(tmp_path: Path) -> None:
    from streamer.cli.generate import open_trainer
    from streamer.run_dir import RunDir

    run = tmp_path / "run"
    assert main(["train", "--model", "llama-debug", "--lora-rank", "4", "--load-in-8bit", "--run-dir", str(run),
                 "--steps", "2", "--batch", "2", "--seq", "16", "--dtype", "fp32", "--eval-every", "0",
                 "--sample-tokens", "0"]) == 0
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 0
    assert main(["export", str(run), str(tmp_path / "merged")]) == 0
    import safetensors.torch
    merged = safetensors.torch.load_file(tmp_path / "merged" / "model.safetensors")
    with open_trainer(RunDir(run)) as trainer:
        expected = trainer.state_dict()
    assert merged.keys() == expected.keys() and all(torch.equal(merged[k], expected[k]) for k in merged)


def test_an_unread_bitsandbytes_folder_is_one_line(tmp_path: Path, checkpoint: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "odd"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}}))
    (tmp_path / "train.txt").write_text("a few words to train on\n" * 20)
    assert main(["train", "--from-pretrained", str(folder), "--data", str(tmp_path / "train.txt"), "--lora-rank", "4",
                 "--load-in-8bit", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "neither 4-bit nor 8-bit" in err, err
    assert not (tmp_path / "run").exists()
