"""A training run's settings (`RunConfig`: the flags of `streamer train`, the keys of run.toml and of a run
folder's config.toml; the folder itself is streamer/run_dir.py).

Settings resolve in this order, later winning: RunConfig's defaults, the demo's defaults (only when nothing
names a model or data: `streamer train` alone is the demo), the `--config` TOML file, the flags. TOML is read
with tomllib and written here as flat `key = value` lines; a setting that is None is left out (TOML has no
null), and paths are written absolute so that a run can be resumed from any working directory.
"""
from __future__ import annotations

import contextlib
import json
import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterator

from layers import PRESETS, ConfigError, ModelConfig
from memory_model import COMPUTE_DTYPES, PlanConfig
from memory_model.devices import budget_bytes
from memory_model.lora import LoraConfig, check_targets
from memory_model.settings import SettingError as BaseSettingError
from memory_model.settings import (
    Choice, Integer, Number, Text, check_settings, checks_of, owned, same_setting, setting,
)
from streamer.config import LRSchedule, TrainerConfig
from streamer.errors import StreamerError
from streamer.io.data import DataConfig
from streamer.reporting import ReportConfig
from streamer.runtime.hardware import DeviceConfig
from streamer.runtime.optim import OptimizerConfig
from streamer.store.spec import StoreSpec


class RunError(StreamerError):
    """Run settings or a run directory that cannot be used; the message names the fix."""


class SettingError(RunError, BaseSettingError):
    """One run setting's value is wrong: `key` names it, so an error can say where it came from (flag or file)."""

    def __init__(self, key: str, problem: str) -> None:
        BaseSettingError.__init__(self, key, problem)


DEMO_MODEL = "gptj-demo"
DEFAULT_PROMPT = "The for statement is used to"


@dataclass(frozen=True)
class Settings:
    """A run's settings as the tree of their owners' configs, each checked by its owner: what the planner
    (`step`), the optimizer, the learning-rate schedule, the device, the data and the store are given.
    `RunConfig.tree()` builds it; RunConfig itself stays flat because the flags and TOML keys are."""

    model: ModelConfig
    step: PlanConfig
    optimizer: OptimizerConfig
    schedule: LRSchedule
    device: DeviceConfig
    data: DataConfig
    store: StoreSpec


@dataclass(frozen=True)
class RunConfig:
    """`streamer train`'s settings, flat (each is a flag and a TOML key). Those of the step (PlanConfig), the
    optimizer (OptimizerConfig), the device (DeviceConfig), the data (DataConfig), the trainer (TrainerConfig)
    and the schedule (LRSchedule) are declared by their owners: `same_setting`; `tree()` gives them back as
    the owners' configs."""

    model: str = setting(DEMO_MODEL, "a preset (%s) or a config.json to initialise randomly" % ", ".join(PRESETS),
                         Text(), "PRESET|CONFIG")
    from_pretrained: str | None = setting(None, "a Hugging Face folder to fine-tune (its weights and tokenizer): "
                                                "GPT-J, Llama, Mistral, Qwen2 or Qwen3", Text(), "HF_DIR")
    data: str | None = same_setting(DataConfig, "data")
    tokenizer: str | None = same_setting(DataConfig, "tokenizer")
    vocab_size: int | None = same_setting(DataConfig, "vocab_size")
    run_dir: str | None = setting(None, "the run directory; one holding this run (same settings) is continued "
                                        "(default: runs/<name>-<time>)", Text(), "DIR")
    steps: int = setting(100, "optimizer steps in all (with --resume: the new total)", Integer())
    batch: int = same_setting(PlanConfig, "batch", 8)
    seq: int = setting(128, "tokens per sequence (default: 128, or a preset's context if shorter)", Integer(2))
    grad_accum: int = same_setting(PlanConfig, "grad_accum")
    lr: float = same_setting(OptimizerConfig, "lr")
    schedule: str = same_setting(LRSchedule, "kind")
    warmup: int = same_setting(LRSchedule, "warmup_steps")
    min_lr_ratio: float = same_setting(LRSchedule, "min_lr_ratio")
    weight_decay: float = same_setting(OptimizerConfig, "weight_decay")
    max_grad_norm: float = setting(1.0, "clip gradients to this global norm (0: no clipping)", Number(0.0))
    betas: tuple[float, float] = same_setting(OptimizerConfig, "betas")
    eps: float = same_setting(OptimizerConfig, "eps")
    moment_dtype: str = same_setting(OptimizerConfig, "moment_dtype")
    nonfinite: str = same_setting(OptimizerConfig, "nonfinite")
    lora_rank: int = same_setting(LoraConfig, "rank")
    lora_alpha: float = same_setting(LoraConfig, "alpha")
    lora_dropout: float = same_setting(LoraConfig, "dropout")
    lora_targets: str = same_setting(LoraConfig, "targets")
    trace_steps: int = same_setting(TrainerConfig, "trace_steps")
    trace_every: int = same_setting(TrainerConfig, "trace_every")
    dtype: str = same_setting(DeviceConfig, "dtype")
    device: str = same_setting(DeviceConfig, "device")
    budget: str | None = same_setting(DeviceConfig, "budget")
    set: tuple[str, ...] = same_setting(DeviceConfig, "set")
    pin_memory: str = same_setting(DeviceConfig, "pin_memory")
    store: str = same_setting(PlanConfig, "store", "disk")
    activations: str = same_setting(PlanConfig, "activations")
    update_on: str = same_setting(PlanConfig, "update_on")
    prefetch: int = same_setting(PlanConfig, "prefetch")
    update_chunk: int = same_setting(PlanConfig, "update_chunk")
    update_timing: str = same_setting(PlanConfig, "update_timing")
    data_parallel: str = same_setting(PlanConfig, "data_parallel")
    seed: int = same_setting(TrainerConfig, "seed")
    pack: str | None = same_setting(DataConfig, "pack")
    eval_fraction: float = same_setting(DataConfig, "eval_fraction")
    eval_data: str | None = same_setting(DataConfig, "eval_data")
    chat_template: str | None = same_setting(DataConfig, "chat_template")
    eval_every: int = setting(50, "evaluate before the first step and every N steps (0: only at the end)", Integer(0))
    eval_batches: int = setting(4, "held-out batches per evaluation", Integer())
    save_every: int = setting(50, "with --store ram: write the store to disk every N steps (and at the end)",
                              Integer())
    sample_prompt: str | None = setting(None, "prompt of the sample generated at the end (default: with --data, "
                                              "the first example's prompt or first words; else %r)"
                                        % DEFAULT_PROMPT.replace("%", "%%"), Text(), "TEXT")
    sample_tokens: int = setting(40, "tokens of that sample (0: no sample)", Integer(0))
    report_to: str = same_setting(ReportConfig, "report_to")
    log_every: int = setting(1, "when stdout is not a terminal (a log, a pipe): one progress line every N steps "
                                "(a terminal gets a progress bar)", Integer())
    dist_timeout: int = setting(600, "under torchrun: seconds a process waits for the others at any exchange before "
                                     "it stops with an error (a node lost without a word)", Integer(), "SECONDS")

    def __post_init__(self) -> None:
        check_settings(self, SettingError)
        if self.batch % self.grad_accum:
            raise SettingError("batch", f"{self.batch} does not split into --grad-accum {self.grad_accum} "
                                        f"micro-batches; use a multiple of {self.grad_accum}")
        if self.from_pretrained is not None and self.model != DEMO_MODEL:
            raise SettingError("model", f"{self.model!r} conflicts with --from-pretrained, whose config.json is the "
                                        "model; drop one of them")
        if self.schedule != "constant" and self.warmup >= self.steps:
            raise SettingError("warmup", f"{self.warmup} leaves no steps to decay over with --steps {self.steps}; "
                                         "lower --warmup or raise --steps")
        try:
            self.device_config()
            self.report_config()
        except BaseSettingError as exc:
            raise SettingError(exc.key, exc.problem) from None
        try:
            self.lora_config()
        except BaseSettingError as exc:
            raise SettingError(exc.key, exc.problem) from None
        try:
            ModelConfig.named(self.model)
        except ConfigError as exc:
            raise SettingError("model", str(exc)) from None

    # --- derived settings -------------------------------------------------------------------------
    def budget_bytes(self) -> int | None:
        return budget_bytes(self.budget, SettingError, self.set)

    def tree(self, model: ModelConfig | None = None, devices: int = 1) -> Settings:
        """These settings as their owners' configs, for `model` (default: `model_config()`; train passes the
        shape its vocabulary was fitted to) on `devices` data-parallel devices. --dtype must be resolved
        first (`replace(cfg, dtype=...)`): the step and the store are laid out in a real dtype."""
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"resolve --dtype {self.dtype} to bf16 or fp32 before building the settings tree")
        model = self.model_config() if model is None else model
        self.check_lora_targets(model)
        return Settings(model=model, step=self.plan_config(devices), optimizer=self.optimizer_config(),
                        schedule=self.lr_schedule(), device=self.device_config(), data=self.data_config(),
                        store=self.trainer_config().store_spec(model))

    def check_lora_targets(self, model: ModelConfig) -> None:
        """--lora-targets must name projections of the model's family."""
        try:
            check_targets(model, self.lora_config())
        except BaseSettingError as exc:
            raise SettingError(exc.key, exc.problem) from None

    def device_config(self) -> DeviceConfig:
        return DeviceConfig(**owned(self, DeviceConfig))

    def lora_config(self) -> LoraConfig:
        return LoraConfig(**owned(self, LoraConfig))

    def model_config(self) -> ModelConfig:
        """The model's shape: from --from-pretrained's config.json, else the preset or config file."""
        if self.from_pretrained is not None:
            return ModelConfig.from_hf(self.from_pretrained)
        return ModelConfig.named(self.model)

    def plan_config(self, devices: int = 1) -> PlanConfig:
        """The planner's view of this run's step on `devices` data-parallel devices."""
        # Conservative where --pack packs nothing (plain text: each row one sequence, the unmasked path).
        return PlanConfig(**owned(self, PlanConfig), seq=self.seq, compute_dtype=self.dtype, devices=devices,
                          moment_dtype=self.moment_dtype, lora=self.lora_config(), packed=self.pack is not None)

    def report_config(self) -> ReportConfig:
        return ReportConfig(self.report_to)

    def data_config(self) -> DataConfig:
        return DataConfig(**owned(self, DataConfig))

    def optimizer_config(self) -> OptimizerConfig:
        # The flag says 0 for no clipping (a flag cannot be None).
        return OptimizerConfig(**owned(self, OptimizerConfig), max_grad_norm=self.max_grad_norm or None)

    def lr_schedule(self) -> LRSchedule:
        return LRSchedule(**owned(self, LRSchedule), total_steps=None if self.schedule == "constant" else self.steps)

    def trainer_config(self) -> TrainerConfig:
        """The trainer API's flat keywords: the optimizer's, the step's, the device's and the trainer's own."""
        optimizer = self.optimizer_config()
        step = {k: v for k, v in owned(self, PlanConfig).items() if k in TrainerConfig.__dataclass_fields__}
        return TrainerConfig(**{f.name: getattr(optimizer, f.name) for f in fields(optimizer)}, **step,
                             **owned(self, TrainerConfig), compute_dtype=self.dtype, device=self.device,
                             pin_memory=self.pin_memory,
                             budget=self.budget_bytes(), schedule=self.lr_schedule(),
                             **{f"lora_{k}": v for k, v in owned(self, LoraConfig).items()})

    def name(self) -> str:
        """A short name for the default run directory."""
        if self.from_pretrained is not None:
            return Path(self.from_pretrained).name
        if self.data is not None:
            return Path(self.data).stem
        return "demo" if self.model == DEMO_MODEL else Path(self.model).stem

    # --- TOML -----------------------------------------------------------------------------------
    def to_toml(self) -> str:
        lines = ["# weight-streaming run settings: the keys are `streamer train`'s flags with _ for -"]
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not (f.name == "model" and self.from_pretrained is not None):
                lines.append(f"{f.name} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    def with_absolute_paths(self) -> RunConfig:
        return replace(self, **{k: os.path.abspath(v) for k, v in self._paths().items()})

    def _paths(self) -> dict[str, str]:
        names = [*PATH_KEYS, *(("model",) if self.model not in PRESETS else ())]
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


PATH_KEYS = ("from_pretrained", "data", "tokenizer", "run_dir", "eval_data", "chat_template")
# What the demo sets beyond RunConfig's defaults: a short cosine run from scratch under a budget that
# holds under a third of the demo model's 16 B/param training state (docs/CLI.md has the measurements);
# its warmup is a tenth of --steps, at most 5.
DEMO_DEFAULTS: dict[str, Any] = {
    "steps": 80, "lr": 1e-3, "schedule": "cosine", "warmup": 5, "min_lr_ratio": 0.1,
    "activations": "checkpoint", "update_chunk": 2**20, "budget": "64MiB", "eval_every": 20,
}
# Settings a resumed run may change: none of them alters the data order or the store's layout. The betas may
# not: the saved moments are averages at those decay rates and Adam's bias correction 1 - beta^t assumes one
# beta since step 1. eps, like lr, only scales the next updates; moment_dtype is the store's layout. pin_memory
# only says which host memory is page-locked; `set` only describes the simulated device.
RESUMABLE = ("steps", "lr", "eval_every", "eval_batches", "save_every", "sample_prompt", "sample_tokens",
             "device", "budget", "prefetch", "eps", "nonfinite", "trace_steps", "trace_every", "log_every",
             "report_to", "pin_memory", "set", "dist_timeout")
# The choices and integer minimums of the run's settings, read from their declarations (the CLI's choices).
CHOICES = {name: check.options for name, check in checks_of(RunConfig, Choice).items()}
INT_MINIMUMS = {name: check.low for name, check in checks_of(RunConfig, Integer).items()}


def resolve(explicit: dict[str, Any], config_file: str | Path | None = None) -> RunConfig:
    """RunConfig from the flags given (`explicit`, no Nones), over a TOML file, over the (demo) defaults."""
    from_file = read_toml(config_file) if config_file is not None else {}
    given = {**from_file, **explicit}
    with blame(config_file, set(from_file) - set(explicit)):
        if given.get("model") is not None and given.get("from_pretrained") is not None:
            raise SettingError("model", "conflicts with --from-pretrained, whose config.json is the model; "
                                        "drop one of them")
        if isinstance(given.get("from_pretrained"), str) and given.get("data") is None:
            raise SettingError("from_pretrained", "needs --data: the demo text is only the demo's; pass --data "
                                                  "FILE (.txt, .jsonl, .parquet or .csv) to fine-tune on")
        demo = given.get("data") is None and given.get("from_pretrained") is None and \
            given.get("model", DEMO_MODEL) == DEMO_MODEL
        values = {**(DEMO_DEFAULTS if demo else {}), **given}
        model = values.get("model")
        if "seq" not in given and isinstance(model, str) and model in PRESETS:  # the default fits every preset
            values["seq"] = min(RunConfig.seq, PRESETS[model].context()[0])
        steps = values.get("steps", RunConfig.steps)
        if demo and "warmup" not in given and type(steps) is int:  # a short demo (`--steps 3`) still decays
            values["warmup"] = min(DEMO_DEFAULTS["warmup"], steps // 10)
        return RunConfig(**values)


@contextlib.contextmanager
def blame(config_file: str | Path | None, file_keys: set[str]) -> Iterator[None]:
    """A wrong setting that came from the settings file is reported as `--config FILE: key problem`."""
    try:
        yield
    except SettingError as exc:
        if config_file is None or exc.key not in file_keys:
            raise
        raise RunError(f"--config {config_file}: {exc.key} {exc.problem}") from None


def read_toml(path: str | Path) -> dict[str, Any]:
    """A run.toml's settings; relative paths in it are relative to the file's folder."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise RunError(f"--config {path} does not exist; pass a TOML file of key = value settings") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"cannot read --config {path} ({exc}); check the path") from None
    except tomllib.TOMLDecodeError as exc:
        raise RunError(f"--config {path} is not valid TOML ({exc}); fix that line") from None
    known = [f.name for f in fields(RunConfig)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        verb = "is not a setting" if len(unknown) == 1 else "are not settings"
        raise RunError(f"--config {path}: {', '.join(unknown)} {verb}; valid keys: {', '.join(known)}")
    if raw.get("pack") is True:  # a run's config.toml from when --pack was a switch: it packed examples
        raw["pack"] = "examples"
    elif raw.get("pack") is False:
        del raw["pack"]
    for key in [*PATH_KEYS, "model"]:
        value = raw.get(key)
        if isinstance(value, str) and not (key == "model" and value in PRESETS):
            raw[key] = str(path.parent / Path(value).expanduser())
    return raw


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    # A JSON string is a TOML basic string, except that TOML wants DEL escaped too.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007F")
