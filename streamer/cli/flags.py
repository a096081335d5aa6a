"""Command-line flags generated from the run's settings (RunConfig's tree, by flat name): `train` takes them all,
`plan` and `bench` the ones they share with it, so a shared flag has one name, type, choices and help everywhere.

A generated flag that is not given is absent from the parsed namespace (`argparse.SUPPRESS`): `given` then
lists only what the user typed, and `streamer.run.resolve` lays it over the `--config` file and the defaults.
"""
from __future__ import annotations

import argparse
import typing
from typing import Any, Callable, Iterable, Mapping

from memory_model.settings import Assignments, Choice, flag, flat_fields
from streamer.run import DEFAULTS, DEMO_DEFAULTS, FLAGS, RunConfig


def add_run_flags(parser: argparse.ArgumentParser, only: Iterable[str] | None = None,
                  defaults: Mapping[str, Any] | None = None, help: Mapping[str, str] | None = None) -> None:
    """One flag per run setting (those named in `only`, in the order of FLAGS), so the flags and run.toml's
    keys cannot drift apart. `defaults`: a command's own default for a field, stored in the namespace (a
    command that does not resolve a RunConfig, such as bench); `help`: a command's own help text for one
    (a text that names its own "(default: ...)" is shown as it is)."""
    names = None if only is None else set(only)
    defaults, help = defaults or {}, help or {}
    leaves, values = flat_fields(RunConfig), DEFAULTS.flat()
    for name in FLAGS:
        if names is not None and name not in names:
            continue
        path, f = leaves[name]
        hint = _hint(path)
        types = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
        if isinstance(f.metadata["check"], Choice):
            types = [str]  # (a store's placement is given by its tier)
        own = name in defaults
        default = defaults[name] if own else values[name]
        demo = f"; demo: {DEMO_DEFAULTS[name]}" if name in DEMO_DEFAULTS and not own else ""
        text = help.get(name, f.metadata["help"])
        shown = "" if "(default:" in text else f" (default: {default}{demo})"
        kwargs: dict[str, Any] = {"default": default if own else argparse.SUPPRESS}
        if isinstance(f.metadata["check"], Assignments):  # repeated: `--set a=1 --set b=2`
            kwargs.update(action="append", metavar=f.metadata["metavar"], help=text)
        elif types == [bool]:
            kwargs.update(action=argparse.BooleanOptionalAction, help=text + shown)
        elif typing.get_origin(hint) is tuple:
            kwargs.update(nargs="+", action=_Numbers, metavar=("B1", "B2"),
                          help=text + shown.replace(str(default), ",".join(map(str, default))))
        else:
            if isinstance(f.metadata["check"], Choice) and f.metadata["check"].bare is not None:
                kwargs.update(nargs="?", const=f.metadata["check"].bare)
            kwargs.update(type=types[0], metavar=f.metadata["metavar"] or {int: "N", float: "X"}[types[0]],
                          help=text + ("" if default is None else shown))
        parser.add_argument(flag(name), **kwargs)


def _hint(path: tuple[str, ...]) -> Any:
    """The type a run setting is declared with, by its owner."""
    owner = RunConfig
    for name in path[:-1]:
        owner = owner.__dataclass_fields__[name].metadata["branch"]
    return typing.get_type_hints(owner)[path[-1]]


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The run settings given as flags (a generated flag not given is absent from `args`)."""
    return {name: getattr(args, name) for name in FLAGS if hasattr(args, name)}


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
