"""A training run's settings (`RunConfig`: a TrainerConfig and the run's own; by flat name, the flags of
`streamer train` and the keys of run.toml and of a run folder's config.toml; the folder is streamer/run_dir.py).

Settings resolve in this order, later winning: RunConfig's defaults, the demo's defaults (only when nothing
names a model or data: `streamer train` alone is the demo), the `--config` TOML file, the flags. TOML is read
with tomllib and written here as flat `key = value` lines; a setting that is None is left out (TOML has no
null). Paths are written absolute so that a run can be resumed from any working directory, except those inside
the run's own folder: they are written relative to it, and read relative to the file, so a copied run folder is
the copy's.
"""
from __future__ import annotations

import contextlib
import json
import os
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Mapping

from layers import FAMILIES, PRESETS, ConfigError, ModelConfig
from memory_model import PlanConfig
from memory_model.expert_groups import checked_group
from memory_model.objective import with_method_defaults
from memory_model.lora import check_targets
from memory_model.settings import SettingError as BaseSettingError
from memory_model.settings import (
    Choice, Integer, Switch, Text, branch, build, check_flat, check_settings, checks_of, flatten, same_setting, setting,
)
from streamer.config import TrainerConfig
from streamer.errors import StreamerError
from streamer.io.gguf import is_gguf
from streamer.io.data import DataConfig
from streamer.reporting import ReportConfig
from streamer.runtime.hardware import check_device
from memory_model.step import Placement, StepConfig
from memory_model.tiers import DISK, RAM


class RunError(StreamerError):
    """Run settings or a run directory that cannot be used; the message names the fix."""


class SettingError(RunError, BaseSettingError):
    """One run setting's value is wrong: `key` names it, so an error can say where it came from (flag or file)."""

    def __init__(self, key: str, problem: str) -> None:
        BaseSettingError.__init__(self, key, problem)


DEMO_MODEL = "gptj-demo"
DEFAULT_SAVE_EVERY = 50  # steps between a RAM-tier run's saves, and between the steps --keep-last alone keeps
DEFAULT_PROMPT = "The for statement is used to"


@dataclass(frozen=True)
class RunConfig:
    """`streamer train`'s settings: the trainer's (`trainer`, a TrainerConfig), the data's, the reports' and the
    run's own (model, steps, batch, cadences, sample). Each setting is a flag and a TOML key by its flat name
    (memory_model.settings.branch): `of` builds a RunConfig from them, `flat()` gives them back."""

    trainer: TrainerConfig = branch(TrainerConfig, lambda: TrainerConfig(step=StepConfig(store=Placement.of(DISK))))
    data: DataConfig = branch(DataConfig)
    report: ReportConfig = branch(ReportConfig)
    model: str = setting(DEMO_MODEL, "a preset (%s) or a config.json to initialise randomly" % ", ".join(PRESETS),
                         Text(), "PRESET|CONFIG")
    from_pretrained: str | None = setting(None, "a Hugging Face folder to fine-tune (its weights and tokenizer) "
                                                "whose config.json's model_type is one of %s; or a GGUF file "
                                                "(FILE.gguf: LoRA on its frozen blocks)" % ", ".join(FAMILIES),
                                          Text(), "HF_DIR")
    run_dir: str | None = setting(None, "the run directory; one holding this run (same settings) is continued "
                                        "(default: runs/<name>-<time>)", Text(), "DIR")
    steps: int = setting(100, "optimizer steps in all (with --resume: the new total)", Integer())
    epochs: int | None = setting(None, "passes over the training data instead of --steps: the steps are the "
                                       "epochs x training sequences / --batch, rounded up (with --resume: the new "
                                       "total)", Integer(), "N")
    batch: int = same_setting(PlanConfig, "batch", 8)
    seq: int = setting(128, "tokens per sequence (default: 128, or a preset's context if shorter)", Integer(2))
    eval_every: int = setting(50, "evaluate before the first step and every N steps (0: only at the end)", Integer(0))
    eval_batches: int = setting(4, "held-out batches per evaluation", Integer())
    save_every: int | None = setting(None, "keep a step every N steps, all of them unless --keep-last, as "
                                           "transformers' save_steps: restartable, exportable with `streamer export "
                                           "--step`, and what a damaged store goes back to (each costs a copy of the "
                                           "state on disk); with --store ram also how often the store is written to "
                                           "disk, and at the end (default: %d, and none kept)" % DEFAULT_SAVE_EVERY,
                                     Integer(), "N")
    keep_last: int | None = setting(None, "keep only the last K --save-every steps, as transformers' "
                                          "save_total_limit (0: none; default: every one where --save-every is given, "
                                          "else none)", Integer(0), "K")
    keep_best: bool = setting(False, "also keep the --save-every step of the lowest eval loss (each such step is "
                                     "evaluated)", Switch())
    sample_prompt: str | None = setting(None, "prompt of the sample generated at the end (default: with --data, "
                                              "the first example's prompt or first words; else %r)"
                                        % DEFAULT_PROMPT.replace("%", "%%"), Text(), "TEXT")
    sample_tokens: int = setting(40, "tokens of that sample (0: no sample)", Integer(0))
    log_every: int = setting(1, "when stdout is not a terminal (a log, a pipe): one progress line every N steps "
                                "(a terminal gets a progress bar)", Integer())
    dist_timeout: int = setting(600, "under torchrun: seconds a process waits for the others at any exchange before "
                                     "it stops with an error (a node lost without a word)", Integer(), "SECONDS")

    def __post_init__(self) -> None:
        check_settings(self, SettingError)
        grad_accum = self.trainer.step.grad_accum
        if self.batch % grad_accum:
            raise SettingError("batch", f"{self.batch} does not split into --grad-accum {grad_accum} "
                                        f"micro-batches; use a multiple of {grad_accum}")
        if self.from_pretrained is not None and self.model != DEMO_MODEL:
            raise SettingError("model", f"{self.model!r} conflicts with --from-pretrained, whose config.json is the "
                                        "model; drop one of them")
        if self.keep_best and self.data.eval_fraction == 0 and self.data.eval_data is None:
            raise SettingError("keep_best", "ranks the kept steps by eval loss, and --eval-fraction 0 holds out no "
                                            "data: pass --eval-data or an --eval-fraction above 0")
        schedule = self.trainer.schedule
        if schedule.kind != "constant" and schedule.total_steps != self.steps:
            raise ValueError("the schedule's total_steps is --steps: build a RunConfig with RunConfig.of")
        try:
            check_device(self.trainer.device.device, None)  # `meta` is for dry runs, not `streamer train`
        except BaseSettingError as exc:
            raise SettingError(exc.key, exc.problem) from None
        try:
            ModelConfig.named(self.model)
        except ConfigError as exc:
            raise SettingError("model", str(exc)) from None

    @classmethod
    def of(cls, flat: Mapping[str, Any], base: RunConfig | None = None) -> RunConfig:
        """The settings from their flat names (flags, TOML keys) over `base` (default: the defaults). The
        schedule decays over --steps."""
        check_flat(cls, flat, SettingError)
        before = flatten(DEFAULTS if base is None else base)
        if flat.get("method", before["method"]) == "grpo" != before["method"] and "eval_fraction" not in flat:
            flat = {**flat, "eval_fraction": 0.0}  # GRPO's rows are sampled: it has no held-out loss
        flat = with_method_defaults(flat, before["method"])
        values = {**before, **flat}
        kind, warmup, steps = values["schedule"], values["warmup"], values["steps"]
        if kind != "constant" and warmup >= steps:
            raise SettingError("warmup", f"{warmup} leaves no steps to decay over with --steps {steps}; "
                                         "lower --warmup or raise --steps")
        total = {"total_steps": None if kind == "constant" else steps}
        return build(cls, {**flat, **total}, base, SettingError)

    def replace(self, **flat: Any) -> RunConfig:
        """These settings with some changed, by flat name: `cfg.replace(dtype="bf16")`."""
        return RunConfig.of(flat, self)

    def flat(self) -> dict[str, Any]:
        """Every flag's value, by flat name, in the order of the flags."""
        values = flatten(self)
        values["store"] = self.trainer.step.store.tier
        return {name: values[name] for name in FLAGS}

    # --- derived settings -------------------------------------------------------------------------
    @property
    def save_interval(self) -> int:
        """Steps between saves: when a RAM-tier run writes its store, and which steps may be kept."""
        return DEFAULT_SAVE_EVERY if self.save_every is None else self.save_every

    def keep_limit(self) -> int | None:
        """How many of the newest --save-every steps stay kept: --keep-last; else, as transformers' Trainer keeps
        every save_steps checkpoint unless save_total_limit is set, every one (None) where --save-every is given;
        else none."""
        if self.keep_last is not None:
            return self.keep_last
        return None if self.save_every is not None else 0

    def keeps(self) -> bool:
        """Whether --save-every steps are kept (--keep-last, --keep-best, or --save-every alone)."""
        return self.keep_limit() != 0 or self.keep_best

    def kept_copies(self) -> int:
        """The most steps kept at once, each a copy of the state on disk: what the disk check counts."""
        limit = self.keep_limit()
        return self.steps // self.save_interval if limit is None else limit + self.keep_best

    def budget_bytes(self) -> int | None:
        return self.trainer.device.budget_bytes()

    def check_lora_targets(self, model: ModelConfig) -> None:
        """--lora-targets must name projections of the model's family."""
        try:
            check_targets(model, self.trainer.lora)
        except BaseSettingError as exc:
            raise SettingError(exc.key, exc.problem) from None

    def check_expert_groups(self, model: ModelConfig, devices: int = 1) -> None:
        """--expert-group-size must fit the model's experts, as `streamer plan` checks it (`checked_group`)."""
        try:
            checked_group(model, self.trainer.step.expert_group_size, self.trainer.lora.enabled, devices)
        except BaseSettingError as exc:
            raise SettingError(exc.key, exc.problem) from None

    def model_config(self) -> ModelConfig:
        """The model's shape: from --from-pretrained's config.json, else the preset or config file."""
        if self.from_pretrained is not None and is_gguf(self.from_pretrained):
            from streamer.io.gguf import GGUFCheckpoint  # (gguf and transformers load only for a GGUF file)
            return GGUFCheckpoint.open(self.from_pretrained).config
        if self.from_pretrained is not None:
            from streamer.io.hf import check_quantization  # (the checkpoint reader loads only with a folder)
            source = Path(self.from_pretrained)
            check_quantization(source / "config.json" if source.is_dir() else source, self.trainer.lora)
            return ModelConfig.from_hf(self.from_pretrained)
        return ModelConfig.named(self.model)

    def plan_config(self, devices: int = 1) -> PlanConfig:
        """The planner's view of this run's step on `devices` data-parallel devices. --dtype must be resolved
        first (`cfg.replace(dtype=...)`): the step is laid out in a real dtype."""
        tc = self.trainer
        if not tc.step.precision.resolved:
            raise ValueError(f"resolve --dtype {tc.step.precision.compute} to bf16 or fp32 before planning the step")
        # Conservative where --pack packs nothing (plain text: each row one sequence, the unmasked path).
        rows = self.batch * (2 if tc.objective.preference else 1)  # --batch counts DPO's pairs: two rows each
        return tc.plan_config(rows, self.seq, devices, packed=self.data.pack is not None,
                              source_dtype=self._source_dtype())

    def _source_dtype(self) -> str:
        """The dtype of a unit's weights as the start holds them (PlanConfig.source_dtype): a fresh unit's
        fp32, an imported folder's widest as saved, or for a GGUF file fp32, which bounds a bf16 run's tensors
        dequantized into bf16 beside the file's bytes of them (16-bit or quantized)."""
        if self.from_pretrained is None or is_gguf(self.from_pretrained):
            return "fp32"
        from streamer.io.hf import saved_dtype  # (the checkpoint reader loads only with a folder)
        return saved_dtype(self.from_pretrained)

    def name(self) -> str:
        """A short name for the default run directory."""
        if self.from_pretrained is not None:
            return Path(self.from_pretrained).name
        if self.data.data is not None:
            return Path(self.data.data).stem
        return "demo" if self.model == DEMO_MODEL else Path(self.model).stem

    # --- TOML -----------------------------------------------------------------------------------
    def to_toml(self, folder: str | Path | None = None) -> str:
        """The settings as TOML; paths inside `folder` (the run's own, where the file goes) relative to it."""
        lines = ["# weight-streaming run settings: the keys are `streamer train`'s flags with _ for -"]
        values = self.flat()
        if folder is not None:
            inside = Path(os.path.abspath(folder))
            values.update({k: os.path.relpath(v, inside) for k, v in self._paths().items()
                           if Path(os.path.abspath(v)).is_relative_to(inside)})
        for name, value in values.items():
            if value is not None and not (name == "model" and self.from_pretrained is not None):
                lines.append(f"{name} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    def on_gguf_base(self) -> RunConfig:
        """A run on a GGUF file (--from-pretrained FILE.gguf): the trainer on its frozen base, each weight's type
        the file's. Other runs as they are."""
        if self.from_pretrained is None or not is_gguf(self.from_pretrained):
            return self
        from streamer.io.gguf import GGUFCheckpoint
        base = GGUFCheckpoint.open(self.from_pretrained).base()
        return replace(self, trainer=self.trainer.on_base(base, SettingError))

    def with_absolute_paths(self) -> RunConfig:
        """Every path absolute (`~` expanded, as in a TOML file): the same folder compares equal however the
        command named it, from any working directory."""
        return self.replace(**{k: absolute(v) for k, v in self._paths().items()})

    def _paths(self) -> dict[str, str]:
        names = [*PATH_KEYS, *(("model",) if self.model not in PRESETS else ())]
        values = self.flat()
        return {k: values[k] for k in names if values[k] is not None}


# The flags of `streamer train` and the keys of run.toml and config.toml, in the order --help and config.toml
# show them: every flat name of RunConfig's settings but the schedule's total_steps, which is --steps.
FLAGS = ("model", "from_pretrained", "data", "tokenizer", "vocab_size", "run_dir", "steps", "epochs", "batch", "seq",
         "grad_accum", "lr", "schedule", "warmup", "min_lr_ratio", "weight_decay", "max_grad_norm", "betas", "eps",
         "moment_dtype", "master_dtype", "nonfinite", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets",
         "load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype", "load_in_8bit",
         "method", "beta", "loss_type", "label_smoothing", "num_generations", "max_completion_length", "temperature",
         "top_p", "epsilon", "num_iterations", "reward_funcs", "reward_weights",
         "trace_steps", "trace_every", "dtype", "device", "budget", "price_on", "set", "pin_memory", "store",
         "activations", "update_on", "prefetch", "update_chunk", "update_timing", "clipped_steps", "data_parallel",
         "expert_group_size", "seed", "pack", "long_examples", "max_length", "truncation_mode",
         "max_prompt_length", "eval_fraction", "eval_data", "chat_template",
         "eval_every", "eval_batches", "save_every", "keep_last", "keep_best", "sample_prompt", "sample_tokens",
         "report_to", "log_every", "dist_timeout")
DEFAULTS = RunConfig()
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
# beta since step 1. eps, like lr, only scales the next updates; moment_dtype and master_dtype are the store's
# layout. pin_memory only says which host memory is page-locked; `set` only describes the simulated device, and
# price_on which device run-time choices are priced on; expert_group_size only how a block's experts reach the
# device.
RESUMABLE = ("steps", "epochs", "lr", "eval_every", "eval_batches", "save_every", "keep_last", "keep_best",
             "sample_prompt", "sample_tokens", "device", "budget", "prefetch", "eps", "nonfinite", "trace_steps",
             "trace_every", "log_every", "report_to", "pin_memory", "set", "dist_timeout", "clipped_steps",
             "expert_group_size", "price_on")
# The choices and integer minimums of the run's settings, read from their declarations (the CLI's choices).
CHOICES = {name: check.options for name, check in checks_of(RunConfig, Choice).items() if name in FLAGS}
INT_MINIMUMS = {name: check.low for name, check in checks_of(RunConfig, Integer).items() if name in FLAGS}


def resolve(explicit: dict[str, Any], config_file: str | Path | None = None) -> RunConfig:
    """RunConfig from the flags given (`explicit`, no Nones), over a TOML file, over the (demo) defaults."""
    from_file = read_toml(config_file) if config_file is not None else {}
    given = {**from_file, **explicit}
    with blame(config_file, set(from_file) - set(explicit)):
        if given.get("model") is not None and given.get("from_pretrained") is not None:
            raise SettingError("model", "conflicts with --from-pretrained, whose config.json is the model; "
                                        "drop one of them")
        if given.get("epochs") is not None and given.get("steps") is not None:
            raise SettingError("epochs", "conflicts with --steps: both set the run's length; give one of them")
        if isinstance(given.get("from_pretrained"), str) and given.get("data") is None:
            raise SettingError("from_pretrained", "needs --data: the demo text is only the demo's; pass --data "
                                                  "FILE (.txt, .jsonl, .parquet or .csv) to fine-tune on")
        demo = given.get("data") is None and given.get("from_pretrained") is None and \
            given.get("model", DEMO_MODEL) == DEMO_MODEL
        values = {**(DEMO_DEFAULTS if demo else {}), **given}
        model = values.get("model")
        if "seq" not in given and isinstance(model, str) and model in PRESETS:  # the default fits every preset
            values["seq"] = min(DEFAULTS.seq, PRESETS[model].attention().context()[0])
        steps = values.get("steps", DEFAULTS.steps)
        if demo and "warmup" not in given and type(steps) is int:  # a short demo (`--steps 3`) still decays
            values["warmup"] = min(DEMO_DEFAULTS["warmup"], steps // 10)
        return RunConfig.of(values).on_gguf_base()


def store_choice(cfg: RunConfig, explicit: Mapping[str, Any], config_file: str | Path | None = None) -> str:
    """The store `streamer train` keeps with these settings (`resolve`'s), and why, in a few words."""
    tier = cfg.trainer.step.store.tier
    assert tier is not None  # streamer train's store is one tier (--store ram or disk)
    if "store" in explicit:
        return f"store: {tier} (--store {tier})"
    if config_file is not None and "store" in read_toml(config_file):
        return f"store: {tier} (store = {tier} in --config {config_file})"
    other = next(t for t in _TIER_WORDS if t != tier)
    return (f"store: {tier} (streamer train's default: the state {_TIER_WORDS[tier]}; --store {other} keeps it "
            f"{_TIER_WORDS[other]})")


_TIER_WORDS = {DISK: "on disk, committed every step", RAM: "in host RAM, saved every --save-every steps"}


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
    unknown = sorted(set(raw) - set(FLAGS))
    if unknown:
        verb = "is not a setting" if len(unknown) == 1 else "are not settings"
        raise RunError(f"--config {path}: {', '.join(unknown)} {verb}; valid keys: {', '.join(FLAGS)}")
    if raw.get("pack") is True:  # a run's config.toml from when --pack was a switch: it packed examples
        raw["pack"] = "examples"
    elif raw.get("pack") is False:
        del raw["pack"]
    for key in [*PATH_KEYS, "model"]:
        value = raw.get(key)
        if isinstance(value, str) and not (key == "model" and value in PRESETS):
            raw[key] = str(path.parent / Path(value).expanduser())
    return raw


def absolute(path: str | Path) -> str:
    """`path` absolute, `~` expanded (a shell leaves `--run-dir=~/runs/ft` as it is)."""
    return os.path.abspath(os.path.expanduser(path))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    # A JSON string is a TOML basic string, except that TOML wants DEL escaped too.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007F")
