"""QLoRA on every registered family, by registration (as tests/test_families.py parametrizes): the loss and every
adapter's gradient on a 4-bit base (nf4, double quantization) against transformers' 4-bit model (bitsandbytes)
with PEFT's LoRA on every projection, held against the same dequantized model in float64, within twice the 4-bit
model's own fp32 error (its eager and sdpa kernels).

A mixture's fused expert tensors are held 4-bit too. transformers 5 quantizes only nn.Linear modules (a
mixture's attention); it leaves the experts' fused tensors and the router in 16 bits. bitsandbytes quantizes such
a parameter whole (`bitsandbytes.nn.parametrize.replace_parameter_4bit`, one quantize_4bit of the tensor), and
PEFT's `target_parameters` adapts it. So the reference's experts are bitsandbytes' quantize_4bit and
dequantize_4bit of each fused tensor, set into transformers' 4-bit model, and its adapters PEFT's on them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layers import FAMILIES
from streamer import StreamingTrainer, TrainerConfig
from tests.test_families import hf_model
from tests.test_qlora import _bnb_model, _dequantized, _loss_and_grads, assert_adamw_steps_within_noise
from tests.test_runtime import EAGER_EXPERTS

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

RANK, ALPHA = 4, 8.0
MIXTURES = sorted(t for t, cls in FAMILIES.items() if cls.example().lora().parameters)


def _peft(base: torch.nn.Module, targets: list[str], tensors: tuple[str, ...],
          adapters: dict[str, torch.Tensor]) -> torch.nn.Module:
    """PEFT's LoRA on `targets`: Linear modules by name, a mixture's fused tensors (`tensors`) as parameters."""
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=[t for t in targets if t not in tensors] or None,
        target_parameters=[t for t in targets if t in tensors] or None, lora_dropout=0.0))
    assert not peft.set_peft_model_state_dict(model, adapters).unexpected_keys
    return model


def _bitsandbytes_experts(model: torch.nn.Module, tensors: tuple[str, ...], quant_type: str = "nf4",
                          double_quant: bool = True) -> torch.nn.Module:
    """`model`'s fused expert tensors as bitsandbytes quantizes (blocks of 64) and
    dequantizes them, in place. Dequantized flat, as ours are (layers.quant4.matrix: bitsandbytes 0.50's CPU
    kernel reads a 3D shape's blocks row by row, wrong where a row is not whole blocks of 64, as here)."""
    names = {t.rsplit(".", 1)[-1] for t in tensors}
    with torch.no_grad():
        for module in model.modules():
            for name in names & set(dict(module.named_parameters(recurse=False))):
                weight = getattr(module, name)
                packed, state = bnb.functional.quantize_4bit(weight.data, blocksize=64,
                                                             compress_statistics=double_quant, quant_type=quant_type)
                state.shape = torch.Size((1, weight.numel()))
                weight.copy_(bnb.functional.dequantize_4bit(packed, state).view(weight.shape))
    return model


def _random_adapters(trainer: StreamingTrainer, prefix: dict[str, str]) -> dict[str, torch.Tensor]:
    """The trainer's adapters set to N(0, 0.1) draws (seed 5), so B is not zero and every gradient flows: a copy,
    by PEFT's keys (each block's under `prefix`)."""
    torch.manual_seed(5)
    for params in trainer.adapters.params.values():
        for t in params.values():
            t.data.normal_(0, 0.1)
    return {k: v.clone() for k, v in trainer.adapters.hf_state_dict(prefix).items()}


def test_the_families_are_held() -> None:
    assert {"gptj", "llama", "phi3", "gemma3_text"} < set(FAMILIES)
    assert {"qwen3_moe", "mixtral", "olmoe"} <= set(MIXTURES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_qlora_gradients_equal_transformers_4bit_with_peft(model_type: str, tmp_path: Path) -> None:
    cfg = FAMILIES[model_type].example()
    hf_model(cfg).save_pretrained(tmp_path)
    targets, tensors = list(cfg.lora().projections), cfg.lora().parameters
    tc = TrainerConfig.of(dtype="fp32", store="ram", lora_rank=RANK, lora_alpha=ALPHA, lora_targets=",".join(targets),
                          load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                          max_grad_norm=0.0)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    prefix = {f"block.{i}": cfg.adapter().prefix(f"block.{i}") for i in range(cfg.num_hidden_layers)}
    with StreamingTrainer.from_pretrained(tmp_path, tc) as trainer:
        adapters = _random_adapters(trainer, prefix)
        seen = {}
        original = trainer.adapters.step

        def capture(lr: float, clip: float) -> None:  # each adapter's gradient under PEFT's key
            for unit, params in trainer.adapters.params.items():
                for keys in trainer.adapters.keys.values():
                    for ours, theirs in ((keys.a, keys.peft_a), (keys.b, keys.peft_b)):
                        seen[prefix[unit] + theirs] = params[ours].grad.double().clone()
            original(lr, clip)

        trainer.adapters.step = capture
        loss = trainer.step(ids)

    def four_bit(attn: str) -> torch.nn.Module:
        return _bitsandbytes_experts(_bnb_model(tmp_path, "nf4", True, attn), tensors)

    noisy = [_loss_and_grads(_peft(four_bit(attn), targets, tensors, adapters), ids) for attn in ("eager", "sdpa")]
    exact_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, **EAGER_EXPERTS)
    loaded = exact_base.load_state_dict(_dequantized(four_bit("eager")), strict=False)
    # (a tied head's weight is the embedding's)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= set(cfg.adapter().tied_keys())
    exact = _loss_and_grads(_peft(exact_base, targets, tensors, {k: v.double() for k, v in adapters.items()}), ids)
    assert set(seen) == set(exact[1]) and len(seen) == 2 * len(targets) * cfg.num_hidden_layers
    assert abs(loss - exact[0]) <= 2 * max(abs(n[0] - exact[0]) for n in noisy) + 1e-6
    for key, grad in exact[1].items():
        assert grad.abs().max() > 0, key
        bound = max((n[1][key] - grad).abs().max().item() for n in noisy)
        assert (seen[key] - grad).abs().max().item() <= 2 * bound + 1e-7, key


@pytest.mark.parametrize("model_type", MIXTURES)
def test_three_streamed_steps_of_a_4bit_mixture_equal_peft_with_adamw(model_type: str, tmp_path: Path) -> None:
    """Three steps (two micro-batches each, clipped, fp4 without double quantization) with adapters on every
    projection, the experts' fused tensors too, against PEFT on the same 4-bit model with torch's AdamW, in
    float64 on its dequantized weights: within twice the 4-bit model's own fp32 noise (eager and sdpa) on them,
    AdamW's amplification of its gradient noise counted element by element (`assert_adamw_steps_within_noise`,
    which says why, by OLMoE's example). (The dense families' three steps: tests/test_qlora.py.)"""
    cfg = FAMILIES[model_type].example()
    hf_model(cfg).save_pretrained(tmp_path)
    targets, tensors = list(cfg.lora().projections), cfg.lora().parameters
    tc = TrainerConfig.of(dtype="fp32", store="ram", lora_rank=RANK, lora_alpha=ALPHA, lora_targets=",".join(targets),
                          load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False, lr=1e-2,
                          max_grad_norm=0.5, weight_decay=0.1, grad_accum=2)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, cfg.vocab_size, (4, 16), generator=g) for _ in range(3)]
    prefix = {f"block.{i}": cfg.adapter().prefix(f"block.{i}") for i in range(cfg.num_hidden_layers)}
    with StreamingTrainer.from_pretrained(tmp_path, tc) as trainer:
        start = _random_adapters(trainer, prefix)
        losses = [trainer.step(ids) for ids in batches]
        ours = {k.replace("base_model.model.", ""): v.double()
                for k, v in trainer.adapters.hf_state_dict(prefix).items()}

    def four_bit(attn: str) -> torch.nn.Module:
        return _bitsandbytes_experts(_bnb_model(tmp_path, "fp4", False, attn), tensors, "fp4", False)

    dequantized = _dequantized(four_bit("eager"))

    def exact_model() -> torch.nn.Module:
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, **EAGER_EXPERTS)
        base.load_state_dict(dequantized, strict=False)
        return _peft(base, targets, tensors, {k: v.double() for k, v in start.items()})

    references = [_peft(four_bit(attn), targets, tensors, start) for attn in ("eager", "sdpa")]
    assert len(ours) == 2 * len(targets) * cfg.num_hidden_layers
    assert_adamw_steps_within_noise(ours, losses, exact_model, references, batches, tc)


@pytest.mark.parametrize("model_type", MIXTURES)
def test_a_4bit_mixture_runs_exports_load_in_peft_and_merge_as_peft_merges(model_type: str, tmp_path: Path) -> None:
    """A 4-bit mixture trained through the CLI (adapters on every projection, the experts' fused tensors too):
    `streamer export --format peft` loads with peft.PeftModel.from_pretrained (target_parameters on the experts)
    onto transformers' 4-bit model of the same folder, its experts as bitsandbytes quantizes a parameter, and gives
    our loss within that model's own fp32 error (eager against sdpa) and fp32's rounding; the merged export, loaded
    by transformers, is PEFT's merge_and_unload of the dequantized model, within twice PEFT's fp32 merge's error
    against its float64 merge and fp32's rounding."""
    import dataclasses

    import torch.nn.functional as F

    from streamer.cli.generate import open_trainer
    from streamer.cli.main import main
    from streamer.run_dir import RunDir
    from tests.test_data_cli import write_tokenizer

    cfg = dataclasses.replace(FAMILIES[model_type].example(), vocab_size=448)
    folder, run = tmp_path / "16bit", tmp_path / "run"
    hf_model(cfg).save_pretrained(folder)
    write_tokenizer(folder, "qwen")
    (tmp_path / "train.txt").write_text("a few words to train on\n" * 20)
    targets, tensors = list(cfg.lora().projections), cfg.lora().parameters
    assert main(["train", "--from-pretrained", str(folder), "--data", str(tmp_path / "train.txt"), "--lora-rank",
                 str(RANK), "--lora-alpha", str(ALPHA), "--lora-targets", ",".join(targets), "--load-in-4bit",
                 "--bnb-4bit-quant-type", "nf4", "--bnb-4bit-use-double-quant", "--seq", "16", "--batch", "2",
                 "--steps", "2", "--lr", "5e-2", "--dtype", "fp32", "--eval-every", "0", "--sample-tokens", "0",
                 "--run-dir", str(run)]) == 0
    assert main(["export", str(run), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    assert main(["export", str(run), str(tmp_path / "merged")]) == 0
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with open_trainer(RunDir(run)) as trainer:
        ours = trainer.evaluate(ids)

    def four_bit(attn: str) -> torch.nn.Module:
        return _bitsandbytes_experts(_bnb_model(folder, "nf4", True, attn), tensors)

    def loss(model: torch.nn.Module) -> float:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()

    # (training mode, as _bnb_model: no dropout, and bitsandbytes keeps its weights as saved)
    losses = [loss(peft.PeftModel.from_pretrained(four_bit(attn), tmp_path / "adapter").train())
              for attn in ("eager", "sdpa")]
    eps = torch.finfo(torch.float32).eps
    tolerance = 2 * abs(losses[0] - losses[1]) + 4 * abs(ours) * eps
    assert abs(ours - losses[0]) <= tolerance < abs(ours - loss(four_bit("eager"))) / 1000  # (the adapters matter)

    dequantized = _dequantized(four_bit("eager"))
    merges = []
    for dtype in (torch.float32, torch.float64):
        base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **EAGER_EXPERTS)
        base.load_state_dict(dequantized, strict=False)
        merged = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
        merges.append({k: v.double() for k, v in merged.state_dict().items()})
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                                 **EAGER_EXPERTS).state_dict()
    assert exported.keys() == merges[1].keys()
    changed = 0
    for key, exact in merges[1].items():
        noise = (merges[0][key] - exact).abs().max().item()
        error = (exported[key].double() - exact).abs().max().item()
        assert error <= 2 * noise + 2 * eps * exact.abs().max().item(), key
        changed += not torch.equal(exact, dequantized.get(key, exact))
    assert changed == len(targets) * cfg.num_hidden_layers  # every target's weight merged


def test_peft_does_not_take_a_mixtures_adapter_on_experts_bitsandbytes_holds_4bit() -> None:
    """What docs/CLI.md says PEFT 0.21 does on experts bitsandbytes holds 4-bit itself (replace_parameter_4bit):
    `target_parameters` as the export writes them (the tensors' last names) match nothing there; by whole names
    they match, but the two tensors' wrappers nest the other way round than on 16-bit experts, so the saved keys
    (gate_up_proj's under base_layer) are another tensor's."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    cfg = FAMILIES["qwen3_moe"].example()
    tensors = list(cfg.lora().parameters)

    def inner(model: torch.nn.Module, targets: list[str]) -> int:
        """The in_features of the wrapper nearest layer 0's experts: which tensor PEFT wrapped first."""
        peft_model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, target_modules=[], target_parameters=targets,
                                                                lora_dropout=0.0))
        return peft_model.base_model.model.model.layers[0].mlp.experts.base_layer.lora_A["default"].in_features

    packed = hf_model(cfg)
    for layer in packed.model.layers:
        for name in ("gate_up_proj", "down_proj"):
            replace_parameter_4bit(layer.mlp.experts, name, compress_statistics=True, quant_type="nf4", blocksize=64)
    with pytest.raises(ValueError, match="target_parameters"):
        inner(packed, tensors)
    whole = [f"model.layers.{i}.mlp.{t}" for i in range(cfg.num_hidden_layers) for t in tensors]
    assert inner(hf_model(cfg), tensors) == cfg.hidden_size  # gate_up_proj's A under base_layer, as exported
    assert inner(packed, whole) == cfg.sparse_mlp.width  # down_proj's
