"""Block-wise 8-bit Adam moments: Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (2021), as
bitsandbytes and torchao's AdamW8bit store them.

Each block of `QUANT_BLOCK` elements is scaled by its absolute maximum and every element is stored as the index
(one byte) of the nearest value of a dynamic map: a non-linear code of 256 values in [-1, 1] (exp_avg, signed)
or [0, 1] (exp_avg_sq, unsigned), dense near zero, as bitsandbytes' `create_dynamic_map` builds it (without its
zero padding, as torchao's). The stored bytes of a range are one record per block, its fp32 scale then its
codes (a partial last block has fewer codes), so any range starting on a block is a contiguous piece of a
slab or of a state file's chunk, and `memory_model.units.stored_bytes` gives its size.

On the CPU one pass per block of C++ (`quant.cpp`, built for this CPU on first use: `streamer.native`) quantizes
and dequantizes; elsewhere, and where that library cannot be built, a compiled loop (`streamer.compiled`) gives
the same bits. tests/test_compiled.py holds the two equal.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from memory_model.units import BLOCK_SCALE_BYTES, QUANT_BLOCK
from streamer import native
from streamer.compiled import kernel
from streamer.store.slabfile import Scratch
from streamer.store.spec import StoreSpec

SCALE_BYTES = BLOCK_SCALE_BYTES["int8"]
RECORD = SCALE_BYTES + QUANT_BLOCK  # one full block's bytes: its scale, then its codes
# torchao's floor on a block's scale: an all-zero block stores code 0.0 under a scale that is not zero.
MIN_SCALE = 1e-12


def dynamic_map(signed: bool) -> list[float]:
    """The 256 sorted values of the dynamic code (bitsandbytes' create_dynamic_map(signed, 7, 8), no padding):
    per decade 10^-6 .. 10^0 a linear fraction of twice as many values as the decade before, plus 0 and 1."""
    data: list[float] = []
    for i in range(7):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        boundaries = torch.linspace(0.1, 1, items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += (10 ** (-6 + i) * means).tolist()  # in fp32, as bitsandbytes computes it
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    return sorted(data)


@functools.lru_cache(maxsize=None)
def _tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The map as fp32; then, indexed by an fp32 value's top 16 bits (as int16, + 2^15), the code below which
    that 16-bit range of values starts (uint8) and the midpoint between it and the next code (+inf past the
    last).

    No 16-bit range of fp32 values holds two midpoints (checked here), so a value's nearest code is its range's
    code, plus one where it reaches the range's next midpoint: two table look-ups and one comparison give the
    codes of a binary search over the midpoints (torch.bucketize) in a sixth of its time on this CPU."""
    qmap = torch.tensor(dynamic_map(signed), dtype=torch.float32)
    mids = (qmap[:-1] + qmap[1:]) / 2
    keys = torch.arange(-2**15, 2**15, dtype=torch.int32)
    low = torch.where(keys < 0, 0xFFFF, 0).to(torch.int32)  # a negative range's lowest value has the most bits
    lowest, highest = ((keys << 16) | low).view(torch.float32), ((keys << 16) | (0xFFFF - low)).view(torch.float32)
    below = torch.bucketize(lowest, mids, right=True)
    spans = torch.bucketize(highest, mids, right=True) - below
    assert spans[~lowest.isnan()].abs().max() <= 1, "a 16-bit range of fp32 values holds two codes' midpoints"
    next_mid = torch.cat([mids, torch.tensor([float("inf")])])[below]
    return qmap.to(device), below.to(torch.uint8).to(device), next_mid.to(device)


@functools.lru_cache(maxsize=None)
def _native_table(signed: bool) -> torch.Tensor:
    """`_tables`' two look-ups in one (int32), as quant.cpp reads it: per 16-bit range of fp32 values, the code
    below which it starts (bits 0-7), whether the next code's midpoint lies inside the range (bit 8), and that
    midpoint's low 16 bits (bits 16-31)."""
    _, below, next_mid = _tables(signed, torch.device("cpu"))
    keys = torch.arange(-2**15, 2**15, dtype=torch.int32)
    bits = next_mid.view(torch.int32)
    inside = ((bits >> 16) == keys) & next_mid.isfinite()
    return below.to(torch.int32) | (inside.to(torch.int32) << 8) | ((bits & 0xFFFF) << 16)


_LIBRARY = native.Library(
    Path(__file__).with_name("quant.cpp"), native.KERNEL_FLAGS,
    {"ws_encode": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int],
     "ws_decode": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]},
    "the int8 moments' C++ kernels", "compiled torch kernels quantize them instead, about half as fast")


def _native(values: torch.Tensor, raw: torch.Tensor) -> ctypes.CDLL | None:
    """quant.cpp's library for fp32 `values` and their stored bytes `raw`, both contiguous on the CPU; else None
    (the compiled kernels)."""
    if values.dtype != torch.float32 or raw.dtype != torch.uint8 or \
            not all(t.device.type == "cpu" and t.is_contiguous() for t in (values, raw)):
        return None
    return _LIBRARY.get()


def _blocks(raw: torch.Tensor, numel: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(first element, elements, codes, scales) of the full blocks of `raw` and of its partial last block, the
    codes (blocks, elements per block) uint8 and the scales (blocks,) fp32, both views of `raw`."""
    full, rest = divmod(numel, QUANT_BLOCK)
    out = []
    if full:
        records = raw[:full * RECORD].view(full, RECORD)
        out.append((0, full * QUANT_BLOCK, records[:, SCALE_BYTES:], records[:, :SCALE_BYTES].view(torch.float32)))
    if rest:
        at = full * RECORD
        scale = raw[at:at + SCALE_BYTES].view(torch.float32).view(1, 1)
        out.append((full * QUANT_BLOCK, rest, raw[at + SCALE_BYTES:].view(1, rest), scale))
    return out


@kernel(static=("below", "next_mid"))
def _encode_blocks(blocks: torch.Tensor, below: torch.Tensor, next_mid: torch.Tensor,
                   codes: torch.Tensor) -> torch.Tensor:
    """Quantize the rows of `blocks` into `codes` (uint8, their shape); returns the rows' scales (fp32)."""
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp(min=MIN_SCALE)
    normed = blocks / scale
    # The nearest code; a value halfway between two rounds up, as torchao's quantize_8bit_with_qmap does.
    key = (normed.view(torch.int32) >> 16) + 2**15
    codes.copy_((below[key].to(torch.int32) + (normed >= next_mid[key]).to(torch.int32)).to(torch.uint8))
    return scale


@kernel(static=("qmap",))
def _decode_blocks(codes: torch.Tensor, scales: torch.Tensor, qmap: torch.Tensor, out: torch.Tensor) -> None:
    """Dequantize `codes` (uint8, one row a block) under their rows' `scales` into `out` (fp32, their shape)."""
    out.copy_(qmap[codes.int()] * scales)


def encode(values: torch.Tensor, signed: bool, out: torch.Tensor) -> torch.Tensor:
    """Quantize fp32 `values` (starting on a block) into `out`, their stored bytes (uint8); returns `out`."""
    library = _native(values, out)
    if library is not None:
        table = _native_table(signed)
        library.ws_encode(values.data_ptr(), values.numel(), QUANT_BLOCK, MIN_SCALE, table.data_ptr(), out.data_ptr(),
                          torch.get_num_threads())
        return out
    _, below, next_mid = _tables(signed, values.device)
    for first, count, codes, scales in _blocks(out, values.numel()):
        # The scales are returned, not written: a compiled kernel cannot write two views of one buffer.
        scales.copy_(_encode_blocks(count, values[first:first + count].view(codes.shape), below, next_mid, codes))
    return out


def decode(raw: torch.Tensor, signed: bool, out: torch.Tensor) -> torch.Tensor:
    """Dequantize the stored bytes `raw` of `out.numel()` elements into `out` (fp32); returns `out`."""
    qmap, _, _ = _tables(signed, raw.device)
    library = _native(out, raw)
    if library is not None:
        library.ws_decode(raw.data_ptr(), out.numel(), QUANT_BLOCK, qmap.data_ptr(), out.data_ptr(),
                          torch.get_num_threads())
        return out
    for first, count, codes, scales in _blocks(raw, out.numel()):
        _decode_blocks(count, codes, scales, qmap, out[first:first + count].view(codes.shape))
    return out


def stored(spec: StoreSpec, kind: str, values: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
    """`values` of `kind` as the store keeps them: cast to its dtype, or quantized (exp_avg signed, exp_avg_sq
    unsigned), in `scratch` where given (host values: the result is valid until its thread's next take). Values
    already in that form (a slab's own piece) pass through."""
    if values.dtype == spec.kind_dtype(kind):
        return values
    nbytes = spec.kind_bytes(kind, values.numel())
    out = scratch.take(nbytes, torch.uint8) if scratch is not None and values.device.type == "cpu" else \
        torch.empty(nbytes, dtype=torch.uint8, device=values.device)
    return stored_into(spec, kind, values, out)


def stored_into(spec: StoreSpec, kind: str, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`values` of `kind` in their stored form, written into the bytes `out` (`spec.kind_bytes` of them, uint8);
    returns them as the store's dtype, a view of `out`."""
    if spec.quantized(kind):
        return encode(values.float(), kind != "exp_avg_sq", out)
    return out.view(spec.kind_dtype(kind)).view(values.shape).copy_(values)


def restored(spec: StoreSpec, kind: str, raw: torch.Tensor, out: torch.Tensor) -> None:
    """The stored piece `raw` of `kind` into `out`, in out's dtype (widened, or dequantized)."""
    if spec.quantized(kind):
        decode(raw, kind != "exp_avg_sq", out)
    else:
        out.copy_(raw)
