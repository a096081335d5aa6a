"""Settings fields declared once: each with its default, the help text users read and the check of its value.

Every settings dataclass (the run's, the step's, the optimizer's) declares its fields with `setting(...)` and
calls `check_settings` in `__post_init__`: so a wrong value reads the same wherever it comes from (a flag, a
TOML file, a keyword argument), `must be a positive integer, got "3"`, and the flags, TOML keys and help text
are read from these fields rather than written again. A class's settings may nest other classes' as
branches (`branch`): a settings tree whose every setting keeps one flat name, its flag and TOML key, through
which the tree is read (`flatten`) and built (`build`). Torch-free, like the rest of memory_model.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


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


class Check(Protocol):
    """A setting's check (Integer, Choice, ... or a class of its own, such as memory_model.devices.Budget): the
    value, normalised, or None where it is wrong; and what it wants, for the message."""

    def __call__(self, value: Any) -> Any: ...

    def wanted(self) -> str: ...


def setting(default: Any, help: str, check: Check, metavar: str | None = None, optional: bool = False) -> Any:
    """A dataclass field with its help text and check (`default` MISSING: required); `optional`: None is also
    allowed (and means unset)."""
    return field(default=default, metadata={"help": help, "check": check, "metavar": metavar,
                                            "optional": optional or default is None})


def same_setting(owner: type[DataclassInstance], name: str, default: Any = MISSING, help: str | None = None) -> Any:
    """`owner`'s setting `name` declared again in another class (the runtime's step takes the planner's
    step settings): the same check and metavar; its own default or help where they differ."""
    meta = owner.__dataclass_fields__[name].metadata
    return setting(owner.__dataclass_fields__[name].default if default is MISSING else default,
                   meta["help"] if help is None else help, meta["check"], meta["metavar"], meta["optional"])


def branch(owner: type, default: Callable[[], Any] | None = None, prefix: str = "",
           names: Mapping[str, str] | None = None) -> Any:
    """A field holding `owner`'s settings as one config: the settings tree nests its owners' configs. Each of
    its settings keeps one flat name, its flag and TOML key: `prefix` + its name, or `names[its name]`."""
    return field(default_factory=default or owner,
                 metadata={"branch": owner, "prefix": prefix, "names": dict(names or {})})


def _outer(f: Field, name: str) -> str:
    return f.metadata["names"].get(name, f.metadata["prefix"] + name)


@functools.cache
def flat_fields(cls: type) -> dict[str, tuple[tuple[str, ...], Field]]:
    """Every setting of a settings tree by its flat name (its flag and TOML key): the path of field names
    that reaches it, and its declaration. Two settings of one tree never share a flat name."""
    out: dict[str, tuple[tuple[str, ...], Field]] = {}
    leaves = [(_outer(f, name), (f.name, *path), leaf) for f in fields(cls) if "branch" in f.metadata
              for name, (path, leaf) in flat_fields(f.metadata["branch"]).items()]
    leaves += [(f.name, (f.name,), f) for f in fields(cls) if "check" in f.metadata]
    for name, path, leaf in leaves:
        if name in out:
            raise TypeError(f"{cls.__name__} has two settings named {name}")
        out[name] = (path, leaf)
    return out


def flatten(obj: Any) -> dict[str, Any]:
    """A settings tree's values by flat name, in the tree's order."""
    out: dict[str, Any] = {}
    cls: type = type(obj)
    for name, (path, _) in flat_fields(cls).items():
        value = obj
        for step in path:
            value = getattr(value, step)
        out[name] = value
    return out


def check_flat(cls: type, flat: Mapping[str, Any], error: Callable[[str, str], Exception] = SettingError) -> None:
    """Each value's own check, by flat name, before any owner's checks of several values together."""
    known = flat_fields(cls)
    for name in flat:
        if name not in known:
            raise error(name, f"is not a setting; valid: {', '.join(known)}")
        problem = _problem(known[name][1], flat[name])
        if problem is not None:
            raise error(name, problem)


def _renaming(error: Callable[[str, str], Exception], renamed: Mapping[str, str]) -> Callable[[str, str], Exception]:
    """`error` naming a branch's setting by its flat name in the outer tree."""
    return lambda key, problem: error(renamed.get(key, key), problem)


def build(cls: type[T], flat: Mapping[str, Any], base: T | None = None,
          error: Callable[[str, str], Exception] = SettingError) -> T:
    """The settings tree `cls` from values by flat name, over `base` (default: `cls()`): the one place flags,
    TOML keys and keyword arguments become the tree. A wrong value is `error(its flat name, problem)`, whichever
    owner found it."""
    check_flat(cls, flat, error)
    base = cls() if base is None else base
    changes: dict[str, Any] = {}
    for f in fields(cls):
        if "branch" in f.metadata:
            inner = {name: flat[_outer(f, name)] for name in flat_fields(f.metadata["branch"])
                     if _outer(f, name) in flat}
            if inner:
                renamed = {name: _outer(f, name) for name in flat_fields(f.metadata["branch"])}
                changes[f.name] = build(f.metadata["branch"], inner, getattr(base, f.name), _renaming(error, renamed))
        elif f.name in flat:
            changes[f.name] = flat[f.name]
    try:
        return replace(base, **changes)
    except Exception as exc:  # an owner's own check: said again under the setting's flat name
        key, problem = getattr(exc, "key", None), getattr(exc, "problem", None)
        if key is None or problem is None:
            raise
        raise error(key, problem) from None


def check_settings(obj: Any, error: Callable[[str, str], Exception] = SettingError,
                   names: Sequence[str] | None = None) -> None:
    """Check (and normalise: ints to floats, lists to tuples) each `setting` field of a frozen dataclass;
    the first wrong one raises `error(key, "must be ..., got ...")`."""
    for f in fields(obj):
        if "check" not in f.metadata or (names is not None and f.name not in names):
            continue
        value = getattr(obj, f.name)
        problem = _problem(f, value)
        if problem is not None:
            raise error(f.name, problem)
        checked = f.metadata["check"](value)
        if checked is not value and checked is not None:
            object.__setattr__(obj, f.name, checked)


def _problem(f: Field, value: Any) -> str | None:
    """What is wrong with a setting's value, or None."""
    if (value is None and f.metadata["optional"]) or f.metadata["check"](value) is not None:
        return None
    return f"must be {f.metadata['check'].wanted()}, got {shown(value)}"


def checks_of(cls: type, kind: type) -> dict[str, Any]:
    """The checks of a settings tree's settings of one kind, by flat name: `checks_of(RunConfig, Choice)`."""
    return {name: f.metadata["check"] for name, (_, f) in flat_fields(cls).items()
            if isinstance(f.metadata["check"], kind)}

