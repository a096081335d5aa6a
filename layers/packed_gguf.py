"""A frozen base read from a GGUF file, as llama.cpp packs it: the pieces and bytes of every unit, torch-free (the
planner prices them; layers/quant_gguf.py computes with them).

Each block projection's weight stays in the file's own type (`GGUFBase.types`, by its Hugging Face key): rows of
blocks, each block `TYPE_SIZES[type]` = (elements, bytes), as gguf's GGML_QUANT_SIZES. Beside it one byte holds the
type's id (`TYPE_IDS`, GGMLQuantizationType), so the blocks of one shell compute whatever type each unit holds.
Everything else (norms, biases, the embedding, the head) is dequantized on import into the compute dtype, as
transformers loads it. A unit's slab is laid out as a 4-bit one (layers/packed4.py): its 16-bit tensors first,
then each weight's pieces, each on `ALIGN` bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from layers.config import ModelConfig
from layers.packed4 import padded, quantized_numels

# The types whose blocks a GGUF base keeps, each (elements, bytes) per block and its GGMLQuantizationType id.
TYPE_SIZES = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34),
              "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}
TYPE_ID_BYTES = 1  # the piece naming a weight's type


def row_bytes(type_name: str, columns: int) -> int:
    """Bytes of one row of `columns` values in blocks of `type_name` (whole blocks: GGUF rows hold whole ones)."""
    elements, nbytes = TYPE_SIZES[type_name]
    return columns // elements * nbytes


@dataclass(frozen=True)
class GGUFBase:
    """Which type each block projection's weight has in the GGUF file it came from, by Hugging Face key."""

    types: tuple[tuple[str, str], ...]

    def type_of(self, hf_key: str) -> str:
        return dict(self.types)[hf_key]

    def weight_bytes(self, hf_key: str, shape: tuple[int, int]) -> int:
        """Bytes one weight (out, in) takes in its unit's slab: its blocks and its type's id, each padded."""
        return padded(shape[0] * row_bytes(self.type_of(hf_key), shape[1])) + padded(TYPE_ID_BYTES)

    def unit_bytes(self, shape: ModelConfig, unit: str, compute_bytes: int) -> int:
        """Bytes of a unit's slab in a GGUF store (held on the host, sent over the link and held on the device):
        its other tensors in the compute dtype, padded, then each projection's blocks."""
        rest = shape.params().own(unit) - sum(quantized_numels(shape, unit))
        if not unit.startswith("block."):
            return padded(rest * compute_bytes)
        return padded(rest * compute_bytes) + sum(self.weight_bytes(key, rows) for key, rows in kept(shape, unit))


def kept(shape: ModelConfig, unit: str) -> list[tuple[str, tuple[int, int]]]:
    """The Hugging Face key and (rows, columns) of each weight of a block kept as the file's blocks: each
    projection's Linear weight, and a mixture's fused expert tensors (E x out rows, the experts' one after
    another)."""
    lora, out = shape.lora(), []
    for target, module in lora.projections.items():
        fan_in, fan_out = lora.shape(target)
        key = shape.adapter().key(unit, module if target in lora.parameters else f"{module}.weight")
        out.append((key, (fan_out * lora.experts(target)[0], fan_in)))
    return out
