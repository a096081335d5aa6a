"""LRSchedule.lr_at gives every optimizer step the lr Hugging Face's schedulers give it."""
from __future__ import annotations

import pytest
import torch

from streamer.runtime.optim import LRSchedule

transformers = pytest.importorskip("transformers")

BASE_LR = 3e-4
CASES = [  # (warmup, total, kind, min ratio)
    (0, 1, "cosine", 0.0), (0, 7, "cosine", 0.0), (2, 4, "cosine", 0.0), (5, 40, "cosine", 0.0),
    (3, 17, "cosine", 0.1), (0, 9, "cosine", 0.25), (1, 2, "cosine", 1.0),
    (0, 1, "linear", 0.0), (0, 6, "linear", 0.0), (4, 30, "linear", 0.0),
    (0, 5, "constant", 0.0), (3, 10, "constant", 0.0), (1, 4, "constant", 0.0),
]


def hf_lrs(warmup: int, total: int, kind: str, ratio: float) -> list[float]:
    """The lr each of `total` optimizer steps runs with under transformers' scheduler."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
    if kind == "constant":
        scheduler = transformers.get_constant_schedule_with_warmup(optimizer, warmup)
    elif kind == "linear" and ratio == 0.0:
        scheduler = transformers.get_linear_schedule_with_warmup(optimizer, warmup, total)
    elif kind == "linear":
        scheduler = transformers.get_polynomial_decay_schedule_with_warmup(optimizer, warmup, total,
                                                                           lr_end=ratio * BASE_LR, power=1.0)
    elif ratio == 0.0:
        scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, warmup, total)
    else:
        scheduler = transformers.get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total,
                                                                             min_lr_rate=ratio)
    lrs = []
    for _ in range(total):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return lrs


def ours(warmup: int, total: int, kind: str, ratio: float) -> list[float]:
    schedule = LRSchedule(kind, warmup, None if kind == "constant" else total, ratio)
    return [schedule.lr_at(step, BASE_LR) for step in range(1, total + 1)]


@pytest.mark.parametrize("warmup,total,kind,ratio", CASES)
def test_lr_at_equals_transformers_every_step(warmup: int, total: int, kind: str, ratio: float) -> None:
    # Same float operations in the same order: bit-equal, no tolerance.
    assert ours(warmup, total, kind, ratio) == hf_lrs(warmup, total, kind, ratio)


@pytest.mark.parametrize("warmup,total,ratio", [(0, 6, 0.1), (4, 30, 0.2), (2, 5, 0.5)])
def test_linear_floor_is_hf_polynomial_decay_of_power_one(warmup: int, total: int, ratio: float) -> None:
    # HF has no linear schedule with a floor; its power-1 polynomial decay to ratio * lr is the same line,
    # computed in another order: measured relative difference at most 2.8e-16 (1 ulp).
    assert ours(warmup, total, "linear", ratio) == pytest.approx(hf_lrs(warmup, total, "linear", ratio),
                                                               rel=1e-15, abs=0)


def test_warmup_two_cosine_four_is_hf_example() -> None:
    assert ours(2, 4, "cosine", 0.0) == [0.0, 0.5 * BASE_LR, BASE_LR, 0.5 * BASE_LR]
