"""GRPO's reward functions: Python functions with TRL's signature, `f(prompts, completions, **columns)` -> one
float (or None: unscorable) per completion, given by `module:function`, several summed with weights (TRL's
reward_funcs and reward_weights). A function that cannot be loaded, raises, or returns the wrong count is refused
in one line naming it."""
from __future__ import annotations

import importlib
import math
import os
import sys
from typing import Any, Callable, Mapping, Sequence

import torch

from streamer.errors import ConfigError, StreamerError

RewardFunction = Callable[..., Sequence[float | None]]


class RewardError(StreamerError):
    """A reward function failed on a batch of completions."""


def load_reward(spec: str) -> RewardFunction:
    """The function `module:function` names (the module imported as Python imports it, the working directory
    searched last)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ConfigError(f"reward function {spec!r} is not module:function (e.g. my_rewards:short)")
    if os.getcwd() not in sys.path:  # a module beside the data, as `python -m` would find it (the `streamer` script
        sys.path.append(os.getcwd())  # puts its own folder first instead)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"reward function {spec}: cannot import {module_name} ({exc})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"reward function {spec}: {module_name} has no function {name}")
    return function


class Rewards:
    """Reward functions (callables, or `module:function` strings) and their weights (None: 1 each)."""

    def __init__(self, functions: Sequence[RewardFunction | str], weights: Sequence[float] | None = None) -> None:
        if not functions:
            raise ConfigError("GRPO needs at least one reward function")
        if weights is not None and len(weights) != len(functions):
            raise ConfigError(f"{len(weights)} reward_weights for {len(functions)} reward functions; give one "
                              "weight per function")
        self.functions = [load_reward(f) if isinstance(f, str) else f for f in functions]
        self.weights = None if weights is None else [float(w) for w in weights]

    def names(self) -> list[str]:
        return [_name(f) for f in self.functions]

    def score(self, prompts: Sequence[Any], completions: Sequence[Any],
              columns: Mapping[str, Sequence[Any]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows,) weighted sums and (rows, functions) each function's rewards, fp32; None is NaN (an unscorable
        completion: left out of the sum, and NaN where every function gave None, as TRL)."""
        rows = len(completions)
        per_function = torch.empty(rows, len(self.functions))
        for i, function in enumerate(self.functions):
            try:
                out = list(function(prompts=list(prompts), completions=list(completions), **dict(columns or {})))
            except Exception as exc:  # the user's code: any failure is reported as the function's
                raise RewardError(f"reward function {_name(function)} raised {type(exc).__name__}: {exc}") from None
            if len(out) != rows:
                raise RewardError(f"reward function {_name(function)} returned {len(out)} rewards for {rows} "
                                  "completions; return one float per completion")
            try:
                per_function[:, i] = torch.tensor([math.nan if r is None else float(r) for r in out])
            except (TypeError, ValueError):
                raise RewardError(f"reward function {_name(function)} returned a non-number; return one float "
                                  "(or None) per completion") from None
        weights = torch.ones(len(self.functions)) if self.weights is None else torch.tensor(self.weights).float()
        total = (per_function * weights).nansum(dim=1)
        total[per_function.isnan().all(dim=1)] = math.nan
        return total, per_function


def _name(function: RewardFunction) -> str:
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', repr(function))}"
