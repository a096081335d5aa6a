"""`streamer`: train | plan | eval | generate | export | trace | devices | calibrate | bench (also
`python -m streamer`).

This module builds the top parser and dispatches; each subcommand's module (streamer/cli/<command>.py)
declares its own flags and examples (`declare`). Only the module of the command that runs is imported:
`streamer --help` loads none of them. Every user error (bad flags, files, settings, a budget that cannot
fit) is printed as one line, `error: <what is wrong and the fix>`, with exit status 2; never a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import re
import signal
import sys
import threading
from typing import Any, Callable, Iterable, Iterator, NoReturn, Sequence

from layers import CheckpointMismatch, ConfigError
from memory_model import DeviceOutOfMemory, SizeError
from streamer.errors import StreamerError

USER_ERRORS = (StreamerError, ConfigError, CheckpointMismatch, SizeError, DeviceOutOfMemory, OSError)
# Each command and its line in `streamer --help`; `bench` hands its arguments to benchmarks/bench.py.
COMMANDS = {
    "train": "fine-tune (no arguments: the demo)",
    "plan": "device memory and time of a training step, before running it",
    "eval": "loss and perplexity of a run on a data file",
    "generate": "sample text from a run, streaming its layers",
    "export": "write a run as a Hugging Face folder",
    "trace": "the per-layer memory table and plot of a run",
    "devices": "the device catalogue: every figure with its basis and source",
    "calibrate": "measure this machine: the cpu as the local device, or a CUDA GPU against its preset",
    "bench": "benchmarks (see `streamer bench --help`)",
}

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


# argparse takes `-1e-4` for a flag (its own pattern knows only `-1` and `-1.5`), so `--lr -1e-4` would fail as
# "expected one argument" instead of reaching the range check that names --lr.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line that names the --help to read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            message += self._closest(message.removeprefix("unrecognized arguments: ").split())
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")

    def _closest(self, unknown: list[str]) -> str:
        """' (--stpes: did you mean --steps?)' for each unknown flag that is close to one of this parser's."""
        known = [option for action in self._actions for option in action.option_strings if option.startswith("--")]
        hints = []
        for word in (w.split("=", 1)[0] for w in unknown if w.startswith("--")):
            close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
            if close:
                hints.append(f"{word}: did you mean {close[0]}?")
        return f" ({'; '.join(hints)})" if hints else ""


def build_parser(declared: Iterable[str] = tuple(COMMANDS)[:-1]) -> Parser:
    """The `streamer` parser, with the flags of the `declared` commands (their modules are imported)."""
    parser = Parser(prog="streamer", description="Full fine-tuning of GPT-J and Llama-family models larger than "
                                                 "the device, by streaming one layer at a time.",
                    epilog=TOP_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, line in COMMANDS.items():
        command = commands.add_parser(name, help=line, add_help=name != "bench",
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        if name in declared:
            importlib.import_module(f"streamer.cli.{name}").declare(command)
    return parser


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
    with _stopped_cleanly():
        return guarded(lambda: _dispatch(argv))


# The command that continues the run being trained, once its folder exists (`streamer train` sets it): a second
# signal names it, since the first one's line, printed after the clean-up, never comes.
RESUME_COMMAND: list[str] = []
_STOP_SAID: list[bool] = []  # the first signal's line is printed: a second one exits without another


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler's stop), raised where the command is as Ctrl-C's KeyboardInterrupt is, so the
    same clean-up runs and the same line says how to continue."""


@contextlib.contextmanager
def _stopped_cleanly() -> Iterator[None]:
    """The first SIGINT or SIGTERM stops the command by an exception (its clean-up runs, `guarded` prints one
    line); a second one, while that clean-up runs or the interpreter shuts down, exits at once with one line, never
    a traceback from wherever it landed. Every store is safe against a kill at any instant, so nothing committed is
    lost; what a stopped export leaves, the next export removes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopped = []

    def again(signum: int, _: Any) -> None:
        if not _STOP_SAID:
            resume = f"; continue from the last committed step with `{RESUME_COMMAND[-1]}`" if RESUME_COMMAND else ""
            print(f"interrupted again: stopped at once{resume}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def first(signum: int, _: Any) -> None:
        stopped.append(signum)
        for name in (signal.SIGINT, signal.SIGTERM):
            signal.signal(name, again)
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    previous = {name: signal.signal(name, first) for name in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        if not stopped:  # after a signal, a second one still exits at once while the interpreter shuts down
            for name, handler in previous.items():
                signal.signal(name, handler)


def _dispatch(argv: list[str]) -> int:
    parser = build_parser(argv[:1])  # only the command named (argparse takes it first), if any
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, args.command, unknown)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


def _refuse_unknown(parser: Parser, command: str | None, unknown: list[str]) -> NoReturn:
    """Unknown arguments after a command are refused by that command's parser, which names its own --help."""
    sub: argparse.ArgumentParser = parser if command is None else next(
        action.choices[command] for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    sub.error(f"unrecognized arguments: {' '.join(unknown)}")


def guarded(command: Callable[[], int]) -> int:
    """Run a command; a user error becomes one line and exit status 2, Ctrl-C names how to continue."""
    try:
        return command()
    except USER_ERRORS as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        # Set by `streamer train` once its run folder exists: the command that continues it, and from where.
        resume, since = getattr(exc, "resume_command", None), getattr(exc, "resumes_from", "the last committed step")
        print(("terminated" if isinstance(exc, Terminated) else "interrupted")
              + (f"; continue from {since} with `{resume}`" if resume else ""), file=sys.stderr, flush=True)
        _STOP_SAID.append(True)
        return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
