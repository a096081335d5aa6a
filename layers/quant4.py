"""A frozen 4-bit or 8-bit Linear (QLoRA's base), as bitsandbytes' Linear4bit and Linear8bitLt compute it.

The weight is bitsandbytes' packed codes with their statistics (layers.packed4: the pieces and their
bytes). Each call dequantizes it with `bitsandbytes.functional.dequantize_4bit` into the compute dtype, and the
backward dequantizes it again for the input's gradient (bitsandbytes' MatMul4Bit), so autograd saves only the
packed pieces: the runtime packs those as handles of the streamed unit, and no dequantized weight outlives its
matmul. Within a block's pass each is dequantized into the pass's one buffer (`dequantized_into`), not a tensor of
its own. bitsandbytes is imported at the first call: only a 4-bit run needs it.

An 8-bit weight (`Quant8`) is dequantized as bitsandbytes' Linear8bitLt does in training mode on the CPU
(MatMul8bitFp): its int8 codes times each row's absmax / 127, then one matmul, forward and backward. bitsandbytes'
CUDA kernel differs: it quantizes the activations too, and keeps their outlier columns (`llm_int8_threshold`)
in 16 bits (docs/MODELS.md).
"""
from __future__ import annotations

import ctypes
import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from layers.packed4 import BLOCKSIZE, NESTED_BLOCKSIZE, QUANTIZE_CHUNK, int8_pieces, weight_pieces

PIECE_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "fp32": torch.float32}
PieceSpec = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape) of one piece of a quantized weight


class FrozenQuant(Protocol):
    """How a frozen base holds each block projection's weight: as pieces (`weight_pieces`), made from a 16-bit
    weight (`quantize`) and dequantized for each matmul (`dequantize`); `dtype`, the 16-bit dtype of the unit's
    other tensors and of what dequantizing gives back. bitsandbytes' 4-bit (`Quant4`) and 8-bit (`Quant8`), and a
    GGUF file's blocks (layers.quant_gguf.QuantGGUF)."""

    @property
    def dtype(self) -> torch.dtype: ...

    def weight_pieces(self, shape: tuple[int, int], hf_key: str | None = None) -> list[PieceSpec]:
        """The pieces of the weight `hf_key` of `shape` (out, in), in slab order; no key: a shell's placeholders
        (the unit's own pieces replace them at each call)."""
        ...

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def dequantize(self, pieces: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor: ...

    def dequantize_rows(self, pieces: dict[str, torch.Tensor], shape: tuple[int, int], start: int,
                        count: int) -> torch.Tensor:
        """Rows start ... start + count - 1 of the (out, in) weight, as `dequantize` gives them (one expert of a
        fused expert tensor)."""
        ...


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

    def dequantize_rows(self, pieces: dict[str, torch.Tensor], shape: tuple[int, int], start: int,
                        count: int) -> torch.Tensor:
        """Rows start ... start + count - 1 of the (out, in) weight `pieces` hold, as `dequantize` gives them,
        dequantizing only the blocks (and nested blocks) they lie in: one expert of a fused expert tensor."""
        columns = shape[1]
        if pieces["weight"].device.type == "meta":
            return torch.empty(count, columns, dtype=self.dtype, device="meta")
        import bitsandbytes.functional as bnb

        first, end = start * columns, (start + count) * columns  # elements
        b0, b1 = first // BLOCKSIZE, -(-end // BLOCKSIZE)  # the blocks they lie in
        absmax = pieces["absmax"][b0:b1]
        code, nested_code = _codes(self.quant_type, absmax.device)
        if self.double_quant:  # the absmax of those blocks from their nested blocks, as dequantize_4bit does
            n0, n1 = b0 // NESTED_BLOCKSIZE, -(-b1 // NESTED_BLOCKSIZE)
            nested = bnb.QuantState(absmax=pieces["nested_absmax"][n0:n1], code=nested_code,
                                    blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
            codes = pieces["absmax"][n0 * NESTED_BLOCKSIZE:n1 * NESTED_BLOCKSIZE]
            absmax = bnb.dequantize_blockwise(codes, nested)[b0 - n0 * NESTED_BLOCKSIZE:b1 - n0 * NESTED_BLOCKSIZE]
            absmax += pieces["nested_offset"]
        whole = min(b1 * BLOCKSIZE, shape[0] * columns) - b0 * BLOCKSIZE  # the blocks' elements
        packed = pieces["weight"].view(-1)[b0 * BLOCKSIZE // 2:b0 * BLOCKSIZE // 2 + -(-whole // 2)]
        # As one row, as `matrix` gives a fused tensor (bitsandbytes 0.50's CPU kernel makes a 1D shape one too).
        state = bnb.QuantState(absmax=absmax, shape=torch.Size((1, whole)), code=code, blocksize=BLOCKSIZE,
                               quant_type=self.quant_type, dtype=self.dtype)
        values = bnb.dequantize_4bit(packed, state).view(-1)
        return values[first - b0 * BLOCKSIZE:end - b0 * BLOCKSIZE].view(count, columns)


@dataclass(frozen=True)
class Quant8:
    """A base held 8-bit as bitsandbytes' Linear8bitLt holds it (has_fp16_weights=False): each weight's int8 codes
    (`weight`) and each output row's absmax (`SCB`, fp32); `dtype`, the unit's other tensors' and what
    dequantizing gives back (Linear8bitLt computes in its input's dtype, the run's)."""

    dtype: torch.dtype

    def weight_pieces(self, shape: tuple[int, int], hf_key: str | None = None) -> list[PieceSpec]:
        return [(name, PIECE_DTYPES[dtype], shape if name == "weight" else (count,))
                for name, dtype, count in int8_pieces(*shape)]

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """bitsandbytes' int8_vectorwise_quant of `weight` cast to float16 first, as Int8Params quantizes it (and
        transformers' load_in_8bit with it). Each row is quantized by its own absmax, so it runs on whole rows of
        about `QUANTIZE_CHUNK` elements at a time, its kernel's working set bounded as 4-bit's is."""
        import bitsandbytes.functional as bnb

        rows = max(1, QUANTIZE_CHUNK // weight.shape[1])
        codes = torch.empty(weight.shape, dtype=torch.int8)
        absmax = torch.empty(weight.shape[0], dtype=torch.float32)
        for start in range(0, weight.shape[0], rows):
            part = slice(start, start + rows)
            codes[part], absmax[part], _ = bnb.int8_vectorwise_quant(weight[part].to(torch.float16))
        return {"weight": codes, "SCB": absmax}

    def dequantize(self, pieces: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """The codes in `dtype` times each row's absmax / 127, in MatMul8bitFp's order (the scale made in fp32
        first, the product rounded once to `dtype`)."""
        return pieces["weight"].to(self.dtype).mul_(pieces["SCB"].unsqueeze(1).mul(1.0 / 127.0))

    def dequantize_rows(self, pieces: dict[str, torch.Tensor], shape: tuple[int, int], start: int,
                        count: int) -> torch.Tensor:
        """Rows start ... start + count - 1, as `dequantize` gives them: each row has its own scale."""
        rows = slice(start, start + count)
        return self.dequantize({"weight": pieces["weight"][rows], "SCB": pieces["SCB"][rows]}, (count, shape[1]))


def matrix(shape: Sequence[int]) -> tuple[int, int]:
    """The 2D shape a quantized weight is dequantized as: a Linear's (out, in), as bitsandbytes' Linear4bit
    passes it; a fused expert tensor's (E, out, in) as one row of all its elements, the blocks quantize_4bit
    made of them flat. (bitsandbytes 0.50's CPU dequantize_4bit reads a 2D shape's blocks row by row: where a
    row is not whole blocks of 64, as in the tests' tiny models, its 3D result is not its own quantize_4bit's.)"""
    return (shape[0], shape[1]) if len(shape) == 2 else (1, math.prod(shape))


def piece_key(key: str, piece: str) -> str:
    """The key of a quantized weight's piece in its unit: the weight's own key for its packed codes, beside it for
    the rest ('attn.q_proj.weight' -> 'attn.q_proj.absmax'; a fused tensor 'mlp.experts.down_proj' ->
    'mlp.experts.down_proj_absmax')."""
    if piece == "weight":
        return key
    return f"{key.removesuffix('.weight')}.{piece}" if key.endswith(".weight") else f"{key}_{piece}"


def quantized_keys(module: nn.Module, projections: Iterable[str]) -> list[str]:
    """The keys of `module`'s weights a quantized base holds quantized: each nn.Linear's whose name is a
    projection's last name ('q_proj'), and each fused tensor named by its module's last name and its own
    ('experts.down_proj', a module's `adaptable`). Not a mixture's router, which transformers keeps in 16 bits."""
    names = set(projections)
    keys = []
    for name, child in module.named_modules():
        last = name.rsplit(".", 1)[-1]
        if type(child) is nn.Linear and last in names:
            keys.append(f"{name}.weight")
        keys += [f"{name}.{tensor}" for tensor in getattr(child, "adaptable", ()) if f"{last}.{tensor}" in names]
    return keys


def quantize(weight: torch.Tensor, quant: Quant4) -> dict[str, torch.Tensor]:
    """bitsandbytes' quantize_4bit of `weight` (in `quant.dtype`), as the pieces `weight_pieces` names. Made
    `QUANTIZE_CHUNK` elements at a time, so its kernel's working set is bounded (whole, it held 16 bytes an element
    of the weight: 0.9 GiB for Llama-3.1-8B's MLP projections); each block's codes and absmax are its own, and
    the double quantization of the absmax (less their mean, in nested blocks) is quantize_4bit's, made once."""
    import bitsandbytes.functional as bnb

    flat = weight.reshape(-1)
    packed, absmax = [], []
    for start in range(0, flat.numel(), QUANTIZE_CHUNK):
        codes, state = bnb.quantize_4bit(flat[start:start + QUANTIZE_CHUNK].to(quant.dtype), blocksize=BLOCKSIZE,
                                         compress_statistics=False, quant_type=quant.quant_type)
        packed.append(codes)
        absmax.append(state.absmax)
    pieces = {"weight": torch.cat(packed), "absmax": torch.cat(absmax)}
    if quant.double_quant:
        offset = pieces["absmax"].mean()
        nested_codes, nested = bnb.quantize_blockwise(pieces["absmax"] - offset, blocksize=NESTED_BLOCKSIZE)
        pieces.update(absmax=nested_codes, nested_absmax=nested.absmax, nested_offset=offset.reshape(()))
    return pieces


@functools.cache
def _codes(quant_type: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit code's 16 values and the nested statistics' signed dynamic 8-bit map (bitsandbytes' own)."""
    import bitsandbytes.functional as bnb

    return bnb.get_4bit_type(quant_type, device=device), bnb.create_dynamic_map(signed=True).to(device)


def dequantize(pieces: dict[str, torch.Tensor], shape: tuple[int, int], quant: Quant4,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The (out, in) weight in `quant.dtype` from its pieces, by bitsandbytes' dequantize_4bit; into `out` where
    given (of that shape and dtype, on the pieces' device)."""
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
    if out is None:
        return bnb.dequantize_4bit(weight, state)
    if out.device.type != "cpu":
        return bnb.dequantize_4bit(weight, state, out=out)
    if not _native_cpu_kernel(shape):
        return out.copy_(bnb.dequantize_4bit(weight, state))
    absmax = pieces["absmax"]
    if quant.double_quant:  # the blocks' absmax from their nested statistics, as dequantize_4bit makes them
        absmax = bnb.dequantize_blockwise(absmax, nested)
        absmax += pieces["nested_offset"]
    _cpu_dequantize_4bit(weight, absmax.float(), quant.quant_type, out)
    return out


def _native_cpu_kernel(shape: tuple[int, int]) -> bool:
    """Whether bitsandbytes' CPU dequantize_4bit runs its native kernel on a weight of `shape`: its library loaded
    and an even row (its own fallback computes the rest in torch)."""
    from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib

    return not isinstance(lib, ErrorHandlerMockBNBNativeLibrary) and shape[-1] % 2 == 0


def _cpu_dequantize_4bit(packed: torch.Tensor, absmax: torch.Tensor, quant_type: str, out: torch.Tensor) -> None:
    """bitsandbytes' native CPU kernel, as its dequantize_4bit calls it, writing into `out`: bitsandbytes 0.50
    has no CPU kernel for dequantize_4bit's out= form, and each fresh weight it returns is mapped and faulted
    in anew (the CLI fixes glibc's mmap threshold)."""
    from bitsandbytes.cextension import lib

    rows, columns = out.shape
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[out.dtype]
    kernel = getattr(lib, f"cdequantize_blockwise_cpu_{quant_type}_{name}")
    kernel(ctypes.c_void_p(packed.contiguous().data_ptr()), ctypes.c_void_p(absmax.contiguous().data_ptr()),
           ctypes.c_void_p(out.data_ptr()), ctypes.c_longlong(BLOCKSIZE), ctypes.c_longlong(rows),
           ctypes.c_longlong(columns))


# The buffer a block's pass dequantizes its 4-bit weights into (`dequantized_into`). A list, not a thread's own:
# an accelerator's autograd runs the backward on a thread of its own.
_IN_FLIGHT: list[torch.Tensor] = []


@contextmanager
def dequantized_into(buffer: torch.Tensor) -> Iterator[None]:
    """While the context lasts, each 4-bit weight a matmul dequantizes is written into `buffer` (flat bytes, as
    large as the largest), not into a fresh tensor: one weight is in flight at a time, its matmul done before the
    next is dequantized (the forward and backward of `_Matmul4bit` keep none)."""
    _IN_FLIGHT.append(buffer)
    try:
        yield
    finally:
        _IN_FLIGHT.pop()


def _weight(quant: FrozenQuant, pieces: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """A matmul's weight, dequantized into the buffer in flight where there is one that holds it (4-bit)."""
    buffer = _IN_FLIGHT[-1] if _IN_FLIGHT else None
    device = pieces["weight"].device
    if not isinstance(quant, Quant4) or buffer is None or buffer.device != device:
        return quant.dequantize(pieces, shape)
    nbytes = math.prod(shape) * quant.dtype.itemsize
    if nbytes > buffer.numel():
        return quant.dequantize(pieces, shape)
    return dequantize(pieces, shape, quant, buffer[:nbytes].view(quant.dtype).view(shape))


class _Matmul4bit(torch.autograd.Function):
    """x W^T + b with W dequantized in the forward and again in the backward; W and b take no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, shape: tuple[int, int], quant: FrozenQuant,
                names: tuple[str, ...], *pieces: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.quant, ctx.names = shape, quant, names
        ctx.save_for_backward(*pieces)
        weight = _weight(quant, dict(zip(names, pieces, strict=True)), shape).to(x.dtype)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x = None
        if ctx.needs_input_grad[0]:
            pieces = dict(zip(ctx.names, ctx.saved_tensors, strict=True))
            weight = _weight(ctx.quant, pieces, ctx.shape).to(grad.dtype)
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


@runtime_checkable
class HoldsQuantized(Protocol):
    """A module holding fused weight tensors (`adaptable`) that holds one quantized when asked: a mixture's
    experts (layers.moe.units.Experts)."""

    def hold_quantized(self, name: str, quant: FrozenQuant, compute_dtype: torch.dtype) -> None: ...


def quantize_linears(module: nn.Module, quant: FrozenQuant, compute_dtype: torch.dtype,
                     projections: Iterable[str]) -> nn.Module:
    """Hold each weight `quantized_keys` names quantized: an nn.Linear becomes a Linear4bit of its shape, a fused
    tensor its module's quantized pieces (`hold_quantized`, a mixture's experts); a shell: its tensors come from
    the caller, functional_call's. Returns `module`."""
    for key in quantized_keys(module, projections):
        name, _, tensor = key.rpartition(".")
        child = module.get_submodule(name)
        if tensor != "weight":  # a fused tensor of a module that holds it quantized itself
            assert isinstance(child, HoldsQuantized)  # (quantized_keys names a fused tensor of such a module)
            child.hold_quantized(tensor, quant, compute_dtype)
            continue
        parent = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        assert isinstance(child, nn.Linear)  # (quantized_keys names a Linear's weight)
        setattr(parent, name.rsplit(".", 1)[-1], Linear4bit(child.in_features, child.out_features,
                                                            child.bias is not None, quant, compute_dtype,
                                                            child.weight.device))
    return module
