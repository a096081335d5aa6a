"""Helpers shared by the test files."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pytest
import torch

from layers import GPTJConfig

if TYPE_CHECKING:
    import transformers


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Overwrite every parameter with seeded noise of roughly unit-activation scale.

    HF's init leaves biases at zero, LayerNorms at identity and matrices at std 0.02,
    which makes attention almost uniform: a parity test on such weights could not see
    a wrong bias, LayerNorm affine or rotary.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("wte.weight"):  # unit scale: every block normalises it with ln_1
                p.copy_(noise)
            elif p.ndim == 2:  # Linear (out, in): fan-in scaling keeps activations near unit size
                p.copy_(noise / p.shape[1] ** 0.5)
            elif name.endswith("weight"):  # LayerNorm gain
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)


@pytest.fixture(scope="session")
def tiny_hf_model() -> Callable[..., "transformers.GPTJForCausalLM"]:
    """Factory: `tiny_hf_model(cfg, seed=0)` -> HF GPTJForCausalLM (eager attention, eval mode, random weights)."""
    import transformers  # imported here so that test files without HF do not pay for it

    def build(cfg: GPTJConfig, seed: int = 0) -> transformers.GPTJForCausalLM:
        hf_cfg = transformers.GPTJConfig(**cfg.to_hf(), attn_implementation="eager")
        model = transformers.GPTJForCausalLM(hf_cfg).eval()
        randomize_(model, seed)
        return model

    return build
