"""A frozen 4-bit Linear (QLoRA's base), as bitsandbytes' Linear4bit computes it.

The weight is bitsandbytes' packed codes with their statistics (layers.packed4: the pieces and their
bytes). Each call dequantizes it with `bitsandbytes.functional.dequantize_4bit` into the compute dtype, and the
backward dequantizes it again for the input's gradient (bitsandbytes' MatMul4Bit), so autograd saves only the
packed pieces: the runtime packs those as handles of the streamed unit, and no dequantized weight outlives its
matmul. bitsandbytes is imported at the first call: only a 4-bit run needs it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from layers.packed4 import BLOCKSIZE, NESTED_BLOCKSIZE, weight_pieces

PIECE_DTYPES = {"uint8": torch.uint8, "fp32": torch.float32}
PieceSpec = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape) of one piece of a quantized weight


class FrozenQuant(Protocol):
    """How a frozen base holds each block projection's weight: as pieces (`weight_pieces`), made from a 16-bit
    weight (`quantize`) and dequantized for each matmul (`dequantize`); `dtype`, the 16-bit dtype of the unit's
    other tensors and of what dequantizing gives back. bitsandbytes' 4-bit (`Quant4`) and a GGUF file's blocks
    (layers.quant_gguf.QuantGGUF)."""

    @property
    def dtype(self) -> torch.dtype: ...

    def weight_pieces(self, shape: tuple[int, int], hf_key: str | None = None) -> list[PieceSpec]:
        """The pieces of the weight `hf_key` of `shape` (out, in), in slab order; no key: a shell's placeholders
        (the unit's own pieces replace them at each call)."""
        ...

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def dequantize(self, pieces: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor: ...


@dataclass(frozen=True)
class Quant4:
    """How a base is stored: bitsandbytes' quant_type and double quantization; `dtype`, the dtype of the 16-bit
    weights quantized and of the unit's other tensors (what dequantizing gives back, QuantState.dtype)."""

    quant_type: str
    double_quant: bool
    dtype: torch.dtype

    def weight_pieces(self, shape: tuple[int, int], hf_key: str | None = None) -> list[PieceSpec]:
        return [(name, PIECE_DTYPES[dtype], {"weight": (count, 1), "nested_offset": ()}.get(name, (count,)))
                for name, dtype, count in weight_pieces(shape[0] * shape[1], self.double_quant)]

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return quantize(weight, self)

    def dequantize(self, pieces: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        return dequantize(pieces, shape, self)


def quantize(weight: torch.Tensor, quant: Quant4) -> dict[str, torch.Tensor]:
    """bitsandbytes' quantize_4bit of `weight` (in `quant.dtype`), as the pieces `weight_pieces` names."""
    import bitsandbytes.functional as bnb

    packed, state = bnb.quantize_4bit(weight.to(quant.dtype), blocksize=BLOCKSIZE,
                                      compress_statistics=quant.double_quant, quant_type=quant.quant_type)
    pieces = {"weight": packed, "absmax": state.absmax}
    if quant.double_quant:
        pieces.update(nested_absmax=state.state2.absmax, nested_offset=state.offset.reshape(()))
    return pieces


@functools.cache
def _codes(quant_type: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit code's 16 values and the nested statistics' signed dynamic 8-bit map (bitsandbytes' own)."""
    import bitsandbytes.functional as bnb

    return bnb.get_4bit_type(quant_type, device=device), bnb.create_dynamic_map(signed=True).to(device)


def dequantize(pieces: dict[str, torch.Tensor], shape: tuple[int, int], quant: Quant4) -> torch.Tensor:
    """The (out, in) weight in `quant.dtype` from its pieces, by bitsandbytes' dequantize_4bit."""
    weight = pieces["weight"]
    if weight.device.type == "meta":
        return torch.empty(shape, dtype=quant.dtype, device="meta")
    import bitsandbytes.functional as bnb

    code, nested_code = _codes(quant.quant_type, weight.device)
    nested = None
    if quant.double_quant:
        nested = bnb.QuantState(absmax=pieces["nested_absmax"], code=nested_code, blocksize=NESTED_BLOCKSIZE,
                                dtype=torch.float32)
    state = bnb.QuantState(absmax=pieces["absmax"], shape=torch.Size(shape), code=code, blocksize=BLOCKSIZE,
                           quant_type=quant.quant_type, dtype=quant.dtype,
                           offset=pieces.get("nested_offset"), state2=nested)
    return bnb.dequantize_4bit(weight, state)


class _Matmul4bit(torch.autograd.Function):
    """x W^T + b with W dequantized in the forward and again in the backward; W and b take no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, shape: tuple[int, int], quant: FrozenQuant,
                names: tuple[str, ...], *pieces: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.quant, ctx.names = shape, quant, names
        ctx.save_for_backward(*pieces)
        weight = quant.dequantize(dict(zip(names, pieces, strict=True)), shape).to(x.dtype)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x = None
        if ctx.needs_input_grad[0]:
            pieces = dict(zip(ctx.names, ctx.saved_tensors, strict=True))
            weight = ctx.quant.dequantize(pieces, ctx.shape).to(grad.dtype)
            grad_x = grad @ weight
        return (grad_x, None, None, None, None, *(None for _ in ctx.names))


class Linear4bit(nn.Module):
    """A frozen Linear whose weight is held quantized (`quant`'s pieces, all buffers: for 4-bit `weight` (the
    packed codes), `absmax` and, with double quantization, `nested_absmax` and `nested_offset`); `bias` in the
    16-bit dtype. Its matmul runs in `compute_dtype` (BitsAndBytesConfig's bnb_4bit_compute_dtype)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: FrozenQuant,
                 compute_dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.quant = in_features, out_features, quant
        self.compute_dtype = compute_dtype
        self.weight: torch.Tensor  # a buffer, registered below
        pieces = quant.weight_pieces((out_features, in_features))
        for name, dtype, shape in pieces:
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=quant.dtype, device=device),
                                 requires_grad=False) if bias else None
        self.names = tuple(name for name, _, _ in pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # the matmul in the compute dtype, its output back in x's (bitsandbytes' Linear4bit)
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = _Matmul4bit.apply(x, bias, (self.out_features, self.in_features), self.quant, self.names,
                                *(getattr(self, name) for name in self.names))
        return out.to(dtype)


def quantize_linears(module: nn.Module, quant: FrozenQuant, compute_dtype: torch.dtype) -> nn.Module:
    """Replace every nn.Linear of `module` by a Linear4bit of its shape (a shell: its tensors come from the
    caller, functional_call's); returns `module`."""
    for name, child in list(module.named_modules()):
        if type(child) is nn.Linear:
            parent = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            setattr(parent, name.rsplit(".", 1)[-1], Linear4bit(child.in_features, child.out_features,
                                                                child.bias is not None, quant, compute_dtype,
                                                                child.weight.device))
    return module
