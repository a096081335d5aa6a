"""Byte sizes as users write them ("3GiB", "40GB") and as people read them; the bytes of each dtype."""
from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

from memory_model.settings import Choice, check_settings, setting

# Bytes per element of every dtype the runtime stores, computes or exports in, by the names users write.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
# Block-wise quantized dtypes (int8 Adam moments, as in Dettmers et al., "8-bit Optimizers via Block-wise
# Quantization", and torchao's AdamW8bit): each block of QUANT_BLOCK elements also stores one fp32 absmax scale.
QUANT_BLOCK = 256
BLOCK_SCALE_BYTES = {"int8": 4}
# The dtypes a step computes in (fp16 only exports: its range needs loss scaling, which the runtime lacks).
COMPUTE_DTYPES = ("bf16", "fp32")
DTYPE_CHOICES = ("auto", *COMPUTE_DTYPES)  # auto: the device's (streamer.runtime.hardware.resolve_compute_dtype)
MOMENT_DTYPES = ("fp32", "bf16", "int8")
MASTER_DTYPES = ("fp32", "bf16")


def stored_bytes(dtype: str, numel: int) -> int:
    """Bytes `numel` elements of `dtype` take where they are stored: a quantized dtype's codes and the scale of
    every block they start (a partial last block has one too). The one rule the store's layout, the planner
    and the disk counts use."""
    return numel * DTYPE_BYTES[dtype] + -(-numel // QUANT_BLOCK) * BLOCK_SCALE_BYTES.get(dtype, 0)


@dataclass(frozen=True)
class Precision:
    """One run's dtypes, by the names users write: the compute weights', the master weights' and the Adam
    moments'. The step's settings nest it (`StepConfig.precision`, flags --dtype, --master-dtype and
    --moment-dtype); the planner, the runtime, the optimizer and the store (`StoreSpec.precision`) each take it
    whole, and ask it the one rule that depends on these dtypes alone. `compute` may be `auto` only as a setting:
    what runs resolves it for its device first (`TrainerConfig.precision`)."""

    compute: str = setting("auto", "compute dtype: auto (bf16 where the hardware runs it natively and at least as "
                                   "fast as fp32, else fp32; config.toml records the choice), bf16 or fp32",
                           Choice(DTYPE_CHOICES), "DTYPE")
    master: str = setting(
        "fp32", "dtype of the master weights in the store: fp32 (exact AdamW), or bf16 (half the bytes; AdamW runs "
                "on them widened to fp32 and each update is stochastically rounded back, so small updates are kept "
                "on average; with --dtype bf16 the master is also the compute weights)", Choice(MASTER_DTYPES),
        "DTYPE")
    moments: str = setting(
        "fp32", "dtype of the Adam moments in the store: fp32, bf16 (half the bytes), or int8 (block-wise quantized "
                "as in 8-bit Adam: 1 byte each and an fp32 scale per 256; AdamW runs on them dequantized to fp32)",
        Choice(MOMENT_DTYPES), "DTYPE")

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def resolved(self) -> bool:
        """The compute dtype is a real one (not `auto`): a step can be laid out and priced in it."""
        return self.compute in COMPUTE_DTYPES

    def compute_is_master(self, frozen: bool) -> bool:
        """The compute weights are the master weights themselves (one dtype): the store keeps no second copy. A
        frozen base (LoRA) has no master: its compute weights are all it stores. The one rule the store, the
        runtime and the planner use."""
        return self.compute == self.master and not frozen


# Decimal (SI) and binary (IEC) units are both common in budgets; "GB" and "GiB" differ by 7%, so both
# spellings are kept exact instead of guessing what a bare "G" means.
_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_ACCEPTED = "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


class SizeError(ValueError):
    """A byte size that cannot be read; the message lists the accepted units."""


def parse_size(value: int | str) -> int:
    """'3GiB' -> 3221225472, '3GB' -> 3000000000, '512' -> 512; an int passes through.

    Fractions are allowed ('1.5GiB') and rounded to the nearest byte.
    """
    if isinstance(value, bool):
        raise SizeError(f"a size must be an integer number of bytes or a string like '3GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"a size cannot be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise SizeError(f"a size must be an integer number of bytes or a string like '3GiB', got {value!r}")
    match = _SIZE.match(value)
    if match is None:
        raise SizeError(f"cannot read {value!r} as a size; write a non-negative number and a unit: {_ACCEPTED}")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower() if unit else "b")
    if factor is None:
        raise SizeError(f"unknown unit {unit!r} in {value!r}; accepted units: {_ACCEPTED}")
    try:
        scaled = Decimal(number) * factor
    except InvalidOperation:
        raise SizeError(f"cannot read {value!r} as a size; accepted units: {_ACCEPTED}") from None
    return int(scaled.to_integral_value(rounding=ROUND_HALF_EVEN))


def format_size(nbytes: int | float) -> str:
    """Binary units, about three significant figures: 1536 -> '1.50 KiB'."""
    size = float(nbytes)
    sign = "-" if size < 0 else ""
    size = abs(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    if unit == "B":
        return f"{sign}{int(size)} B"
    return f"{sign}{size:.0f} {unit}" if size >= 100 else f"{sign}{size:.2f} {unit}"
