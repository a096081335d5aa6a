"""The trainer's settings: one frozen dataclass each for the run and the learning-rate schedule.

TrainerConfig's keywords are flat. Those of the optimizer are OptimizerConfig's (streamer/runtime/optim.py) and
those of the step PlanConfig's, taken with `same_setting`; the seed and trace cadence are declared here once
with their help text and check (memory_model.settings). RunConfig declares them all again with `same_setting`,
so a flag, a TOML key and a keyword argument are checked alike.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from layers import ModelConfig
from memory_model import DeviceSpec, PlanConfig
from memory_model.shapes import fused_update
from memory_model.devices import budget_bytes
from memory_model.lora import LoraConfig
from memory_model.settings import (
    Choice, Integer, Number, SettingError, check_settings, owned, same_setting, setting,
)
from streamer.errors import ConfigError
from streamer.runtime.hardware import DeviceConfig, check_device, resolve_compute_dtype
from streamer.runtime.optim import OptimizerConfig
from streamer.store.layout import DTYPES, Placement, dtype_name
from streamer.store.spec import StoreSpec


SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LRSchedule:
    """constant, or linear warmup then cosine / linear decay to min_lr_ratio * lr at total_steps."""

    kind: str = setting("constant", "learning-rate schedule after warmup: constant, cosine or linear",
                        Choice(SCHEDULES), "KIND")
    warmup_steps: int = setting(0, "linear warmup steps", Integer(0))
    total_steps: int | None = setting(None, "the step the decay ends at", Integer(0))
    min_lr_ratio: float = setting(0.0, "the cosine/linear schedule ends at this fraction of --lr", Number(0.0, 1.0))

    def __post_init__(self) -> None:
        check_settings(self, ConfigError.of)
        if self.kind != "constant" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ConfigError(f"a {self.kind} schedule needs total_steps > warmup_steps ({self.warmup_steps})")

    def lr_at(self, step: int, base_lr: float) -> float:
        """Learning rate of optimizer step `step` (1-based, as torch counts Adam steps).

        Identical to Hugging Face's schedulers (transformers.get_constant_schedule_with_warmup,
        get_linear_schedule_with_warmup, get_cosine_schedule_with_warmup and, with min_lr_ratio,
        get_cosine_with_min_lr_schedule_with_warmup(min_lr_rate=...)), whose lambda at scheduler index step - 1
        sets the lr of optimizer step `step`: so step 1 of a warmup trains at lr 0. The same float operations in
        the same order make the values bit-equal. HF has no linear schedule with a floor: ours scales the linear
        factor as its cosine does, factor * (1 - min_lr_ratio) + min_lr_ratio, so min_lr_ratio 0 is HF's
        linear exactly (and any ratio is get_polynomial_decay_schedule_with_warmup(power=1, lr_end=ratio * lr)
        up to rounding). Past total_steps the decay stays at its end value.
        """
        current = step - 1
        if current < self.warmup_steps:
            return base_lr * (float(current) / float(max(1, self.warmup_steps)))
        if self.kind == "constant":
            return base_lr * 1.0
        assert self.total_steps is not None
        current = min(current, self.total_steps)
        decay_steps = float(max(1, self.total_steps - self.warmup_steps))
        if self.kind == "cosine":
            progress = float(current - self.warmup_steps) / decay_steps
            factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
        else:
            factor = max(0.0, float(self.total_steps - current) / decay_steps)
        return base_lr * max(0, factor * (1 - self.min_lr_ratio) + self.min_lr_ratio)


@dataclass(frozen=True)
class TrainerConfig:
    lr: float = same_setting(OptimizerConfig, "lr")
    betas: tuple[float, float] = same_setting(OptimizerConfig, "betas")
    eps: float = same_setting(OptimizerConfig, "eps")
    weight_decay: float = same_setting(OptimizerConfig, "weight_decay")
    max_grad_norm: float | None = OptimizerConfig.max_grad_norm  # None: no clipping
    grad_accum: int = same_setting(PlanConfig, "grad_accum")
    compute_dtype: torch.dtype | str = "auto"  # auto: bf16 where the device runs it natively, else fp32
    moment_dtype: str = same_setting(OptimizerConfig, "moment_dtype")
    activations: str = same_setting(PlanConfig, "activations")
    store: str | Placement = "ram"
    update_on: str = same_setting(PlanConfig, "update_on")
    prefetch: int = same_setting(PlanConfig, "prefetch")
    device: str = "cpu"
    pin_memory: str = same_setting(DeviceConfig, "pin_memory")
    budget: None | int | str | DeviceSpec = None
    schedule: LRSchedule = field(default_factory=LRSchedule)
    update_chunk: int = same_setting(PlanConfig, "update_chunk")
    update_timing: str = same_setting(PlanConfig, "update_timing")
    data_parallel: str = same_setting(PlanConfig, "data_parallel")
    nonfinite: str = same_setting(OptimizerConfig, "nonfinite")
    lora_rank: int = same_setting(LoraConfig, "rank")
    lora_alpha: float = same_setting(LoraConfig, "alpha")
    lora_dropout: float = same_setting(LoraConfig, "dropout")
    lora_targets: str = same_setting(LoraConfig, "targets")
    seed: int = setting(0, "seed of the initialisation, the data split and the data order", Integer(0))
    # The trace keeps the latest trace_steps steps and every trace_every-th (0: none), so a long run's memory
    # stays flat: at most steps/N more.
    trace_steps: int = setting(8, "optimizer steps the memory trace keeps (the latest ones)", Integer())
    trace_every: int = setting(0, "also keep every Nth step in the memory trace (N, 2N, ...; 0: only the latest "
                                  "--trace-steps); it then holds at most steps/N + --trace-steps steps", Integer(0),
                               "N")

    def __post_init__(self) -> None:
        check_settings(self, ConfigError.of)
        self.optimizer  # checks max_grad_norm, which no `setting` check covers
        # A malformed device or budget fails here, not at the first step.
        check_device(self.device, self.budget, ConfigError.of, meta=True)
        try:
            self.lora
        except SettingError as exc:
            raise ConfigError.of(exc.key, exc.problem) from None
        if not isinstance(self.schedule, LRSchedule):
            raise ConfigError(f"schedule must be an LRSchedule or its fields, got {self.schedule!r}")
        if isinstance(self.compute_dtype, str) and self.compute_dtype == "auto":
            object.__setattr__(self, "compute_dtype", resolve_compute_dtype(self.device).dtype)
        if isinstance(self.compute_dtype, str):
            if self.compute_dtype not in DTYPES:
                raise ConfigError(f"compute_dtype must be auto or one of {list(DTYPES)}, got {self.compute_dtype!r}")
            object.__setattr__(self, "compute_dtype", DTYPES[self.compute_dtype])
        dtype_name(self.compute_dtype)
        object.__setattr__(self, "store", Placement.of(self.store))
        try:
            fused_update(self.update_timing, self.store.state, 1)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.update_timing == "overlapped":
            raise ConfigError("--update-timing overlapped is planned only (`streamer plan`): the runtime clips by "
                              "the global norm, known only after the backward; use auto, fused or after-backward")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but torch sees no CUDA GPU; use device='cpu'")

    @functools.cached_property
    def optimizer(self) -> OptimizerConfig:
        """The optimizer's settings among the trainer's (computed once: the update reads them per chunk)."""
        return OptimizerConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(OptimizerConfig)})

    @functools.cached_property
    def lora(self) -> LoraConfig:
        """LoRA's settings among the trainer's (rank 0: full fine-tuning)."""
        return LoraConfig(**owned(self, LoraConfig))

    @property
    def budget_bytes(self) -> int | None:
        return budget_bytes(self.budget, ConfigError.of)

    def store_spec(self, model: ModelConfig, processes: int = 1) -> StoreSpec:
        """The layout of the store a trainer with these settings creates for `model`, in each of `processes`
        data-parallel processes (with the state sharded, each holds its slice)."""
        shards = processes if self.data_parallel == "sharded" else 1
        return StoreSpec(model, dtype_name(self.compute_dtype), self.moment_dtype, self.store, self.update_chunk,
                         shards, frozen=self.lora.enabled)

    def replace(self, **changes: Any) -> "TrainerConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["compute_dtype"] = dtype_name(self.compute_dtype)
        out["store"] = self.store.to_dict()
        out["schedule"] = dataclasses.asdict(self.schedule)
        out["betas"] = list(self.betas)
        out["budget"] = self.budget.name if isinstance(self.budget, DeviceSpec) else self.budget
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TrainerConfig":
        raw = dict(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown trainer setting(s) {unknown}; valid: {sorted(known)}")
        for name, kind in (("store", Placement), ("schedule", LRSchedule)):
            if isinstance(raw.get(name), dict):
                try:
                    raw[name] = kind(**raw[name])
                except TypeError as exc:  # an unknown or missing field
                    raise ConfigError(f"{name}: {exc}") from None
        return cls(**raw)
