"""LoRA: a frozen projection plus a trainable low-rank update, as PEFT's lora.Linear computes it.

y = x W^T + b + scaling * B(A(dropout(x))), with A: (r, in) and B: (out, r). The adapters' keys inside a unit,
`attn.q_proj.lora_A.weight`, are PEFT's own (its saved adapters prefix them with `base_model.model.` and the
unit's Hugging Face prefix).

A module holding fused expert weights (E, out, in) adapts them itself (`adaptable`, `adapt`: a mixture's
`Experts`), as PEFT's ParamWrapper does: expert e's weight is W_e + scaling * B_e A_e, the pairs kept in one
A: (r E, in) and one B: (out, r E), with no dropout.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from layers.quant4 import Linear4bit


class _Adapters(nn.Module):
    """The adapters `lora_A.weight` and `lora_B.weight` of a frozen projection, and its output with them."""

    def _adapters(self, in_features: int, out_features: int, rank: int, scaling: float, dropout: float) -> None:
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        self.scaling, self.dropout = scaling, dropout

    def _adapted(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """base + scaling * B A x. B's matmul scales its product and adds base itself (addmm), so neither the
        forward nor the backward makes a (tokens, out) tensor for the product or its scaling."""
        x = F.dropout(x, self.dropout) if self.dropout > 0 and self.training else x
        # The adapters arrive in x's dtype (the runtime casts its fp32 adapters before the call).
        h = F.linear(x, self.lora_A.weight)
        out = torch.addmm(base.flatten(0, -2), h.flatten(0, -2), self.lora_B.weight.t(), alpha=self.scaling)
        return out.view(base.shape)


class LoraLinear(nn.Linear, _Adapters):
    """nn.Linear (same `weight` and `bias`) with adapters `lora_A.weight` and `lora_B.weight` beside it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, scaling: float,
                 dropout: float) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._adapters(in_features, out_features, rank, scaling, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._adapted(x, F.linear(x, self.weight, self.bias))


class LoraLinear4bit(Linear4bit, _Adapters):
    """A 4-bit frozen projection (its packed pieces and bias) with adapters beside it, as PEFT's
    lora.Linear4bit: the adapters see the input as it came, in its own dtype."""

    def __init__(self, base: Linear4bit, rank: int, scaling: float, dropout: float) -> None:
        super().__init__(base.in_features, base.out_features, base.bias is not None, base.quant,
                         base.compute_dtype, base.weight.device)
        self._adapters(base.in_features, base.out_features, rank, scaling, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._adapted(x, super().forward(x))


def add_adapters(module: nn.Module, targets: tuple[str, ...], rank: int, scaling: float, dropout: float) -> nn.Module:
    """Replace every nn.Linear of `module` named in `targets` (its last name: 'q_proj') by a LoraLinear with
    the same weight and bias and new adapters on their device and dtype, and adapt each weight tensor named
    there (its module's last name and its own: 'experts.down_proj'); a 4-bit projection (layers.quant4) becomes
    a LoraLinear4bit; returns `module`."""
    for name, child in list(module.named_modules()):
        for tensor in getattr(child, "adaptable", ()):
            if f"{name.rsplit('.', 1)[-1]}.{tensor}" in targets:
                child.adapt(tensor, rank, scaling)
        if name.rsplit(".", 1)[-1] not in targets or isinstance(child, _Adapters):
            continue
        parent = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        if isinstance(child, Linear4bit):  # a 4-bit shell's projection: its pieces come from the caller
            with torch.device(child.weight.device):
                setattr(parent, name.rsplit(".", 1)[-1], LoraLinear4bit(child, rank, scaling, dropout))
        elif isinstance(child, nn.Linear):
            with torch.device(child.weight.device):
                lora = LoraLinear(child.in_features, child.out_features, child.bias is not None, rank, scaling,
                                  dropout).to(child.weight.dtype)
            lora.weight, lora.bias = child.weight, child.bias  # the projection itself, kept
            setattr(parent, name.rsplit(".", 1)[-1], lora)
    return module


def expert_factors(a: torch.Tensor, b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's A_e (E, r, in) and B_e (E, out, r), views of PEFT's ParamWrapper layout: A (r E, in) holds
    expert e's rows e r ... e r + r - 1, B (out, r E) its columns e, E + e, 2 E + e, ..."""
    return a.view(experts, -1, a.shape[-1]), b.view(b.shape[0], -1, experts).permute(2, 0, 1)


def delta_weight(a: torch.Tensor, b: torch.Tensor, experts: int, scaling: float) -> torch.Tensor:
    """scaling * B_e A_e of every expert, (E, out, in); of a projection (one expert), scaling * B A as (1, out, in)."""
    a_e, b_e = expert_factors(a, b, experts)
    return scaling * torch.bmm(b_e, a_e)


def init_adapters(a: torch.Tensor, b: torch.Tensor) -> None:
    """PEFT's default initialisation: A as nn.Linear's (kaiming uniform, a = sqrt(5)), B zero, so a new
    adapter leaves the model's output unchanged."""
    nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    nn.init.zeros_(b)
