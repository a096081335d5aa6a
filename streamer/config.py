"""The trainer's settings: one frozen dataclass each for the run and the learning-rate schedule."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from memory_model import DEVICE_PRESETS, DeviceSpec, parse_size
from streamer.errors import StreamerError
from streamer.runtime.hardware import resolve_compute_dtype
from streamer.store.layout import DTYPES, Placement, dtype_name


class ConfigError(StreamerError):
    """Trainer settings that cannot run; the message names the fix."""


def _require(name: str, value: Any, kind: str, optional: bool = False) -> None:
    """`kind`: "int" (not a bool) or "number" (finite int or float, not a bool); a wrong type is a ConfigError."""
    if optional and value is None:
        return
    ok = not isinstance(value, bool) and (
        isinstance(value, int) if kind == "int" else isinstance(value, (int, float)) and math.isfinite(value))
    if not ok:
        raise ConfigError(f"{name} must be {'an integer' if kind == 'int' else 'a finite number'}, got {value!r}")


@dataclass(frozen=True)
class LRSchedule:
    """constant, or linear warmup then cosine / linear decay to min_lr_ratio * lr at total_steps."""

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        _require("warmup_steps", self.warmup_steps, "int")
        _require("total_steps", self.total_steps, "int", optional=True)
        _require("min_lr_ratio", self.min_lr_ratio, "number")
        if self.kind not in ("constant", "cosine", "linear"):
            raise ConfigError(f"schedule must be 'constant', 'cosine' or 'linear', got {self.kind!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.kind != "constant" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ConfigError(f"a {self.kind} schedule needs total_steps > warmup_steps ({self.warmup_steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

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
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0
    grad_accum: int = 1
    compute_dtype: torch.dtype | str = "auto"  # auto: bf16 where the device runs it natively, else fp32
    moment_dtype: str = "fp32"
    activations: str = "resident"
    store: str | Placement = "ram"
    update_on: str = "device"
    prefetch: int = 1
    device: str = "cpu"
    budget: None | int | str | DeviceSpec = None
    schedule: LRSchedule = field(default_factory=LRSchedule)
    update_chunk: int = 16 * 2**20
    nonfinite: str = "stop"
    seed: int = 0
    trace_steps: int = 8  # the trace keeps this many recent steps, so a long run's memory stays flat
    trace_every: int = 0  # ... and every Nth step (0: none): at most steps/N more, still flat per step

    def __post_init__(self) -> None:
        for name in ("lr", "eps", "weight_decay"):
            _require(name, getattr(self, name), "number")
        _require("max_grad_norm", self.max_grad_norm, "number", optional=True)
        for name in ("grad_accum", "update_chunk", "prefetch", "seed", "trace_steps", "trace_every"):
            _require(name, getattr(self, name), "int")
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        for beta in self.betas:
            _require("betas", beta, "number")
        if not isinstance(self.device, str):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
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
        choices = {"activations": ("resident", "checkpoint"), "update_on": ("device", "host"),
                   "nonfinite": ("stop", "skip"), "moment_dtype": ("fp32", "bf16")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr must be a positive number, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ConfigError("eps must be > 0 and weight_decay >= 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm must be > 0 or None (no clipping), got {self.max_grad_norm}")
        for name in ("grad_accum", "update_chunk", "trace_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.trace_every < 0:
            raise ConfigError(f"trace_every must be an integer >= 0 (0: off), got {self.trace_every!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ConfigError(f"prefetch must be an integer >= 0, got {self.prefetch!r}")
        if self.device.split(":")[0] not in ("cpu", "cuda", "meta"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but torch sees no CUDA GPU; use device='cpu'")
        self.budget_bytes  # a malformed budget fails here, not at the first step

    @property
    def budget_bytes(self) -> int | None:
        if self.budget is None:
            return None
        if isinstance(self.budget, DeviceSpec):
            return self.budget.memory_bytes
        if isinstance(self.budget, str) and self.budget in DEVICE_PRESETS:  # a preset saved by name
            return DEVICE_PRESETS[self.budget].memory_bytes
        try:
            return parse_size(self.budget)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

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
        if isinstance(raw.get("betas"), list):
            raw["betas"] = tuple(raw["betas"])
        return cls(**raw)
