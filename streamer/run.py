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
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterator

from layers import PRESETS, GPTJConfig
from memory_model import COMPUTE_DTYPES, DEVICE_PRESETS, SizeError, parse_size
from memory_model.shapes import ACTIVATION_POLICIES, STORE_TIERS, UPDATE_PLACES
from streamer.config import LRSchedule, TrainerConfig
from streamer.errors import StreamerError


class RunError(StreamerError):
    """Run settings or a run directory that cannot be used; the message names the fix."""


class SettingError(RunError):
    """One setting's value is wrong: `key` names it, so an error can say where it came from (flag or file)."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{flag(key)} {problem}")
        self.key, self.problem = key, problem


# The choices of the settings that several subcommands share (train, plan): one place, so they cannot drift.
DTYPE_CHOICES = ("auto", *COMPUTE_DTYPES)  # auto: streamer/runtime/hardware.py
SCHEDULES = ("constant", "cosine", "linear")
MOMENT_DTYPES = ("fp32", "bf16")
NONFINITE_POLICIES = ("stop", "skip")


def _setting(default: Any, help: str, metavar: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "metavar": metavar})


DEMO_MODEL = "gptj-demo"
DEFAULT_PROMPT = "The for statement is used to"


@dataclass(frozen=True)
class RunConfig:
    model: str = _setting(DEMO_MODEL, "a preset (%s) or a config.json to initialise randomly" % ", ".join(PRESETS),
                       "PRESET|CONFIG")
    from_pretrained: str | None = _setting(None, "a Hugging Face GPT-J folder to fine-tune (its weights and tokenizer)",
                                          "HF_DIR")
    data: str | None = _setting(None, "a .txt file, or .jsonl of {\"text\"} or {\"prompt\", \"completion\"} records "
                                      "(default: Python's own help topics)", "FILE")
    tokenizer: str | None = _setting(None, "a folder with tokenizer.json or vocab.json + merges.txt "
                                           "(default: --from-pretrained's, else a BPE trained on the data)", "DIR")
    vocab_size: int | None = _setting(None, "vocabulary of the trained BPE (default: the model's)")
    run_dir: str | None = _setting(None, "the run directory; one holding this run (same settings) is continued "
                                         "(default: runs/<name>-<time>)", "DIR")
    steps: int = _setting(100, "optimizer steps in all (with --resume: the new total)")
    batch: int = _setting(8, "sequences per optimizer step (the global batch)")
    seq: int = _setting(128, "tokens per sequence (default: 128, or a preset's context if shorter)")
    grad_accum: int = _setting(1, "micro-batches the batch is split into")
    lr: float = _setting(1e-4, "peak learning rate")
    schedule: str = _setting("constant", "learning-rate schedule after warmup: constant, cosine or linear",
                             "KIND")
    warmup: int = _setting(0, "linear warmup steps")
    min_lr_ratio: float = _setting(0.0, "the cosine/linear schedule ends at this fraction of --lr")
    weight_decay: float = _setting(0.1, "AdamW weight decay (matrices only)")
    max_grad_norm: float = _setting(1.0, "clip gradients to this global norm (0: no clipping)")
    betas: tuple[float, float] = _setting((0.9, 0.95), "AdamW's moment decay rates, each in [0, 1): B1,B2 or B1 B2")
    eps: float = _setting(1e-8, "AdamW's epsilon, added to the root of the second moment")
    moment_dtype: str = _setting("fp32", "dtype of the Adam moments in the store: fp32, or bf16 (half the bytes)",
                                 "DTYPE")
    nonfinite: str = _setting("stop", "on a non-finite loss or gradient: stop the run, or skip the step "
                                      "(nothing is updated; the next batch follows)", "POLICY")
    trace_steps: int = _setting(8, "optimizer steps the memory trace keeps (the latest ones)")
    trace_every: int = _setting(0, "also keep every Nth step in the memory trace (N, 2N, ...; 0: only the latest "
                                   "--trace-steps); it then holds at most steps/N + --trace-steps steps", "N")
    dtype: str = _setting("auto", "compute dtype: auto (bf16 where the hardware runs it natively and at least as "
                                  "fast as fp32, else fp32; config.toml records the choice), bf16 or fp32 (master "
                                  "weights and Adam state are fp32)", "DTYPE")
    device: str = _setting("cpu", "torch device: cpu or cuda", "DEVICE")
    budget: str | None = _setting(None, "device memory budget, e.g. 64MiB or 3GB, or a device preset "
                                        "(%s); default: unlimited" % ", ".join(DEVICE_PRESETS), "SIZE")
    store: str = _setting("disk", "where the host store lives: ram, or disk (committed every step)", "TIER")
    activations: str = _setting("resident", "resident (no recompute) or checkpoint (keep block inputs only)",
                                "POLICY")
    update_on: str = _setting("device", "run AdamW on the device (streamed state) or on the host", "WHERE")
    prefetch: int = _setting(1, "units loaded ahead of the one computing")
    update_chunk: int = _setting(16 * 2**20, "parameters per update chunk: the optimizer state on the device at once")
    seed: int = _setting(0, "seed of the initialisation, the data split and the data order")
    pack: bool = _setting(False, "pack several prompt/completion examples into one sequence")
    eval_fraction: float = _setting(0.05, "fraction of sequences held out for evaluation")
    eval_every: int = _setting(50, "evaluate every N steps (0: only at the end)")
    eval_batches: int = _setting(4, "held-out batches per evaluation")
    save_every: int = _setting(50, "with --store ram: write the store to disk every N steps (and at the end)")
    sample_prompt: str | None = _setting(None, "prompt of the sample generated at the end (default: with --data, "
                                               "the first example's prompt or first words; else %r)"
                                         % DEFAULT_PROMPT.replace("%", "%%"), "TEXT")
    sample_tokens: int = _setting(40, "tokens of that sample (0: no sample)")
    log_every: int = _setting(1, "when stdout is not a terminal (a log, a pipe): one progress line every N steps "
                                 "(a terminal gets a progress bar)")

    def __post_init__(self) -> None:
        _check_types(self)
        for name, low in INT_MINIMUMS.items():
            if getattr(self, name) < low:
                raise SettingError(name, f"must be {_integer(low)}, got {getattr(self, name)}")
        if self.vocab_size is not None and self.vocab_size < 257:
            raise SettingError("vocab_size", f"must be >= 257 (256 bytes + end-of-text), got {self.vocab_size}")
        if self.batch % self.grad_accum:
            raise SettingError("batch", f"{self.batch} does not split into --grad-accum {self.grad_accum} "
                                        f"micro-batches; use a multiple of {self.grad_accum}")
        for name in ("lr", "eps"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise SettingError(name, f"must be a positive number, got {getattr(self, name)}")
        for name in ("weight_decay", "max_grad_norm"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise SettingError(name, f"must be a number >= 0, got {getattr(self, name)}")
        for name, high in (("eval_fraction", 1.0), ("min_lr_ratio", 1.0 + 1e-12)):
            if not 0 <= getattr(self, name) < high:
                raise SettingError(name, f"must be in [0, 1{')' if name == 'eval_fraction' else ']'}, "
                                         f"got {getattr(self, name)}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise SettingError("betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise SettingError(name, f"must be one of {', '.join(allowed)}, got {_shown(getattr(self, name))}")
        if self.from_pretrained is not None and self.model != DEMO_MODEL:
            raise SettingError("model", f"{self.model!r} conflicts with --from-pretrained, whose config.json is the "
                                        "model; drop one of them")
        if self.schedule != "constant" and self.warmup >= self.steps:
            raise SettingError("warmup", f"{self.warmup} leaves no steps to decay over with --steps {self.steps}; "
                                         "lower --warmup or raise --steps")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise SettingError("device", f"must be cpu, cuda or cuda:N, got {_shown(self.device)}")
        self.budget_bytes()
        if self.model not in PRESETS and not Path(self.model).exists():
            raise SettingError("model", f"{self.model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                           "config.json or folder holding one")

    # --- derived settings -------------------------------------------------------------------------
    def budget_bytes(self) -> int | None:
        if self.budget is None:
            return None
        if self.budget in DEVICE_PRESETS:
            return DEVICE_PRESETS[self.budget].memory_bytes
        try:
            size = parse_size(self.budget)
        except SizeError as exc:
            raise SettingError("budget", f"{_shown(self.budget)}: {exc}, or a device preset "
                                         f"({', '.join(DEVICE_PRESETS)})") from None
        if size <= 0:
            raise SettingError("budget", "must be more than 0 bytes; leave it out for no limit")
        return size

    def model_config(self) -> GPTJConfig:
        """The model's shape: from --from-pretrained's config.json, else the preset or config file."""
        if self.from_pretrained is not None:
            return GPTJConfig.from_hf(self.from_pretrained)
        return PRESETS[self.model] if self.model in PRESETS else GPTJConfig.from_hf(self.model)

    def trainer_config(self) -> TrainerConfig:
        schedule = LRSchedule(self.schedule, self.warmup, None if self.schedule == "constant" else self.steps,
                              self.min_lr_ratio)
        return TrainerConfig(
            lr=self.lr, weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm or None,
            grad_accum=self.grad_accum, compute_dtype=self.dtype, activations=self.activations, store=self.store,
            update_on=self.update_on, prefetch=self.prefetch, device=self.device, budget=self.budget_bytes(),
            schedule=schedule, update_chunk=self.update_chunk, seed=self.seed, betas=self.betas, eps=self.eps,
            moment_dtype=self.moment_dtype, nonfinite=self.nonfinite, trace_steps=self.trace_steps,
            trace_every=self.trace_every)

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


PATH_KEYS = ("from_pretrained", "data", "tokenizer", "run_dir")
# What the demo sets beyond RunConfig's defaults: a short cosine run from scratch under a budget that
# holds under a third of the demo model's 16 B/param training state (docs/CLI.md has the measurements);
# its warmup is a tenth of --steps, at most 5.
DEMO_DEFAULTS: dict[str, Any] = {
    "steps": 80, "lr": 1e-3, "schedule": "cosine", "warmup": 5, "min_lr_ratio": 0.1,
    "activations": "checkpoint", "update_chunk": 2**20, "budget": "64MiB", "eval_every": 20,
}
# Settings a resumed run may change: none of them alters the data order or the store's layout. The betas may
# not: the saved moments are averages at those decay rates and Adam's bias correction 1 - beta^t assumes one
# beta since step 1. eps, like lr, only scales the next updates; moment_dtype is the store's layout.
RESUMABLE = ("steps", "lr", "eval_every", "eval_batches", "save_every", "sample_prompt", "sample_tokens",
             "device", "budget", "prefetch", "eps", "nonfinite", "trace_steps", "trace_every", "log_every")
CHOICES = {"schedule": SCHEDULES, "dtype": DTYPE_CHOICES, "store": STORE_TIERS, "activations": ACTIVATION_POLICIES,
           "update_on": UPDATE_PLACES, "moment_dtype": MOMENT_DTYPES, "nonfinite": NONFINITE_POLICIES}
INT_MINIMUMS = {"steps": 1, "batch": 1, "seq": 2, "grad_accum": 1, "warmup": 0, "prefetch": 0, "update_chunk": 1,
                "seed": 0, "eval_every": 0, "eval_batches": 1, "save_every": 1, "sample_tokens": 0, "trace_steps": 1,
                "trace_every": 0, "log_every": 1}


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
                                                  "FILE (.txt or .jsonl) to fine-tune on")
        demo = given.get("data") is None and given.get("from_pretrained") is None and \
            given.get("model", DEMO_MODEL) == DEMO_MODEL
        values = {**(DEMO_DEFAULTS if demo else {}), **given}
        model = values.get("model")
        if "seq" not in given and isinstance(model, str) and model in PRESETS:  # the default fits every preset
            values["seq"] = min(RunConfig.seq, PRESETS[model].n_positions)
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
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
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


def flag(name: str) -> str:
    """The command-line flag of a setting: `grad_accum` -> `--grad-accum`."""
    return "--" + name.replace("_", "-")


def _integer(low: int) -> str:
    return "a positive integer" if low == 1 else f"an integer >= {low}"


def _shown(value: Any) -> str:
    """A value as the user wrote it: TOML and JSON agree on strings, numbers and lists."""
    if value is None:
        return "nothing"
    try:
        return json.dumps(list(value) if isinstance(value, tuple) else value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def _check_types(cfg: RunConfig) -> None:
    """TOML and keyword callers can pass any type: check each against the annotation (an int is a float)."""
    hints = typing.get_type_hints(RunConfig)
    wanted = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if typing.get_origin(hints[f.name]) is tuple:  # betas: two numbers, from TOML a list
            numbers = isinstance(value, (list, tuple)) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            if not numbers or len(value) != 2:
                raise SettingError(f.name, f"must be two numbers in [0, 1), got {_shown(value)}")
            object.__setattr__(cfg, f.name, tuple(float(v) for v in value))
            continue
        allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(cfg, f.name, float(value))
            continue
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            kind = next(t for t in allowed if t is not type(None))
            what = _integer(INT_MINIMUMS[f.name]) if f.name in INT_MINIMUMS else wanted[kind]
            if f.name in CHOICES:
                what = "one of " + ", ".join(CHOICES[f.name])
            raise SettingError(f.name, f"must be {what}, got {_shown(value)}")
