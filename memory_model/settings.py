"""Settings fields declared once: each with its default, the help text users read and the check of its value.

Every settings dataclass (the run's, the step's, the optimizer's) declares its fields with `setting(...)` and
calls `check_settings` in `__post_init__`: so a wrong value reads the same wherever it comes from (a flag, a
TOML file, a keyword argument), `must be a positive integer, got "3"`, and the flags, TOML keys and help text
are read from these fields rather than written again. Torch-free, like the rest of memory_model.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Sequence


class SettingError(ValueError):
    """One setting's value is wrong: `key` names it, so an error can say where it came from (flag or file)."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{flag(key)} {problem}")
        self.key, self.problem = key, problem


def flag(name: str) -> str:
    """The command-line flag of a setting: `grad_accum` -> `--grad-accum`."""
    return "--" + name.replace("_", "-")


def shown(value: Any) -> str:
    """A value as the user wrote it: TOML and JSON agree on strings, numbers and lists."""
    if value is None:
        return "nothing"
    try:
        return json.dumps(list(value) if isinstance(value, tuple) else value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


@dataclass(frozen=True)
class Integer:
    """An int (never a bool) of at least `low`; `why` explains a minimum users would not guess."""

    low: int = 1
    why: str = ""

    def wanted(self) -> str:
        return ("a positive integer" if self.low == 1 else f"an integer >= {self.low}") + self.why

    def __call__(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.low:
            return None
        return value


@dataclass(frozen=True)
class Number:
    """A finite float (an int is taken as one) in [low, high], either end open; None: unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def wanted(self) -> str:
        if self.low == 0 and self.high is None:
            return "a positive number" if self.low_open else "a number >= 0"
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return "a number"

    def __call__(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        value = float(value)
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return None
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return None
        return value


@dataclass(frozen=True)
class Pair:
    """Two numbers, each passing `each` (TOML gives a list, the CLI a tuple): kept as a tuple of floats."""

    each: Number

    def wanted(self) -> str:
        return f"two numbers {self.each.wanted()}"

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            return None
        numbers = tuple(self.each(v) for v in value)
        return None if None in numbers else numbers


@dataclass(frozen=True)
class Choice:
    """One of `options`; `bare`: the value of the flag given without one (`--pack` means `--pack examples`)."""

    options: tuple[str, ...]
    bare: str | None = None

    def wanted(self) -> str:
        return "one of " + ", ".join(self.options)

    def __call__(self, value: Any) -> Any:
        return value if isinstance(value, str) and value in self.options else None


@dataclass(frozen=True)
class Text:
    def wanted(self) -> str:
        return "a string"

    def __call__(self, value: Any) -> Any:
        return value if isinstance(value, str) else None


@dataclass(frozen=True)
class Switch:
    def wanted(self) -> str:
        return "true or false"

    def __call__(self, value: Any) -> Any:
        return value if isinstance(value, bool) else None


@dataclass(frozen=True)
class Assignments:
    """`FIELD=NUMBER` items, each FIELD one of `names` (TOML gives a list, a repeated flag a list): kept as a tuple
    of the items as written. What each number may be is its owner's check (`devices.parse_sets`)."""

    names: tuple[str, ...]

    def wanted(self) -> str:
        return f"FIELD=NUMBER items with FIELD one of {', '.join(self.names)}"

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, (list, tuple)):
            return None
        for item in value:
            name, sep, number = item.partition("=") if isinstance(item, str) else ("", "", "")
            if not sep or name not in self.names or Number()(_number(number)) is None:
                return None
        return tuple(value)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


Check = Integer | Number | Pair | Choice | Text | Switch | Assignments


def setting(default: Any, help: str, check: Check, metavar: str | None = None, optional: bool = False) -> Any:
    """A dataclass field with its help text and check (`default` MISSING: required); `optional`: None is also
    allowed (and means unset)."""
    return field(default=default, metadata={"help": help, "check": check, "metavar": metavar,
                                            "optional": optional or default is None})


def same_setting(owner: type, name: str, default: Any = MISSING, help: str | None = None) -> Any:
    """`owner`'s setting `name` declared again in another class (the run's flat settings hold the step's and
    the optimizer's): the same check and metavar; its own default or help where they differ. The field
    remembers its owner, so `owned` can build the owner's config back from the flat class."""
    meta = owner.__dataclass_fields__[name].metadata
    taken = setting(owner.__dataclass_fields__[name].default if default is MISSING else default,
                    meta["help"] if help is None else help, meta["check"], meta["metavar"], meta["optional"])
    return field(default=taken.default, metadata={**taken.metadata, "owner": owner, "owner_name": name})


def owned(obj: Any, owner: type) -> dict[str, Any]:
    """The values of `obj`'s settings taken from `owner` with `same_setting`, by the owner's field names:
    `PlanConfig(**owned(run, PlanConfig), ...)`."""
    return {f.metadata["owner_name"]: getattr(obj, f.name) for f in fields(obj) if f.metadata.get("owner") is owner}


def check_settings(obj: Any, error: Callable[[str, str], Exception] = SettingError,
                   names: Sequence[str] | None = None) -> None:
    """Check (and normalise: ints to floats, lists to tuples) each `setting` field of a frozen dataclass;
    the first wrong one raises `error(key, "must be ..., got ...")`."""
    for f in fields(obj):
        if "check" not in f.metadata or (names is not None and f.name not in names):
            continue
        value = getattr(obj, f.name)
        if value is None and f.metadata["optional"]:
            continue
        checked = f.metadata["check"](value)
        if checked is None:
            raise error(f.name, f"must be {f.metadata['check'].wanted()}, got {shown(value)}")
        if checked is not value:
            object.__setattr__(obj, f.name, checked)


def checks_of(cls: type, kind: type) -> dict[str, Any]:
    """The checks of a dataclass's fields of one kind, by name: `checks_of(RunConfig, Choice)`."""
    return {f.name: f.metadata["check"] for f in fields(cls) if isinstance(f.metadata.get("check"), kind)}

