"""A 4-bit or 8-bit frozen base (QLoRA), as bitsandbytes packs it: the pieces and bytes of every unit, torch-free
(the planner prices them; layers/quant4.py computes with them).

With `--load-in-4bit` every projection of a block (a mixture's fused expert tensors too) is stored, streamed and
held on the device as bitsandbytes' `quantize_4bit` gives it (blocks of 64): two 4-bit codes a byte, and one fp32
absmax per block. With double quantization the absmax values are themselves 8-bit codes of (absmax - their mean),
with one fp32 absmax per 256 of them and that mean (bitsandbytes' nested state). Everything else (norms, biases,
a mixture's router, the embedding, the head) stays in the compute dtype, as transformers leaves it. A unit is one
byte slab: its 16-bit tensors first, then each quantized weight's pieces, each piece starting on `ALIGN` bytes.
`streamer.store.layout` lays the slab out with these pieces and the planner prices it with `unit_bytes`: the one
rule for both.

With `--load-in-8bit` each projection is held as bitsandbytes' Linear8bitLt holds it (LLM.int8's weights,
`int8_vectorwise_quant`): one int8 code per weight and, per output row, its absmax (`SCB`, fp32). A mixture's fused
expert tensors are not Linear modules, which bitsandbytes' 8-bit does not quantize: an 8-bit base refuses them.
"""
from __future__ import annotations

from layers.config import ModelConfig

BLOCKSIZE = 64  # bitsandbytes' default for 4-bit weights (transformers' BitsAndBytesConfig)
# Elements of a weight quantized at once (whole blocks; layers/quant4.py), and the bytes bitsandbytes' kernel
# holds per element while it works: the 16-bit input, an fp32 copy, the scaled values and their int32 codes.
QUANTIZE_CHUNK = 2**20
QUANTIZE_BYTES_PER_ELEMENT = 16
NESTED_BLOCKSIZE = 256  # the double quantization of the absmax values
ALIGN = 16  # every piece starts on 16 bytes: its fp32 views, and vector loads, need no unaligned access
QUANT_TYPES = ("nf4", "fp4")


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def weight_pieces(numel: int, double_quant: bool) -> list[tuple[str, str, int]]:
    """(name, dtype, count) of each piece of one quantized weight of `numel` elements, in slab order: the packed
    codes (bitsandbytes' (numel / 2, 1) uint8), the absmax per block, and with double quantization the nested
    absmax per 256 blocks and their offset (the mean subtracted before quantizing)."""
    blocks = -(-numel // BLOCKSIZE)
    pieces = [("weight", "uint8", -(-numel // 2))]
    if not double_quant:
        return pieces + [("absmax", "fp32", blocks)]
    return pieces + [("absmax", "uint8", blocks), ("nested_absmax", "fp32", -(-blocks // NESTED_BLOCKSIZE)),
                     ("nested_offset", "fp32", 1)]


def int8_pieces(rows: int, columns: int) -> list[tuple[str, str, int]]:
    """(name, dtype, count) of each piece of one 8-bit weight of (rows, columns), in slab order: its int8 codes,
    row-major as Linear8bitLt's `weight`, and each row's absmax (its `SCB`)."""
    return [("weight", "int8", rows * columns), ("SCB", "fp32", rows)]


PIECE_BYTES = {"uint8": 1, "int8": 1, "fp32": 4}


def weight_bytes(numel: int, double_quant: bool, rows: int | None = None) -> int:
    """Bytes one quantized weight takes in its unit's slab, each piece padded to `ALIGN`; `rows`: an 8-bit weight's
    output rows (4-bit: None)."""
    pieces = weight_pieces(numel, double_quant) if rows is None else int8_pieces(rows, numel // rows)
    return sum(padded(count * PIECE_BYTES[dtype]) for _, dtype, count in pieces)


def quantized_shapes(shape: ModelConfig, unit: str) -> list[tuple[int, int, int]]:
    """(experts, out, in) of each weight of the unit that is quantized (`quantized_numels`); experts is 1 for a
    Linear's."""
    if not unit.startswith("block."):
        return []
    facet = shape.lora()
    shapes = []
    for target in facet.projections:
        fan_in, fan_out = facet.shape(target)
        shapes.append((facet.experts(target)[0], fan_out, fan_in))
    return shapes


def quantized_numels(shape: ModelConfig, unit: str) -> list[int]:
    """Elements of each weight of the unit that is quantized: a block's projections, a mixture's fused expert
    tensors whole (one quantize_4bit of all its experts, as bitsandbytes' `replace_parameter_4bit` quantizes a
    parameter); none in the embedding or the head (transformers keeps lm_head in 16 bits), nor a mixture's router
    (transformers' own module, not a Linear, which it leaves in 16 bits)."""
    return [experts * rows * columns for experts, rows, columns in quantized_shapes(shape, unit)]


def unit_bytes(shape: ModelConfig, unit: str, compute_bytes: int, double_quant: bool, int8: bool = False) -> int:
    """Bytes of a unit's slab in a 4-bit (`int8`: 8-bit) store (what it holds on the host, crosses the link and
    holds on the device): its other tensors in the compute dtype, padded to `ALIGN`, then each quantized weight."""
    quantized = quantized_shapes(shape, unit)
    rest = shape.params().own(unit) - sum(quantized_numels(shape, unit))
    return padded(rest * compute_bytes) + sum(weight_bytes(e * r * c, double_quant, e * r if int8 else None)
                                              for e, r, c in quantized)
