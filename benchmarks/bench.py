"""`streamer bench`: our runtime against what users would pick instead, on this machine, in one run.

Every contender runs in its own process (clean peak RSS) in ABBA-ordered blocks; the tables and the
BENCHMARKS.md this command writes hold only numbers measured in the run (see benchmarks/compare.py).
`--quick` is a smoke run of the harness on a tiny model (the test suite runs it), not a measurement.
`--only-scale` and `--only-qlora` run one part alone, on a quiet machine, and write its section into a report.
`--model` and `--scale-model` take any family's preset or config.json; the scale run trains the largest model of
its family that the disk holds (GPT-J-6B by default).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from layers import PRESETS, ConfigError, ModelConfig
from memory_model import PlanConfig, plan
from memory_model.units import Precision
from memory_model.settings import check_settings, same_setting
from streamer.calibration.calibrate import CalibrationSizes, local_spec
from benchmarks.compare import (
    DP_1, DP_2, DS_CPU, DS_NVME, HF_BF16, HF_FP32, RESIDENT, SCALE, SCALE_FLOOR, SECOND, STREAM_DISK, STREAM_DISK_HALF,
    STREAM_RAM,
    Context, Outcome, data_parallel, disk_tier, dtypes, gpu, half_the_bytes, host_memory, memory, overhead, planner,
    scale, update_speed, utilisation, versus_deepspeed, versus_hf, where_time_goes,
)
from benchmarks.machine import (
    ModelChoice, Peaks, describe, disk_budget, family_presets, fitted_width, matmul_peaks, pick_scale_model, raw_disk,
    update_rates,
)
from benchmarks.lora import (
    FULL, LORA, LORA_RANK, QLORA_HF, QLORA_MODEL, QLORA_OURS, QLORA_OURS_UNCACHED, QLORA_QUICK_MODEL, lora_pair,
    lora_versus_full, qlora_pair, qlora_versus_hf,
)
from benchmarks.report import update_markdown, write_markdown
from benchmarks.runs import Result, Runner
from benchmarks.worker import RunSpec
from streamer.cli.flags import add_run_flags
from streamer.cli.main import Parser, guarded
from streamer.run import SettingError
from streamer.runtime.optim import OptimizerConfig
from streamer.runtime.hardware import DtypeChoice, resolve_compute_dtype
from streamer.runtime.step import StepConfig

GiB = 2**30


@dataclass(frozen=True, kw_only=True)  # keywords only: required settings follow defaulted ones
class Settings:
    """What one bench run measures; `--quick` swaps in tiny sizes so the harness runs in seconds. The step's
    sizes are the run's settings, checked as `streamer train` checks them."""

    model: str
    second: ModelConfig  # the planner's second model size
    batch: int = same_setting(PlanConfig, "batch")
    seq: int = same_setting(PlanConfig, "seq")
    rounds: int
    warmup: int
    steps: int
    deepspeed: bool
    scale: bool
    scale_model: str  # the scale run's preset or config.json (its candidates: `_scale_candidates`)
    scale_qlora: bool = False  # the scale run trains LoRA adapters on the model's 4-bit base instead
    scale_warmup: int
    scale_steps: int
    data_parallel: bool
    profile: bool
    matmul_n: int
    update_params: int  # the AdamW comparison's state
    disk_test_bytes: int
    disk_repeats: int
    reserve_fraction: float
    reserve_min_bytes: int
    quick: bool
    compute: DtypeChoice  # our contenders' compute dtype (--dtype resolved on this CPU) and why
    alone: str | None = None  # the --only-... flag of the part that runs alone; None: the whole bench
    max_grad_norm: float = same_setting(OptimizerConfig, "max_grad_norm")

    def __post_init__(self) -> None:
        check_settings(self, SettingError)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Settings":
        alone = _alone(args)
        for flag, value in (("--model", args.model), ("--scale-model", args.scale_model)):
            if value is not None:
                _checked_model(flag, value)
        compute = resolve_compute_dtype("cpu", args.dtype)
        if args.quick:
            model = args.model or "gptj-debug"
            return cls(model=model, second=_second(ModelConfig.named(model)), batch=1, seq=32,
                       max_grad_norm=args.max_grad_norm, rounds=1,
                       warmup=1, steps=2, deepspeed=False, scale=not args.no_scale and alone != ONLY_QLORA,
                       scale_model=_scale_model(args.scale_model, model, quick=True), scale_qlora=args.scale_qlora,
                       scale_warmup=0, scale_steps=1, data_parallel=False, profile=False, matmul_n=256,
                       update_params=2**20,
                       disk_test_bytes=16 * 2**20, disk_repeats=1, reserve_fraction=0.0, reserve_min_bytes=0,
                       quick=True, compute=compute, alone=alone)
        model = args.model or "gptj-350m"
        second = _second(ModelConfig.named(model))
        if args.steps * args.rounds < 5:
            raise SystemExit("the medians need at least 5 timed steps: --steps x --rounds >= 5")
        return cls(model=model, second=second, batch=args.batch, seq=args.seq,
                   max_grad_norm=args.max_grad_norm, rounds=args.rounds,
                   warmup=args.warmup, steps=args.steps, deepspeed=not args.no_deepspeed,
                   scale=not args.no_scale and alone != ONLY_QLORA,
                   scale_model=_scale_model(args.scale_model, model, quick=False), scale_qlora=args.scale_qlora,
                   scale_warmup=1,
                   scale_steps=args.scale_steps,
                   data_parallel=True, profile=True, matmul_n=2048, update_params=64 * 2**20,
                   disk_test_bytes=2 * GiB, disk_repeats=3,
                   reserve_fraction=0.12, reserve_min_bytes=8 * GiB, quick=False, compute=compute, alone=alone)


ONLY_SCALE, ONLY_QLORA = "--only-scale", "--only-qlora"
# The parts of the bench that run alone, to measure one on a quiet machine: the section each writes into an existing
# report (which keeps the rest), and the flags it excludes, which skip or shape what it does not run.
ALONE: dict[str, tuple[Callable[[Context], Outcome], tuple[str, ...]]] = {
    ONLY_SCALE: (scale, ("--no-scale",)),
    ONLY_QLORA: (qlora_versus_hf, (ONLY_SCALE, "--no-scale", "--no-deepspeed", "--scale-model", "--scale-qlora",
                                   "--scale-steps")),
}


def _alone(args: argparse.Namespace) -> str | None:
    """The flag of the part that runs alone, or None for the whole bench; a flag that part excludes is one line
    naming both."""
    given = _given(args)
    for only, (_, excluded) in ALONE.items():
        clash = [flag for flag in excluded if flag in given]
        if only in given and clash:
            raise SystemExit(f"{only} runs its part alone and excludes {', '.join(clash)}; drop "
                             f"{'that flag' if len(clash) == 1 else 'those flags'} or {only}")
    return next((only for only in ALONE if only in given), None)


def _checked_model(flag: str, value: str) -> ModelConfig:
    """The model a flag names, or one line naming the flag."""
    try:
        return ModelConfig.named(value)
    except ConfigError as exc:
        raise ConfigError(f"{flag} {exc}") from None


def _scale_model(asked: str | None, model: str, quick: bool) -> str:
    """--scale-model, by default the largest preset of --model's family (GPT-J-6B for the default gptj-350m); with
    --quick, the smallest preset of that model's family: a harness check of the family, in seconds."""
    scale_model = asked or family_presets(ModelConfig.named(model))[0]
    return family_presets(ModelConfig.named(scale_model))[-1] if quick else scale_model


def _second(base: ModelConfig) -> ModelConfig:
    """The planner's second size: the model's vocabulary, context and head size, 3/4 of its width and heads
    (key/value heads too), 3/5 of its depth."""
    return base.resized(hidden_size=base.hidden_size * 3 // 4, intermediate_size=base.intermediate_size * 3 // 4,
                        num_hidden_layers=max(1, base.num_hidden_layers * 3 // 5),
                        num_attention_heads=max(1, base.num_attention_heads * 3 // 4),
                        num_key_value_heads=max(1, base.num_key_value_heads * 3 // 4))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--quick", action="store_true", help="smoke run of the harness on a tiny model (< 60 s)")
    parser.add_argument("--output", type=Path, help="report to (re)write (default BENCHMARKS.md; with --quick, "
                        f"{ONLY_SCALE} or {ONLY_QLORA}, none: a partial run must not replace the measured report)")
    # The flags shared with `streamer train`: its names, types and checks, with the comparison's own sizes.
    add_run_flags(parser, only=("model", "batch", "seq", "dtype", "max_grad_norm"),
                  defaults={"model": None, "batch": 1, "seq": 512, "dtype": "auto", "max_grad_norm": 0.0},
                  help={"model": "the model of the comparisons 1-5, of any family: a preset or a config.json "
                                 "(default: gptj-350m; with --quick, gptj-debug)", "seq": "tokens per sequence",
                        "dtype": "compute dtype of our runs and DeepSpeed's: auto (bf16 if this CPU runs it natively "
                                 "and at least as fast as fp32, else fp32), bf16 or fp32; the HF pair stays fp32 "
                                 "and bf16",
                        "max_grad_norm": "every contender clips gradients to this global norm (0: none; random "
                                         "tokens' gradients clip on every step, and a fused update that clips is "
                                         "made again after the backward) (default: 0)"})
    parser.add_argument("--rounds", type=int, default=4, help="blocks per contender, in ABBA order")
    # Not --warmup: in `streamer train` that is the learning-rate warmup.
    parser.add_argument("--untimed-steps", dest="warmup", type=int, default=2,
                        help="untimed steps at the start of every block")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per block")
    parser.add_argument("--scale-steps", type=int, default=2, help="timed steps of the scale run")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed comparison")
    parser.add_argument("--no-scale", action="store_true", help="skip the scale run (the longest one)")
    parser.add_argument("--scale-model", metavar="PRESET|CONFIG",
                        help="the scale run's model, of any family: a preset or a config.json. Where the disk does "
                             "not hold its store, the run takes the largest that it holds: the model with smaller "
                             "Adam moments, its family's smaller presets, or its width with fewer layers (default: "
                             "the largest preset of --model's family, gptj-6b for gptj-350m; with --quick, the "
                             "smallest preset of its family)")
    parser.add_argument("--scale-qlora", action="store_true",
                        help=f"the scale run trains rank-{LORA_RANK} LoRA adapters on --scale-model's base held 4-bit "
                             "(nf4, double quant), as `streamer train --lora-rank --load-in-4bit` does, instead of "
                             "every weight")
    parser.add_argument(ONLY_SCALE, action="store_true",
                        help="run the scale run alone (--scale-model on the disk tier), to measure it on a quiet "
                             "machine; it writes no report unless --output names one, and into an existing report "
                             "only its own section and targets")
    parser.add_argument(ONLY_QLORA, action="store_true",
                        help=f"run the QLoRA pair alone (ours against transformers + bitsandbytes + PEFT on --model "
                             f"where it is a Llama, else {QLORA_MODEL}), to measure it on a quiet machine; as "
                             f"{ONLY_SCALE}, it writes no report unless --output names one")
    parser.add_argument("--workdir", type=Path, help="where stores and logs go (default: a temp dir, removed)")
    parser.add_argument("--child-timeout", type=float, default=4 * 3600, help="seconds one block may take")


def _spec(label: str, contender: str, cfg: ModelConfig, s: Settings, **kw: object) -> RunSpec:
    fields: dict[str, Any] = {"batch": s.batch, "seq": s.seq, "warmup": s.warmup, "steps": s.steps,
                              "dtype": s.compute.dtype, "max_grad_norm": s.max_grad_norm, **kw}
    return RunSpec(label=label, contender=contender, model=cfg.to_dict(), **fields)


def _main_specs(cfg: ModelConfig, s: Settings) -> tuple[list[RunSpec], dict[str, str]]:
    specs = [_spec(STREAM_RAM, "stream", cfg, s, profile=s.profile),
             _spec(RESIDENT, "resident", cfg, s, profile=s.profile),
             _spec(HF_FP32, "hf", cfg, s, dtype="fp32", profile=s.profile),
             _spec(HF_BF16, "hf", cfg, s, dtype="bf16", profile=s.profile),
             _spec(STREAM_DISK, "stream", cfg, s, tier="disk"),
             _spec(STREAM_DISK_HALF, "stream", cfg, s, tier="disk", master_dtype="bf16", moment_dtype="int8")]
    skipped = {}
    if not s.deepspeed:
        why = "--quick" if s.quick else "--no-deepspeed"
        skipped = {DS_CPU: why, DS_NVME: why}
    elif importlib.util.find_spec("deepspeed") is None:
        why = "deepspeed is not installed (pip install -c constraints.txt -e '.[bench]')"
        skipped = {DS_CPU: why, DS_NVME: why}
    else:
        specs += [_spec(DS_CPU, "deepspeed", cfg, s), _spec(DS_NVME, "deepspeed", cfg, s, tier="disk")]
    return specs, skipped


def _scale_candidates(s: Settings, budget: int) -> list[ModelChoice]:
    """Largest model first, in the run's compute dtype (the store is the same in either: loads cast the
    master). The scale model with fp32 Adam moments, then bf16 ones, then a bf16 master with int8 moments (the
    opt-in precisions only for the model asked for, the stretch goal, and its width), each with the fused update
    before the one after the backward (which needs less disk); its family's smaller presets with the fp32 state;
    and its width with as many layers as the disk holds, in each of the three states, fused."""
    compute, cfg = s.compute.dtype, ModelConfig.named(s.scale_model)
    if s.scale_qlora:  # the model asked for, else its width with as many layers as the disk holds
        qlora = ModelChoice(s.scale_model, cfg, Precision(compute), qlora_rank=LORA_RANK)
        width = None if s.quick else fitted_width(qlora, budget)
        return [qlora, *([width] if width is not None and width.config != cfg else [])]
    if s.quick:
        return [ModelChoice(s.scale_model, cfg, Precision(compute))]
    full = [ModelChoice(s.scale_model, cfg, Precision(compute, master, moments), timing)
            for master, moments in (("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "int8"))
            for timing in ("fused", "after-backward")]
    smaller = [ModelChoice(name, PRESETS[name], Precision(compute)) for name in family_presets(cfg)
               if PRESETS[name].num_params() < cfg.num_params()]
    widths = [w for c in full if c.update_timing == "fused" for w in (fitted_width(c, budget),)
              if w is not None and w.config.num_hidden_layers < cfg.num_hidden_layers]
    return sorted(full + smaller + widths, key=lambda c: -c.params)  # stable: the preference order within a size


# The compute floor's run: the scale model's width with this many blocks and this fraction of its vocabulary.
FLOOR_BLOCKS, FLOOR_VOCAB_DIVISOR = 2, 8


def _compute_floor_spec(scale_spec: RunSpec) -> RunSpec:
    """The scale run's compute with no disk: its width, dtype, precisions, activations and update on the RAM tier,
    small enough for this machine's RAM (an 8B's embedding and head alone are 1B parameters):
    compare.compute_floor_s scales its median block to the model's blocks and its embedding and head, whose every
    cost is linear in the vocabulary, to the model's vocabulary."""
    cfg = ModelConfig.from_dict(scale_spec.model)
    short = cfg.resized(num_hidden_layers=min(FLOOR_BLOCKS, cfg.num_hidden_layers),
                        vocab_size=max(1, cfg.vocab_size // FLOOR_VOCAB_DIVISOR))
    # The update's work is the same after the backward; fusing it needs the state on disk.
    return dataclasses.replace(scale_spec, label=SCALE_FLOOR, tier="ram", model=short.to_dict(),
                               update_timing="after-backward")


def _plans(results: dict[str, Result], workdir: Path, quick: bool) -> dict:
    """The planner's prediction for each of our single-process streamed runs, on the `local` device
    calibrated now for that run's model and dtype (--quick calibrates with tiny sizes)."""
    sizes = CalibrationSizes(matmul_n=256, probe_tokens=64, compute_seconds=1.0, copy_bytes=2**20,
                             disk_bytes=2**20, update_params=2**16, allreduce_bytes=2**16, repeats=1) if quick else None
    out, calibrated = {}, set()
    for label in (STREAM_RAM, SECOND, STREAM_DISK, STREAM_DISK_HALF, SCALE):
        r = results.get(label)
        if r is None or not r.ok:
            continue
        shape = ModelConfig.from_dict(r.spec.model)
        fresh = (shape, r.spec.dtype) not in calibrated  # measured now once, then from the cache it wrote
        calibrated.add((shape, r.spec.dtype))
        local = local_spec(workdir, shape, r.spec.dtype, refresh=fresh, sizes=sizes)
        out[label] = plan(shape, local, PlanConfig.of(r.spec.batch, r.spec.seq, compute_dtype=r.spec.dtype,
                                                      store=r.spec.tier, activations=r.spec.activations,
                                                      moment_dtype=r.spec.moment_dtype,
                                                      master_dtype=r.spec.master_dtype))
    return out


def _compare_main(runner: Runner, specs: list[RunSpec], s: Settings, cores: int,
                  skipped: dict[str, str]) -> dict[str, Result]:
    """Comparisons 1-5, the planner's second size and data parallel (adding to `skipped` what is not run)."""
    results = runner.compare(specs, s.rounds)
    results.update(runner.compare([_spec(SECOND, "stream", s.second, s)], s.rounds))
    results.update(runner.compare(lora_pair(_spec(FULL, "stream", ModelConfig.named(s.model), s)), s.rounds))
    results.update(runner.compare(_qlora_specs(s), s.rounds))
    if s.data_parallel and importlib.util.find_spec("streamer.runtime.distributed") is not None:
        dp = [_spec(DP_1, "stream", s.second, s, batch=2 * s.batch),
              _spec(DP_2, "stream", s.second, s, batch=2 * s.batch, world=2, threads=max(1, max(1, cores) // 2))]
        results.update(runner.compare(dp, s.rounds))
    else:
        why = "--quick" if s.quick else "streamer has no data-parallel support yet"
        skipped.update({DP_1: why, DP_2: why})
    return results


def _qlora_model(s: Settings) -> ModelConfig:
    """The QLoRA pair's model: --model where it is a Llama, else the Llama preset of the bench's size."""
    model = ModelConfig.named(s.model)
    return model if model.model_type == "llama" else ModelConfig.named(QLORA_QUICK_MODEL if s.quick else QLORA_MODEL)


def _qlora_specs(s: Settings) -> list[RunSpec]:
    return qlora_pair(_spec(QLORA_OURS, "stream", _qlora_model(s), s, profile=s.profile))


def _output(args: argparse.Namespace) -> Path | None:
    """BENCHMARKS.md holds a full measured run: a --quick smoke run or a part run alone writes a report only
    where it is told to."""
    return args.output or (None if args.quick or _alone(args) else Path("BENCHMARKS.md"))


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The options that differ from their defaults, by flag: not always the option's name (--untimed-steps sets
    `warmup`)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    names = {action.dest: action.option_strings[-1] for action in parser._actions if action.option_strings}
    return {names[k]: v for k, v in vars(args).items() if k in defaults and v != defaults[k]}


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (rebuilt from the options that differ from the defaults)."""
    flags = [flag + ("" if v is True else f" {shlex.quote(str(v))}") for flag, v in _given(args).items()]
    return " ".join(["streamer bench", *flags])


def run(args: argparse.Namespace) -> int:
    s = Settings.from_args(args)
    console, started = Console(), time.time()
    if not console.is_terminal:
        console.width = 200  # a log file: no terminal to fold the wide tables for
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="streamer-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        machine = describe()
        console.print("[bold]machine[/]: " + "; ".join(machine.lines()))
        console.print(s.compute.reason, markup=False, highlight=False)
        peaks_first = matmul_peaks(s.matmul_n)
        # The QLoRA pair alone runs on the RAM tier: no disk to measure.
        disk = {} if s.alone == ONLY_QLORA else {"start": raw_disk(workdir, s.disk_test_bytes, s.disk_repeats)}
        runner = Runner(workdir, console, args.child_timeout)
        cfg = ModelConfig.named(s.model)
        specs, skipped = _main_specs(cfg, s)
        if s.alone is None:
            results = _compare_main(runner, specs, s, machine.cores, skipped)
        else:
            results = runner.compare(_qlora_specs(s), s.rounds) if s.alone == ONLY_QLORA else {}
        pick = None
        if s.scale:
            free, budget = disk_budget(workdir, s.reserve_fraction, s.reserve_min_bytes)
            pick = pick_scale_model(s.scale_model, _scale_candidates(s, budget), free, budget)
            if pick.chosen is not None:
                disk["scale"] = raw_disk(workdir, s.disk_test_bytes, s.disk_repeats)
                spec = _spec(SCALE, "stream", pick.chosen.config, s, tier="disk", warmup=s.scale_warmup,
                             steps=s.scale_steps, moment_dtype=pick.chosen.precision.moments,
                             master_dtype=pick.chosen.precision.master,
                             dtype=pick.chosen.precision.compute, activations="checkpoint",
                             update_timing=pick.chosen.update_timing, prefetch=pick.chosen.prefetch,
                             **(dict(lora_rank=pick.chosen.qlora_rank, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                     bnb_4bit_use_double_quant=True) if pick.chosen.qlora_rank else {}))
                results.update(runner.bracket(_compute_floor_spec(spec), spec))
        else:
            skipped[SCALE] = skipped[SCALE_FLOOR] = "--no-scale"
        if s.alone is not None:  # what the whole bench runs and this part did not
            others = (*(spec.label for spec in specs), *skipped, SECOND, FULL, LORA, QLORA_OURS, QLORA_OURS_UNCACHED,
                      QLORA_HF, DP_1, DP_2)
            skipped = {label: s.alone for label in others if label not in results}
        peaks_last = matmul_peaks(s.matmul_n)
        peaks = Peaks(max(peaks_first.bf16_flops, peaks_last.bf16_flops),
                      max(peaks_first.fp32_flops, peaks_last.fp32_flops), s.matmul_n)
        nearest = {STREAM_DISK: disk.get("start"), SCALE: disk.get("scale", disk.get("start"))}
        ctx = Context(results=results, peaks=peaks, plans=_plans(results, workdir, s.quick), scale=pick,
                      skipped=skipped, disk={label: d for label, d in nearest.items() if d is not None},
                      compute=s.compute,
                      update=None if s.alone else update_rates(s.update_params,
                                                               min(s.update_params, StepConfig().update_chunk)))
        outcomes: list[Outcome] = [dtypes(ctx), overhead(ctx), versus_hf(ctx), versus_deepspeed(ctx), disk_tier(ctx),
                                   half_the_bytes(ctx), update_speed(ctx),
                                   utilisation(ctx), scale(ctx), memory(ctx), host_memory(ctx), planner(ctx),
                                   data_parallel(ctx),
                                   gpu(ctx, machine.gpu), lora_versus_full(ctx), qlora_versus_hf(ctx),
                                   *where_time_goes(ctx)]
        shown = outcomes if s.alone is None else [ALONE[s.alone][0](ctx)]  # a part alone: its own section
        for outcome in shown:
            console.print(outcome.section.rich())
        console.print("\n".join(t for o in shown for t in o.targets))
        targets = [t for o in outcomes for t in o.targets]
        lines = machine.lines() + [
            f"matmul peak (best of {s.matmul_n}^3, start and end of the run): bf16 {peaks.bf16_flops / 1e9:,.0f} "
            f"GFLOP/s, fp32 {peaks.fp32_flops / 1e9:,.0f} GFLOP/s",
            *(f"raw disk ({name}; best of {d.repeats} x {d.nbytes / GiB:.2f} GiB in {d.where}): read "
              f"{d.read_bytes_per_s / 1e9:.2f} GB/s, write {d.write_bytes_per_s / 1e9:.2f} GB/s, reading and writing "
              f"at once {d.shared_bytes_per_s / 1e9:.2f} GB/s in all"
              for name, d in disk.items()),
            f"model {s.model}, batch {s.batch} x seq {s.seq}; {s.rounds} blocks per contender (ABBA order), "
            f"{s.warmup} warm-up + {s.steps} timed steps per block" + ("; --quick: harness check only, the "
                                                                     "numbers mean nothing" if s.quick else "")]
        output = _output(args)
        if output is not None and s.alone and output.exists():
            # A report of a full run keeps its other sections: the part's own section and targets go in, where a
            # full run puts them.
            part = shown[0]
            update_markdown(output, f"`{_command(args)}`: " + "; ".join(lines[:-1]) +  # not comparisons 1-5's model
                            f"; wall time {(time.time() - started) / 60:.1f} min", list(part.targets),
                            [part.section], [o.section.title for o in outcomes])
            console.print(f"wrote \"{part.section.title}\" into {output}")
        elif output is not None:
            write_markdown(output, lines, _command(args), time.time() - started, targets,
                           [o.section for o in outcomes])
            console.print(f"wrote {output}")
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="streamer bench", formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return guarded(lambda: run(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
