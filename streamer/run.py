"""A training run: its settings (`RunConfig`: the flags of `streamer train`, the keys of run.toml) and its folder.

A run directory (`RunDir`) holds:

    config.toml        the resolved RunConfig; `streamer train --config RUN/config.toml --run NEW` repeats it
    store/             the host store: weights, fp32 master, Adam moments, gradients (docs/STORE.md)
    tokenizer/         tokenizer.json and the two files transformers reads beside it
    metrics.jsonl      one JSON object per optimizer step and per evaluation
    trace.json         the memory trace of the latest session; trace.chrome.json, memory.png: its views

Settings resolve in this order, later winning: RunConfig's defaults, the demo's defaults (only when nothing
names a model or data: `streamer train` alone is the demo), the `--config` TOML file, the flags. TOML is read
with tomllib and written here as flat `key = value` lines; a setting that is None is left out (TOML has no
null), and paths are written absolute so that a run can be resumed from any working directory.
"""
from __future__ import annotations

import json
import math
import os
import tomllib
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from layers import PRESETS, GPTJConfig
from memory_model import DEVICE_PRESETS, SizeError, parse_size
from streamer.config import LRSchedule, TrainerConfig
from streamer.errors import StreamerError


class RunError(StreamerError):
    """Run settings or a run directory that cannot be used; the message names the fix."""


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
    run: str | None = _setting(None, "the run directory (default: runs/<name>-<time>)", "DIR")
    steps: int = _setting(100, "optimizer steps in all (with --resume: the new total)")
    batch: int = _setting(8, "sequences per optimizer step (the global batch)")
    seq: int = _setting(128, "tokens per sequence")
    grad_accum: int = _setting(1, "micro-batches the batch is split into")
    lr: float = _setting(1e-4, "peak learning rate")
    schedule: str = _setting("constant", "learning-rate schedule after warmup: constant, cosine or linear",
                             "KIND")
    warmup: int = _setting(0, "linear warmup steps")
    min_lr_ratio: float = _setting(0.0, "the cosine/linear schedule ends at this fraction of --lr")
    weight_decay: float = _setting(0.1, "AdamW weight decay (matrices only)")
    max_grad_norm: float = _setting(1.0, "clip gradients to this global norm (0: no clipping)")
    dtype: str = _setting("auto", "compute dtype: auto (bf16 where the hardware runs it natively and faster than "
                                  "fp32, else fp32; config.toml records the choice), bf16 or fp32 (master weights "
                                  "and Adam state are fp32)", "DTYPE")
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
    sample_prompt: str = _setting(DEFAULT_PROMPT, "prompt of the sample generated at the end", "TEXT")
    sample_tokens: int = _setting(40, "tokens of that sample (0: no sample)")

    def __post_init__(self) -> None:
        _check_types(self)
        for name, low in (("steps", 1), ("batch", 1), ("seq", 2), ("grad_accum", 1), ("warmup", 0),
                          ("prefetch", 0), ("update_chunk", 1), ("seed", 0), ("eval_every", 0), ("eval_batches", 1),
                          ("save_every", 1), ("sample_tokens", 0)):
            if getattr(self, name) < low:
                raise RunError(f"{_flag(name)} must be an integer >= {low}, got {getattr(self, name)}")
        if self.vocab_size is not None and self.vocab_size < 257:
            raise RunError(f"--vocab-size must be >= 257 (256 bytes + end-of-text), got {self.vocab_size}")
        if self.batch % self.grad_accum:
            raise RunError(f"--batch {self.batch} does not split into --grad-accum {self.grad_accum} micro-batches; "
                           f"use a multiple of {self.grad_accum}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise RunError(f"--lr must be a positive number, got {self.lr}")
        for name in ("weight_decay", "max_grad_norm"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise RunError(f"{_flag(name)} must be a number >= 0, got {getattr(self, name)}")
        for name, high in (("eval_fraction", 1.0), ("min_lr_ratio", 1.0 + 1e-12)):
            if not 0 <= getattr(self, name) < high:
                raise RunError(f"{_flag(name)} must be in [0, 1{')' if name == 'eval_fraction' else ']'}, "
                               f"got {getattr(self, name)}")
        choices = {"schedule": ("constant", "cosine", "linear"), "dtype": ("auto", "bf16", "fp32"),
                   "store": ("ram", "disk"), "activations": ("resident", "checkpoint"), "update_on": ("device", "host")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise RunError(f"{_flag(name)} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.schedule != "constant" and self.warmup >= self.steps:
            raise RunError(f"--warmup {self.warmup} leaves no steps to decay over with --steps {self.steps}; "
                           "lower --warmup or raise --steps")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise RunError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        self.budget_bytes()
        if self.model not in PRESETS and not Path(self.model).exists():
            raise RunError(f"--model {self.model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
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
            raise RunError(f"--budget: {exc}, or a device preset ({', '.join(DEVICE_PRESETS)})") from None
        if size <= 0:
            raise RunError("--budget must be more than 0 bytes; leave it out for no limit")
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
            schedule=schedule, update_chunk=self.update_chunk, seed=self.seed)

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
            if value is not None:
                lines.append(f"{f.name} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    def with_absolute_paths(self) -> RunConfig:
        return replace(self, **{k: os.path.abspath(v) for k, v in self._paths().items()})

    def _paths(self) -> dict[str, str]:
        names = [*PATH_KEYS, *(("model",) if self.model not in PRESETS else ())]
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


PATH_KEYS = ("from_pretrained", "data", "tokenizer", "run")
# What the demo sets beyond RunConfig's defaults: a short cosine run from scratch under a budget that
# holds under a third of the demo model's 16 B/param training state (docs/CLI.md has the measurements);
# its warmup is a tenth of --steps, at most 5.
DEMO_DEFAULTS: dict[str, Any] = {
    "steps": 80, "lr": 1e-3, "schedule": "cosine", "warmup": 5, "min_lr_ratio": 0.1,
    "activations": "checkpoint", "update_chunk": 2**20, "budget": "64MiB", "eval_every": 20,
}
# Settings a resumed run may change: none of them alters the data order or the store's layout.
RESUMABLE = ("steps", "lr", "eval_every", "eval_batches", "save_every", "sample_prompt", "sample_tokens",
             "device", "budget", "prefetch")


def resolve(explicit: dict[str, Any], config_file: str | Path | None = None) -> RunConfig:
    """RunConfig from the flags given (`explicit`, no Nones), over a TOML file, over the (demo) defaults."""
    given = {**(read_toml(config_file) if config_file is not None else {}), **explicit}
    demo = given.get("data") is None and given.get("from_pretrained") is None and \
        given.get("model", DEMO_MODEL) == DEMO_MODEL
    values = {**(DEMO_DEFAULTS if demo else {}), **given}
    if demo and "warmup" not in given:  # a short demo (`--steps 3`) still gets a schedule that decays
        values["warmup"] = min(DEMO_DEFAULTS["warmup"], values["steps"] // 10)
    return RunConfig(**values)


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
        raise RunError(f"--config {path}: unknown setting(s) {unknown}; valid keys: {', '.join(known)}")
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
    # A JSON string is a TOML basic string, except that TOML wants DEL escaped too.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007F")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_types(cfg: RunConfig) -> None:
    """TOML and keyword callers can pass any type: check each against the annotation (an int is a float)."""
    hints = typing.get_type_hints(RunConfig)
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(cfg, f.name, float(value))
            continue
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            wanted = " or ".join("nothing" if t is type(None) else t.__name__ for t in allowed)
            raise RunError(f"{_flag(f.name)} must be {wanted}, got {value!r}")


@dataclass(frozen=True)
class RunDir:
    """A run's folder and the names of what it holds (see the module docstring)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def trace_json(self) -> Path:
        return self.root / "trace.json"

    @property
    def trace_chrome(self) -> Path:
        return self.root / "trace.chrome.json"

    @property
    def plot(self) -> Path:
        return self.root / "memory.png"

    def processes(self) -> int:
        """How many data-parallel processes trained the run: each keeps its own store in store/rank<N>."""
        return len(list(self.store.glob("rank*"))) or 1

    def store_to_read(self) -> Path:
        """A store with the run's weights (every process's store holds the same ones)."""
        return self.store / "rank0" if self.processes() > 1 else self.store

    @staticmethod
    def is_run(path: str | Path) -> bool:
        return (Path(path) / "config.toml").is_file()

    @classmethod
    def create(cls, path: str | Path) -> RunDir:
        """A new run in `path`, which must not exist or be an empty folder: nothing is ever overwritten."""
        root = Path(path)
        if root.exists() and not root.is_dir():
            raise RunError(f"--run {root} is a file; choose a folder name for the run")
        if cls.is_run(root):
            raise RunError(f"{root} already holds a run; continue it with `streamer train --resume {root}` "
                           "or choose a new --run")
        if root.is_dir() and any(root.iterdir()):
            raise RunError(f"{root} exists and is not a run directory; it is never overwritten: choose a new --run")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunError(f"cannot create the run directory {root} ({exc.strerror}); choose another --run") from None
        return cls(root)

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        root = Path(path)
        if not cls.is_run(root):
            raise RunError(f"{root} is not a run directory (no config.toml); pass a folder `streamer train` made")
        return cls(root)

    def read_config(self) -> RunConfig:
        return RunConfig(**read_toml(self.config))

    def write_config(self, cfg: RunConfig) -> None:
        tmp = self.config.with_suffix(".toml.tmp")
        tmp.write_text(cfg.to_toml(), encoding="utf-8")
        tmp.replace(self.config)  # atomic: a run is a run once its whole config is there

    def append_metrics(self, record: dict[str, Any]) -> None:
        with self.metrics.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.is_file():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]
