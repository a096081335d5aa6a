"""`streamer`: plan | train | eval | generate | export | trace | bench (also `python -m streamer`).

Every user error (bad flags, files, settings, a budget that cannot fit) is printed as one line,
`error: <what is wrong and the fix>`, with exit status 2; never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import typing
from dataclasses import MISSING, fields
from typing import Callable, NoReturn, Sequence

from layers import CheckpointMismatch, ConfigError
from memory_model import DEVICE_PRESETS, DTYPE_BYTES, DeviceOutOfMemory, SizeError
from streamer.errors import StreamerError
from memory_model.settings import flag
from streamer.run import CHOICES, DEMO_DEFAULTS, RunConfig

USER_ERRORS = (StreamerError, ConfigError, CheckpointMismatch, SizeError, DeviceOutOfMemory, OSError)

TOP_EXAMPLES = """\
examples:
  streamer train                                   the demo: a small GPT-J streamed under a 64 MiB budget
  streamer plan --model gptj-6b --target cs2 --batch 1 --seq 2048
  streamer train --from-pretrained ./gptj-hf --data train.jsonl --budget 3GiB --steps 500
  streamer generate runs/demo-20260101-120000 --prompt "The for statement"
  streamer eval runs/demo-20260101-120000 --data train.jsonl
  streamer export runs/demo-20260101-120000 ./exported-hf
  streamer trace runs/demo-20260101-120000
run `streamer COMMAND --help` for a command's flags and examples; docs/CLI.md has the details."""

TRAIN_EXAMPLES = """\
examples:
  streamer train                                   the demo (under 2 minutes on 2 cores)
  streamer train --steps 3 --run-dir /tmp/quick    a quick look; the same command again continues it
  streamer train --steps 6 --run-dir /tmp/quick    ... to step 6 (other settings than its own are refused)
  streamer train --from-pretrained ./gptj-hf --data summaries.jsonl --seq 512 --batch 8 --grad-accum 4 \\
      --lr 1e-5 --schedule cosine --warmup 20 --steps 300 --budget 3GiB --activations checkpoint
  streamer train --config run.toml --steps 50      a TOML file of the same settings; flags win
  streamer train --resume runs/demo-20260101-120000 --steps 120

--data: a .txt file (blank lines separate documents) or .jsonl with {"text": ...} or
{"prompt": ..., "completion": ...} records (the loss covers the completion only).
Every run writes its resolved settings to RUN/config.toml. A run killed at any point (set-up included)
continues from its last committed step when the same command is run again. The host RAM and disk the
store needs are checked before anything is written."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line that names the --help to read."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per RunConfig field, so the flags and run.toml's keys cannot drift apart."""
    hints = typing.get_type_hints(RunConfig)
    for f in fields(RunConfig):
        types = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
        default = f.default if f.default is not MISSING else None
        shown = f" (default: {default}" + (f"; demo: {DEMO_DEFAULTS[f.name]})" if f.name in DEMO_DEFAULTS else ")")
        name = flag(f.name)
        if types == [bool]:
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=f.metadata["help"] + shown)
        elif typing.get_origin(hints[f.name]) is tuple:
            parser.add_argument(name, nargs="+", action=_Numbers, default=argparse.SUPPRESS,
                                metavar=("B1", "B2"), help=f.metadata["help"] + shown.replace(
                                    str(default), ",".join(map(str, default))))
        else:
            metavar = f.metadata["metavar"] or {int: "N", float: "X"}[types[0]]
            parser.add_argument(name, type=types[0], default=argparse.SUPPRESS, metavar=metavar,
                                help=f.metadata["help"] + ("" if default is None else shown))


class _Numbers(argparse.Action):
    """`--betas 0.9,0.95` or `--betas 0.9 0.95`: a tuple of numbers (RunConfig checks how many)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: typing.Any,
                 option_string: str | None = None) -> None:
        try:
            numbers = tuple(float(v) for v in ",".join(values).split(",") if v.strip())
        except ValueError:
            parser.error(f"{option_string} takes numbers such as 0.9,0.95, got {' '.join(values)!r}")
        setattr(namespace, self.dest, numbers)


def build_parser() -> Parser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = Parser(prog="streamer", description="Full fine-tuning of GPT-J models larger than the device, "
                                                 "by streaming one layer at a time.",
                    epilog=TOP_EXAMPLES, formatter_class=formatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    train = commands.add_parser("train", help="fine-tune (no arguments: the demo)", epilog=TRAIN_EXAMPLES,
                                formatter_class=formatter, description="Train with streamed layers; "
                                "with no arguments, the built-in demo.")
    train.add_argument("--config", metavar="TOML", help="settings file; its keys are the flags with _ for -")
    train.add_argument("--resume", metavar="RUN", help="continue RUN from its last committed step")
    _add_run_flags(train)
    train.set_defaults(func=_lazy("streamer.cli.train", "train_command"))

    plan = commands.add_parser("plan", help="device memory and time of a training step, before running it",
                               formatter_class=formatter, description="The analytic plan of one training step.",
                               epilog="examples:\n  streamer plan --model gptj-6b --target cs2 --batch 1 --seq 2048\n"
                                      "  streamer plan --model gptj-6b --target a100-40g --batch 8 --seq 2048 "
                                      "--activations checkpoint --dry-run\n"
                                      "  streamer plan --model ./gptj-hf/config.json --target local --json")
    # The flags plan shares with train take train's names, choices and defaults (tests/test_settings.py checks).
    plan.add_argument("--model", default=RunConfig.model, help=f"a preset or a config.json (default: {RunConfig.model})")
    plan.add_argument("--target", default="cs2",
                      help=f"the simulated device: a preset ({', '.join(DEVICE_PRESETS)}) or local (this machine, measured "
                           "once and cached in runs/) (default: cs2)")
    plan.add_argument("--batch", type=int, default=RunConfig.batch, help=f"global batch (default: {RunConfig.batch})")
    plan.add_argument("--seq", type=int, default=RunConfig.seq, help=f"tokens per sequence (default: {RunConfig.seq})")
    plan.add_argument("--activations", choices=CHOICES["activations"], default=RunConfig.activations)
    plan.add_argument("--ranks", type=int, default=1,
                      help="data-parallel processes (one device each): adds the gradient all-reduce and prints the scaling curve")
    plan.add_argument("--dtype", choices=CHOICES["dtype"], default=RunConfig.dtype,
                      help="compute dtype (default: auto: for local, bf16 if this CPU runs it natively and at least "
                           "as fast as fp32, else fp32; bf16 for the presets, which all run it natively)")
    plan.add_argument("--grad-accum", type=int, default=RunConfig.grad_accum)
    plan.add_argument("--prefetch", type=int, default=RunConfig.prefetch)
    plan.add_argument("--update-on", choices=CHOICES["update_on"], default=RunConfig.update_on)
    plan.add_argument("--update-chunk", type=int, default=RunConfig.update_chunk,
                      help="parameters per update chunk (default: %(default)s)")
    plan.add_argument("--store", choices=CHOICES["store"], default=RunConfig.store)
    plan.add_argument("--dry-run", action="store_true",
                      help="also run the real schedule on meta tensors and report its ledger's peak")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=_lazy("streamer.cli.plan", "plan_command"))

    generate = commands.add_parser("generate", help="sample text from a run, streaming its layers",
                                   formatter_class=formatter, description="Generate with streamed layers and "
                                   "a KV cache; works for models larger than the budget.",
                                   epilog="examples:\n  streamer generate RUN --prompt \"The for statement\"\n"
                                          "  streamer generate RUN --prompt \"Summary:\" --temperature 0 "
                                          "--max-new-tokens 80\n  streamer generate RUN --prompt Hi --top-k 40 "
                                          "--top-p 0.9 --seed 3 --budget 32MiB")
    generate.add_argument("run", metavar="RUN", help="a run directory")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=40, help="(default: 40)")
    generate.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (default: 0, off)")
    generate.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default: 0.95; 1 is off)")
    generate.add_argument("--seed", type=int, default=0, help="(default: 0)")
    generate.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every token")
    generate.add_argument("--budget", help="device budget (default: the run's)")
    generate.add_argument("--device", help="torch device (default: the run's)")
    generate.set_defaults(func=_lazy("streamer.cli.generate", "generate_command"))

    evaluate = commands.add_parser("eval", help="loss and perplexity of a run on a data file",
                                   formatter_class=formatter, description="Evaluate a run's model on held-out "
                                   "data (any --data format) with streamed forward passes.",
                                   epilog="examples:\n  streamer eval RUN --data train.jsonl\n"
                                          "  streamer eval RUN --data train.jsonl --batch 2 --budget 32MiB")
    evaluate.add_argument("run", metavar="RUN", help="a run directory")
    evaluate.add_argument("--data", required=True, metavar="FILE", help="the data to evaluate on, read like "
                          "the run's --data at its --seq")
    evaluate.add_argument("--batch", type=int, help="sequences per forward pass (default: the run's micro-batch)")
    evaluate.add_argument("--budget", help="device budget (default: the run's)")
    evaluate.add_argument("--device", help="torch device (default: the run's)")
    evaluate.set_defaults(func=_lazy("streamer.cli.eval", "eval_command"))

    export = commands.add_parser("export", help="write a run as a Hugging Face GPT-J folder",
                                 formatter_class=formatter, description="Export the master weights and the "
                                 "tokenizer; transformers.GPTJForCausalLM.from_pretrained loads the result.",
                                 epilog="examples:\n  streamer export RUN ./hf-out\n"
                                        "  streamer export RUN ./hf-out --dtype bf16 --max-shard-size 2GB "
                                        "--overwrite")
    export.add_argument("run", metavar="RUN", help="a run directory")
    export.add_argument("hf_dir", metavar="HF_DIR", help="the folder to write (must be new or empty)")
    export.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="fp32",
                        help="weights' dtype (default: fp32, the master weights exactly)")
    export.add_argument("--max-shard-size", default="2GiB", help="largest safetensors shard (default: 2GiB)")
    export.add_argument("--overwrite", action="store_true", help="replace HF_DIR if it holds files")
    export.set_defaults(func=_lazy("streamer.cli.export", "export_command"))

    trace = commands.add_parser("trace", help="the per-layer memory table and plot of a run",
                                formatter_class=formatter, description="Show a run's memory trace. A run's trace keeps its last --trace-steps "
                                "steps (default 8) and, if trained with --trace-every N, every Nth step; "
                                "--step picks one of them.",
                                epilog="examples:\n  streamer trace RUN\n"
                                       "  streamer train --run-dir runs/traced --steps 300 --trace-every 100\n"
                                       "  streamer trace runs/traced --step 100 --out step100.png --chrome step100.json\n"
                                       "  streamer trace RUN/trace.json --json")
    trace.add_argument("run", metavar="RUN", help="a run directory or a trace JSON file")
    trace.add_argument("--step", type=int, help="one of the steps the trace keeps (default: the last)")
    trace.add_argument("--out", help="the PNG to write (default: RUN/memory.png)")
    trace.add_argument("--chrome", help="also write a Chrome trace (chrome://tracing, ui.perfetto.dev) here")
    trace.add_argument("--json", action="store_true", help="print the summary as JSON")
    trace.set_defaults(func=_lazy("streamer.cli.trace", "trace_command"))

    commands.add_parser("bench", help="benchmarks (see `streamer bench --help`)", add_help=False)
    return parser


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """Import a command's module only when it runs: `streamer --help` stays fast."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), name)(args)
    return run


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}; check the path, its permissions and free space"
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from streamer.cli.bench import bench_command
        return guarded(lambda: bench_command(argv[1:]))
    return guarded(lambda: _dispatch(argv))


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


def guarded(command: Callable[[], int]) -> int:
    """Run a command; a user error becomes one line and exit status 2, Ctrl-C names how to continue."""
    try:
        return command()
    except USER_ERRORS as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        run_dir = getattr(exc, "run_dir", None)  # set by `streamer train` once its run folder exists
        print("interrupted" + (f"; continue from the last committed step with `streamer train --resume {run_dir}`"
                               if run_dir else ""), file=sys.stderr)
        return 130
