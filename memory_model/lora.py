"""LoRA's settings (`LoraConfig`) and what its adapters add to a step: their parameters and the device bytes
they hold for the whole run (what a frozen block saves is memory_model.shapes.frozen_block_saved_bytes).

With LoRA the base model is frozen: its weights stream in for the forward and again for the backward (which
computes only the gradient w.r.t. each unit's input), and nothing of the base is updated or written. The
adapters (a rank-r pair A: r x in, B: out x r beside each targeted projection of every block, one pair per
expert on a mixture's expert tensor) stay on the device with their gradients and AdamW moments, in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

from layers.config import ModelConfig, lora_targets
from layers.packed4 import QUANT_TYPES, unit_bytes
from layers.packed_gguf import GGUFBase
from memory_model.units import DTYPE_BYTES
from memory_model.settings import Choice, Integer, Number, SettingError, Switch, Text, check_settings, setting, shown

# A block's projections that can carry adapters in some family, by the names Hugging Face and PEFT give them.
LORA_TARGETS = lora_targets()
# fp32 adapter, its gradient, exp_avg and exp_avg_sq.
ADAPTER_WEIGHT_BYTES, ADAPTER_GRAD_BYTES, ADAPTER_MOMENT_BYTES = 4, 4, 8


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on a frozen, streamed base; rank 0 is full fine-tuning (no adapters)."""

    rank: int = setting(0, "LoRA: train rank-R adapters on a frozen base (0: full fine-tuning)", Integer(0), "R")
    alpha: float = setting(16.0, "LoRA: the adapters' output is scaled by alpha / rank", Number(0.0, low_open=True),
                           "A")
    dropout: float = setting(0.0, "LoRA: dropout probability on the adapters' input", Number(0.0, 1.0, high_open=True),
                             "P")
    targets: str = setting("", "LoRA: comma-separated projections of every block that get adapters, among "
                           + ",".join(LORA_TARGETS) + " (none named: the model family's default, PEFT's)", Text(),
                           "NAMES")
    # QLoRA: the frozen base 4-bit, by the names of transformers' BitsAndBytesConfig (their flags keep them).
    load_in_4bit: bool = setting(False, "QLoRA: store, stream and hold the frozen base's block projections 4-bit "
                                        "quantized as bitsandbytes does (blocks of 64), each dequantized for its "
                                        "matmuls", Switch())
    bnb_4bit_quant_type: str = setting("fp4", "--load-in-4bit's code: nf4 or fp4 (BitsAndBytesConfig's default)",
                                       Choice(QUANT_TYPES), "TYPE")
    bnb_4bit_use_double_quant: bool = setting(False, "--load-in-4bit: quantize the absmax of every block of 64 "
                                                     "again (8 bits, blocks of 256)", Switch())
    bnb_4bit_compute_dtype: str = setting("", "--load-in-4bit: dtype of the dequantized weights and their matmuls "
                                              "(default: the run's --dtype)", Choice(("", "fp32", "bf16")), "DTYPE")
    load_in_8bit: bool = setting(False, "store, stream and hold the frozen base's block projections 8-bit as "
                                        "bitsandbytes' Linear8bitLt does (LLM.int8's weights: int8 codes and an "
                                        "fp32 absmax per output row), each dequantized for its matmuls", Switch())
    # A base read from a GGUF file (--from-pretrained FILE.gguf): each weight's type there, kept as its blocks.
    # Not a flag: the file says it.
    gguf: GGUFBase | None = None

    def __post_init__(self) -> None:
        check_settings(self, lambda key, problem: SettingError(key if "bit" in key else f"lora_{key}", problem))
        if self.load_in_4bit and not self.enabled:
            raise SettingError("lora_rank", "must be > 0 with --load-in-4bit: a 4-bit base is frozen and only LoRA's "
                                            "adapters train (full fine-tuning needs the 16-bit base: drop "
                                            "--load-in-4bit)")
        if self.gguf is not None and not self.enabled:
            raise SettingError("lora_rank", "must be > 0 with a GGUF base: its quantized weights are frozen and only "
                                            "LoRA's adapters train (full fine-tuning needs the Hugging Face folder it "
                                            "was made from)")
        if self.gguf is not None and self.load_in_4bit:
            raise SettingError("load_in_4bit", "does not apply to a GGUF base, which keeps its file's own blocks: "
                                               "drop --load-in-4bit")
        if self.load_in_8bit:
            self._check_8bit()
        names = self.target_names
        if len(set(names)) != len(names) or any(n not in LORA_TARGETS for n in names):
            raise SettingError("lora_targets", f"must be distinct names among {','.join(LORA_TARGETS)}, "
                                               f"got {shown(self.targets)}")

    def _check_8bit(self) -> None:
        """An 8-bit base is frozen, alone of the quantized bases, and takes none of the 4-bit settings."""
        if not self.enabled:
            raise SettingError("lora_rank", "must be > 0 with --load-in-8bit: an 8-bit base is frozen and only LoRA's "
                                            "adapters train (full fine-tuning needs the 16-bit base: drop "
                                            "--load-in-8bit)")
        if self.load_in_4bit or self.gguf is not None:
            raise SettingError("load_in_8bit", "does not apply with --load-in-4bit or a GGUF base: choose one "
                                               "quantized base")
        if self.bnb_4bit_compute_dtype or self.bnb_4bit_use_double_quant:
            raise SettingError("load_in_8bit", "takes no --bnb-4bit-* setting (an 8-bit base computes in --dtype "
                                               "and has no double quantization): drop them")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def quantized(self) -> bool:
        """The frozen base's units are byte slabs: 4-bit (--load-in-4bit), 8-bit (--load-in-8bit) or a GGUF file's
        blocks."""
        return self.load_in_4bit or self.load_in_8bit or self.gguf is not None

    @property
    def target_names(self) -> tuple[str, ...]:
        """The projections --lora-targets names; none: the family's default (`targets_of`)."""
        return tuple(n.strip() for n in self.targets.split(",") if n.strip())

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def targets_of(shape: ModelConfig, lora: LoraConfig) -> tuple[str, ...]:
    """The projections the adapters sit on: those --lora-targets names, else the family's default
    (`LoraTargets.defaults`: PEFT's q_proj,v_proj, or phi3's fused qkv_proj)."""
    return lora.target_names or shape.lora().defaults


def target_shape(shape: ModelConfig, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a block projection."""
    return shape.lora().shape(target)


def check_targets(shape: ModelConfig, lora: LoraConfig) -> None:
    """The targets must be projections of this model's family; a weight tensor takes no dropout before its
    adapters (PEFT's ParamWrapper refuses it: the tensor's input is not the adapters' own)."""
    targets = targets_of(shape, lora) if lora.enabled else ()
    projections = shape.lora().projections
    missing = [t for t in targets if t not in projections]
    if missing:
        raise SettingError("lora_targets", f"{','.join(missing)} is not a projection of {shape.model_type}; choose "
                                           f"among {','.join(projections)}")
    fused = [t for t in projections if t in shape.lora().parameters]
    if lora.load_in_8bit and fused:
        raise SettingError("load_in_8bit", f"does not hold {shape.model_type}'s fused expert tensors "
                                           f"({','.join(fused)}; bitsandbytes' 8-bit quantizes Linear modules "
                                           "alone): use --load-in-4bit")
    tensors = [t for t in targets if t in shape.lora().parameters]
    if tensors and lora.dropout > 0:
        raise SettingError("lora_dropout", f"must be 0 with adapters on {','.join(tensors)} (PEFT's LoRA on a weight "
                                           f"tensor takes no dropout), got {lora.dropout}")


def adapter_params(shape: ModelConfig, lora: LoraConfig) -> int:
    """Parameters of every adapter of the model: r x (in + out) per target, expert and block."""
    per_block = sum(lora.rank * sum(target_shape(shape, t)) * shape.lora().experts(t)[0]
                    for t in targets_of(shape, lora))
    return shape.num_hidden_layers * per_block if lora.enabled else 0


def weights_bytes(shape: ModelConfig, lora: LoraConfig, unit: str, compute_bytes: int) -> int:
    """Bytes of a unit's weights load (its own and those it borrows, a tied head's embedding): its parameters in
    the compute dtype, or on a quantized base the units' packed slabs (`base_unit_bytes`), as stored, sent and
    held on the device."""
    if not lora.quantized:
        return shape.params().device(unit) * compute_bytes
    owners = [owner for owner, _ in shape.params().borrowed(unit).values()] + [unit]
    return sum(base_unit_bytes(shape, lora, owner, compute_bytes) for owner in owners)


def dequantized_bytes(shape: ModelConfig, lora: LoraConfig, unit: str, compute_bytes: int) -> int:
    """A quantized base's weight in flight: each projection of a block is dequantized for its matmul (and again
    in its backward), one at a time, into the matmul's dtype (--bnb-4bit-compute-dtype, else the run's). Charged
    as workspace through a block's forward and backward: its largest projection. None elsewhere."""
    if not lora.quantized or not unit.startswith("block."):
        return 0
    es = DTYPE_BYTES[lora.bnb_4bit_compute_dtype] if lora.bnb_4bit_compute_dtype else compute_bytes
    facet = shape.lora()
    return max(fan_in * fan_out for fan_in, fan_out in map(facet.shape, facet.projections)) * es


def base_unit_bytes(shape: ModelConfig, lora: LoraConfig, unit: str, compute_bytes: int) -> int:
    """Bytes of a quantized base's unit slab: 4-bit or 8-bit (layers/packed4.py) or a GGUF file's blocks
    (layers/packed_gguf.py)."""
    if lora.gguf is not None:
        return lora.gguf.unit_bytes(shape, unit, compute_bytes)
    return unit_bytes(shape, unit, compute_bytes, lora.bnb_4bit_use_double_quant, lora.load_in_8bit)
