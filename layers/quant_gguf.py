"""A frozen Linear's weight in a GGUF file's own blocks (llama.cpp's Q4_0 ... Q6_K), dequantized as the `gguf`
package does for each matmul and again in the backward (layers.quant4's Linear4bit runs it).

The weight's pieces (layers.packed_gguf): its rows of blocks as bytes, and one byte naming its type, so one block
shell computes whatever type each unit's weight has. `gguf.quants.dequantize` gives float32, which is cast to the
compute dtype: what transformers' `gguf_file=` loading gives. gguf is imported at the first call: only a run on
a GGUF base needs it. On a device other than the cpu the blocks are dequantized there by torch ops
(`dequantize_blocks`): gguf's own float32 arithmetic, op for op, so its values are gguf's; a type without them
goes through the host's numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from layers.packed_gguf import TYPE_ID_BYTES, TYPE_IDS, TYPE_SIZES, GGUFBase, row_bytes
from layers.quant4 import PieceSpec


@dataclass(frozen=True)
class QuantGGUF:
    """A GGUF base (`base`: each weight's type) whose other tensors and dequantized weights are `dtype`."""

    base: GGUFBase
    dtype: torch.dtype

    def weight_pieces(self, shape: tuple[int, int], hf_key: str | None = None) -> list[PieceSpec]:
        blocks = (0, 0) if hf_key is None else (shape[0], row_bytes(self.base.type_of(hf_key), shape[1]))
        return [("weight", torch.uint8, blocks), ("ggml_type", torch.uint8, (TYPE_ID_BYTES,))]

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        raise ValueError("a GGUF base is read from its file's blocks, never quantized here")

    def dequantize(self, pieces: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """The (out, in) weight in `dtype`: gguf.quants.dequantize of its blocks (on the host; numpy)."""
        blocks = pieces["weight"]
        if blocks.device.type == "meta":
            return torch.empty(shape, dtype=self.dtype, device="meta")
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(int(pieces["ggml_type"][0]))
        if blocks.device.type != "cpu" and qtype.name in DEQUANTIZED_BY_TORCH:
            return dequantize_blocks(blocks, qtype.name).reshape(shape).to(self.dtype)
        values = dequantize(blocks.cpu().numpy(), qtype).reshape(shape)
        return torch.from_numpy(values).to(device=blocks.device, dtype=self.dtype)

    def dequantize_rows(self, pieces: dict[str, torch.Tensor], shape: tuple[int, int], start: int,
                        count: int) -> torch.Tensor:
        """Rows start ... start + count - 1 of the (out, in) weight: only their blocks, dequantized (a GGUF row
        is whole blocks; a fused expert tensor's pieces hold its rows' blocks one after another)."""
        blocks = pieces["weight"].view(-1)
        width = blocks.numel() // shape[0]  # bytes of a row
        return self.dequantize({**pieces, "weight": blocks[start * width:(start + count) * width]}, (count, shape[1]))

    @staticmethod
    def pieces_of(blocks: torch.Tensor, type_name: str) -> dict[str, torch.Tensor]:
        """A weight's pieces from its rows of blocks (uint8, (out, row bytes)) of `type_name`."""
        return {"weight": blocks, "ggml_type": torch.tensor([TYPE_IDS[type_name]], dtype=torch.uint8)}


def _half(pieces: torch.Tensor) -> torch.Tensor:
    """(n, 2) bytes as (n, 1) fp16 values in float32."""
    return pieces.contiguous().view(torch.float16).float()


def _shifted(codes: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """`codes` (n, groups, width) as (n, groups, len(shifts), width): each shift's bits under `mask`."""
    by = torch.tensor(shifts, dtype=torch.uint8, device=codes.device).reshape(1, 1, -1, 1)
    return (codes.unsqueeze(2) >> by) & mask


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins, each (n, 8) (gguf's `Q4_K.get_scale_min`)."""
    d, m, m_d = scales.reshape(-1, 3, 4).unbind(1)
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mins


def _k_quant(blocks: torch.Tensor, high_bits: bool) -> torch.Tensor:
    """Q4_K (`high_bits` False) or Q5_K blocks: d, dmin, scales, (Q5_K: the fifth bits), the low nibbles."""
    n = blocks.shape[0]
    d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
    sc, mins = _k_scales(blocks[:, 4:16])
    scale = (d * sc.float()).reshape(n, -1, 1)
    offset = (dmin * mins.float()).reshape(n, -1, 1)
    qs = blocks[:, 48:] if high_bits else blocks[:, 16:]
    q = _shifted(qs.reshape(n, -1, 32), (0, 4), 0x0F).reshape(n, -1, 32)
    if high_bits:
        q = q | (_shifted(blocks[:, 16:48].reshape(n, -1, 32), tuple(range(8)), 0x01).reshape(n, -1, 32) << 4)
    return (scale * q.float() - offset).reshape(n, -1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], blocks[:, 208:]
    scale = (_half(d) * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _shifted(ql.reshape(n, -1, 64), (0, 4), 0x0F).reshape(n, -1, 32)
    high = _shifted(qh.reshape(n, -1, 32), (0, 2, 4, 6), 0x03).reshape(n, -1, 32)
    q = (low | (high << 4)).view(torch.int8) - 32
    return (scale * q.reshape(n, 16, -1).float()).reshape(n, -1)


def _q4(blocks: torch.Tensor, offset: bool) -> torch.Tensor:
    """Q4_0 (codes less 8) or Q4_1 (plus its min): the first 16 values in the low nibbles, the next 16 high."""
    qs = blocks[:, 4:] if offset else blocks[:, 2:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1)
    if offset:
        return _half(blocks[:, 0:2]) * q.float() + _half(blocks[:, 2:4])
    return _half(blocks[:, 0:2]) * (q.view(torch.int8) - 8).float()


DEQUANTIZERS = {
    "F32": lambda b: b.contiguous().view(torch.float32),
    "F16": lambda b: b.contiguous().view(torch.float16).float(),
    "BF16": lambda b: b.contiguous().view(torch.bfloat16).float(),
    "Q8_0": lambda b: _half(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float(),
    "Q4_0": lambda b: _q4(b, offset=False),
    "Q4_1": lambda b: _q4(b, offset=True),
    "Q4_K": lambda b: _k_quant(b, high_bits=False),
    "Q5_K": lambda b: _k_quant(b, high_bits=True),
    "Q6_K": _q6_k,
}
DEQUANTIZED_BY_TORCH = frozenset(DEQUANTIZERS)


def dequantize_blocks(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """float32 values of GGUF blocks of `type_name` (uint8, any shape of whole blocks), flat, where the blocks lie,
    as `gguf.quants.dequantize` computes them."""
    _, nbytes = TYPE_SIZES[type_name]
    return DEQUANTIZERS[type_name](blocks.reshape(-1, nbytes)).reshape(-1)
