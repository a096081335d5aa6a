"""Command-line flags generated from the run's settings (`RunConfig`'s fields): `train` takes them all, `plan`
and `bench` the ones they share with it, so a shared flag has one name, type, choices and help everywhere.

A generated flag that is not given is absent from the parsed namespace (`argparse.SUPPRESS`): `given` then
lists only what the user typed, and `streamer.run.resolve` lays it over the `--config` file and the defaults.
"""
from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, fields
from typing import Any, Callable, Iterable, Mapping

from memory_model.settings import Assignments, Choice, flag
from streamer.run import DEMO_DEFAULTS, RunConfig


def add_run_flags(parser: argparse.ArgumentParser, only: Iterable[str] | None = None,
                  defaults: Mapping[str, Any] | None = None, help: Mapping[str, str] | None = None) -> None:
    """One flag per RunConfig field (those named in `only`, in RunConfig's order), so the flags and run.toml's
    keys cannot drift apart. `defaults`: a command's own default for a field, stored in the namespace (a
    command that does not resolve a RunConfig, such as bench); `help`: a command's own help text for one
    (a text that names its own "(default: ...)" is shown as it is)."""
    names = None if only is None else set(only)
    defaults, help = defaults or {}, help or {}
    hints = typing.get_type_hints(RunConfig)
    for f in fields(RunConfig):
        if names is not None and f.name not in names:
            continue
        types = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
        own = f.name in defaults
        default = defaults[f.name] if own else (f.default if f.default is not MISSING else None)
        demo = f"; demo: {DEMO_DEFAULTS[f.name]}" if f.name in DEMO_DEFAULTS and not own else ""
        text = help.get(f.name, f.metadata["help"])
        shown = "" if "(default:" in text else f" (default: {default}{demo})"
        kwargs: dict[str, Any] = {"default": default if own else argparse.SUPPRESS}
        if isinstance(f.metadata["check"], Assignments):  # repeated: `--set a=1 --set b=2`
            kwargs.update(action="append", metavar=f.metadata["metavar"], help=text)
        elif types == [bool]:
            kwargs.update(action=argparse.BooleanOptionalAction, help=text + shown)
        elif typing.get_origin(hints[f.name]) is tuple:
            kwargs.update(nargs="+", action=_Numbers, metavar=("B1", "B2"),
                          help=text + shown.replace(str(default), ",".join(map(str, default))))
        else:
            if isinstance(f.metadata["check"], Choice) and f.metadata["check"].bare is not None:
                kwargs.update(nargs="?", const=f.metadata["check"].bare)
            kwargs.update(type=types[0], metavar=f.metadata["metavar"] or {int: "N", float: "X"}[types[0]],
                          help=text + ("" if default is None else shown))
        parser.add_argument(flag(f.name), **kwargs)


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The run settings given as flags (a generated flag not given is absent from `args`)."""
    return {f.name: getattr(args, f.name) for f in fields(RunConfig) if hasattr(args, f.name)}


class _Numbers(argparse.Action):
    """`--betas 0.9,0.95` or `--betas 0.9 0.95`: a tuple of numbers (RunConfig checks how many)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            numbers = tuple(float(v) for v in ",".join(values).split(",") if v.strip())
        except ValueError:
            parser.error(f"{option_string} takes numbers such as 0.9,0.95, got {' '.join(values)!r}")
        setattr(namespace, self.dest, numbers)


def declare_command(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int], description: str,
                    examples: str) -> None:
    """A subcommand's parser (made by `streamer.cli.main`): its description, its examples after the flags,
    and the function that runs it."""
    parser.description, parser.epilog = description, examples
    parser.set_defaults(func=run)


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """`--config run.toml`: settings laid under the flags by `streamer.run.resolve`."""
    parser.add_argument("--config", metavar="TOML", help="settings file; its keys are the flags with _ for -")
