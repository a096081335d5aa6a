"""The trainer's settings (`TrainerConfig`): a tree of its owners' configs.

Each branch is the config of the code that reads it: the step's (`memory_model.step.StepConfig`, the store's
placement and the dtypes, `Precision`, with it, which the planner takes too), the optimizer's and its
learning-rate schedule (`OptimizerConfig`, `LRSchedule`), LoRA's (`LoraConfig`), the objective's
(`ObjectiveConfig`: sft or dpo) and the device's (`DeviceConfig`). The seed and the trace cadence are the
trainer's own. Every setting keeps one flat name, its flag and TOML key
(memory_model.settings.branch). `TrainerConfig.of(lr=1e-3, store="disk")` builds the tree from them, and
`to_dict`/`from_dict` write and read them in a store's manifest.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from layers import ModelConfig
from layers.packed_gguf import GGUFBase
from memory_model import PlanConfig
from memory_model.devices import DeviceSpec
from memory_model.lora import LoraConfig
from memory_model.objective import ObjectiveConfig, with_method_defaults
from memory_model.settings import Integer, SettingError, branch, build, check_settings, flatten, setting
from memory_model.shapes import check_norm_first
from memory_model.step import Placement, StepConfig
from memory_model.units import Precision
from streamer.errors import ConfigError
from streamer.runtime.hardware import DeviceConfig, resolve_compute_dtype
from streamer.runtime.optim import LRSchedule, OptimizerConfig
from streamer.store.layout import DTYPES
from streamer.store.spec import StoreSpec


@dataclass(frozen=True)
class TrainerConfig:
    """The trainer's settings as its owners' configs. Every one has a flat name: `of` and `replace` take them."""

    step: StepConfig = branch(StepConfig)
    optimizer: OptimizerConfig = branch(OptimizerConfig)
    schedule: LRSchedule = branch(LRSchedule, names={"kind": "schedule", "warmup_steps": "warmup"})
    # rank 0: full fine-tuning; the quantized base's settings keep transformers' names (`--load-in-4bit`)
    lora: LoraConfig = branch(LoraConfig, prefix="lora_", names={k: k for k in (
        "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype")})
    objective: ObjectiveConfig = branch(ObjectiveConfig)  # sft, or dpo and its beta, loss type, label smoothing
    device: DeviceConfig = branch(DeviceConfig)
    seed: int = setting(0, "seed of the initialisation, the data split and the data order", Integer(0))
    # The trace keeps the latest trace_steps steps and every trace_every-th (0: none), so a long run's memory
    # stays flat: at most steps/N more.
    trace_steps: int = setting(8, "optimizer steps the memory trace keeps (the latest ones)", Integer())
    trace_every: int = setting(0, "also keep every Nth step in the memory trace (N, 2N, ...; 0: only the latest "
                                  "--trace-steps); it then holds at most steps/N + --trace-steps steps", Integer(0),
                               "N")

    def __post_init__(self) -> None:
        check_settings(self, ConfigError.of)
        try:
            fused = self.step.fused(1, self.lora.enabled)
            check_norm_first(self.step.clipped_steps, fused, self.step.grad_accum)
        except SettingError as exc:
            raise ConfigError.of(exc.key, exc.problem) from None
        if self.lora.quantized and self.step.data_parallel == "sharded":
            # A quantized unit is one byte slab of pieces: each process keeps it whole.
            raise ConfigError.of("data_parallel", "must be replicated with --load-in-4bit, --load-in-8bit or a GGUF "
                                                  "base (each process holds the quantized base whole), got sharded")

    @classmethod
    def of(cls, **flat: Any) -> "TrainerConfig":
        """The settings from their flat names (the flags'), each else its default: `of(lr=1e-3, grad_accum=2)`."""
        return build(cls, with_method_defaults(flat, "sft"), error=ConfigError.of)

    def replace(self, **flat: Any) -> "TrainerConfig":
        """These settings with some changed, by flat name: `tc.replace(max_grad_norm=0)`."""
        return build(type(self), with_method_defaults(flat, self.objective.method), self, ConfigError.of)

    @functools.cached_property
    def precision(self) -> Precision:
        """The run's dtypes (`StepConfig.precision`), --dtype `auto` resolved for the device (bf16 where it runs
        natively): what the planner, the store and the runtime take."""
        precision = self.step.precision
        if precision.resolved:
            return precision
        return replace(precision, compute=resolve_compute_dtype(self.device.device).dtype)

    @functools.cached_property
    def resolved_step(self) -> StepConfig:
        """The step's settings in the resolved precision: `step` itself where --dtype names one."""
        return self.step if self.step.precision is self.precision else replace(self.step, precision=self.precision)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The torch dtype the run computes in (`precision`'s)."""
        return DTYPES[self.precision.compute]

    def plan_config(self, batch: int, seq: int, devices: int = 1, packed: bool = False,
                    source_dtype: str = "fp32") -> PlanConfig:
        """The planner's view of a step of `batch` sequences of `seq` tokens with these settings, on `devices`
        data-parallel devices (`packed`: rows of packed examples), in the resolved compute dtype; `source_dtype`:
        the dtype of the weights the run starts from (PlanConfig's)."""
        return PlanConfig(batch, seq, self.resolved_step, devices, packed=packed, lora=self.lora,
                          source_dtype=source_dtype, objective=self.objective)

    def store_spec(self, model: ModelConfig, processes: int = 1) -> StoreSpec:
        """The layout of the store a trainer with these settings creates for `model`, in each of `processes`
        data-parallel processes (with the state sharded, each holds its slice)."""
        return StoreSpec(model, self.precision, self.step.store, self.step.update_chunk, self.step.shards(processes),
                         frozen=self.lora.enabled,
                         quant_type="gguf" if self.lora.gguf else "int8" if self.lora.load_in_8bit else
                         self.lora.bnb_4bit_quant_type if self.lora.load_in_4bit else "",
                         double_quant=self.lora.load_in_4bit and self.lora.bnb_4bit_use_double_quant,
                         gguf_types=self.lora.gguf.types if self.lora.gguf else ())

    def on_base(self, base: GGUFBase, error: Callable[[str, str], Exception] = ConfigError.of) -> "TrainerConfig":
        """These settings on a GGUF file's frozen base (`streamer.io.gguf`): its block projections kept as the
        file's blocks, LoRA training beside them. Settings that cannot train it raise `error(setting, problem)`."""
        try:
            return replace(self, lora=replace(self.lora, gguf=base))
        except SettingError as exc:
            raise error(exc.key, exc.problem) from None

    def to_dict(self) -> dict[str, Any]:
        """The settings by flat name as JSON values, the compute dtype resolved (a resumed run keeps it)."""
        out = flatten(self)
        out.update(dtype=self.precision.compute, store=self.step.store.to_dict(), betas=list(out["betas"]),
                   set=list(out["set"]))
        if isinstance(out["budget"], DeviceSpec):
            out["budget"] = out["budget"].name
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TrainerConfig":
        """`to_dict`'s settings, or those a store committed before the settings nested: flat, with
        `compute_dtype`, the schedule as a table and None for no clipping."""
        raw = dict(raw)
        if "compute_dtype" in raw:
            raw["dtype"] = raw.pop("compute_dtype")
        if isinstance(raw.get("schedule"), dict):
            old = raw.pop("schedule")
            names = {"kind": "schedule", "warmup_steps": "warmup", "total_steps": "total_steps",
                     "min_lr_ratio": "min_lr_ratio"}
            unknown = sorted(set(old) - set(names))
            if unknown:
                raise ConfigError(f"schedule: unknown field(s) {unknown}; valid: {sorted(names)}")
            raw.update({names[k]: v for k, v in old.items()})
        if "max_grad_norm" in raw and raw["max_grad_norm"] is None:
            raw["max_grad_norm"] = 0.0
        if isinstance(raw.get("store"), dict):
            try:
                raw["store"] = Placement(**raw["store"])
            except TypeError as exc:  # an unknown or missing field
                raise ConfigError(f"store: {exc}") from None
            except SettingError as exc:
                raise ConfigError.of(exc.key, exc.problem) from None
        return build(cls, raw, error=ConfigError.of)
