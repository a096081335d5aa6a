"""QLoRA on every registered family, by registration (as tests/test_families.py parametrizes): the loss and every
adapter's gradient on a 4-bit base (nf4, double quantization) against transformers' 4-bit model (bitsandbytes)
with PEFT's LoRA on every projection, held against the same dequantized model in float64, within twice the 4-bit
model's own fp32 error (its eager and sdpa kernels). A family whose blocks hold fused expert tensors (a mixture
of experts) is refused in one line (tests/test_qlora.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layers import FAMILIES
from streamer import StreamingTrainer, TrainerConfig
from tests.test_families import hf_model
from tests.test_qlora import _bnb_model, _dequantized, _loss_and_grads

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

RANK, ALPHA = 4, 8.0
DENSE = sorted(t for t, cls in FAMILIES.items() if not cls.example().lora().parameters)


def _peft(base: torch.nn.Module, targets: list[str], adapters: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets,
                                                      lora_dropout=0.0))
    assert not peft.set_peft_model_state_dict(model, adapters).unexpected_keys
    return model


def test_the_dense_families_are_held() -> None:
    assert {"gptj", "llama", "phi3", "gemma3_text"} <= set(DENSE)


@pytest.mark.parametrize("model_type", DENSE)
def test_qlora_gradients_equal_transformers_4bit_with_peft(model_type: str, tmp_path: Path) -> None:
    cfg = FAMILIES[model_type].example()
    hf_model(cfg).save_pretrained(tmp_path)
    targets = list(cfg.lora().projections)
    tc = TrainerConfig.of(dtype="fp32", store="ram", lora_rank=RANK, lora_alpha=ALPHA, lora_targets=",".join(targets),
                          load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                          max_grad_norm=0.0)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    prefix = {f"block.{i}": cfg.adapter().prefix(f"block.{i}") for i in range(cfg.num_hidden_layers)}
    with StreamingTrainer.from_pretrained(tmp_path, tc) as trainer:
        torch.manual_seed(5)
        for tensors in trainer.adapters.params.values():
            for t in tensors.values():
                t.data.normal_(0, 0.1)
        adapters = {k: v.clone() for k, v in trainer.adapters.hf_state_dict(prefix).items()}
        seen = {}
        original = trainer.adapters.step

        def capture(lr: float, clip: float) -> None:
            for unit, tensors in trainer.adapters.params.items():
                for key, t in tensors.items():
                    seen[prefix[unit] + key] = t.grad.double().clone()
            original(lr, clip)

        trainer.adapters.step = capture
        loss = trainer.step(ids)
    noisy = [_loss_and_grads(_peft(_bnb_model(tmp_path, "nf4", True, attn), targets, adapters), ids)
             for attn in ("eager", "sdpa")]
    exact_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    loaded = exact_base.load_state_dict(_dequantized(_bnb_model(tmp_path, "nf4", True, "eager")), strict=False)
    # (a tied head's weight is the embedding's)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= set(cfg.adapter().tied_keys())
    exact = _loss_and_grads(_peft(exact_base, targets, {k: v.double() for k, v in adapters.items()}), ids)
    assert set(seen) == set(exact[1]) and len(seen) == 2 * len(targets) * cfg.num_hidden_layers
    assert abs(loss - exact[0]) <= 2 * max(abs(n[0] - exact[0]) for n in noisy) + 1e-6
    for key, grad in exact[1].items():
        assert grad.abs().max() > 0, key
        bound = max((n[1][key] - grad).abs().max().item() for n in noisy)
        assert (seen[key] - grad).abs().max().item() <= 2 * bound + 1e-7, key
