"""A frozen Linear's weight in a GGUF file's own blocks (llama.cpp's Q4_0 ... Q6_K), dequantized as the `gguf`
package does for each matmul and again in the backward (layers.quant4's Linear4bit runs it).

The weight's pieces (layers.packed_gguf): its rows of blocks as bytes, and one byte naming its type, so one block
shell computes whatever type each unit's weight has. `gguf.quants.dequantize` gives float32, which is cast to the
compute dtype: what transformers' `gguf_file=` loading gives. gguf is imported at the first call: only a run on
a GGUF base needs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from layers.packed_gguf import TYPE_ID_BYTES, TYPE_IDS, GGUFBase, row_bytes
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
        values = dequantize(blocks.cpu().numpy(), qtype).reshape(shape)
        return torch.from_numpy(values).to(device=blocks.device, dtype=self.dtype)

    @staticmethod
    def pieces_of(blocks: torch.Tensor, type_name: str) -> dict[str, torch.Tensor]:
        """A weight's pieces from its rows of blocks (uint8, (out, row bytes)) of `type_name`."""
        return {"weight": blocks, "ggml_type": torch.tensor([TYPE_IDS[type_name]], dtype=torch.uint8)}
