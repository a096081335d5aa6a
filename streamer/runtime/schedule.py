"""A training step as an ordered list of compute events: the one place that knows the step's boundaries.

Each event names the resource it needs on the device (a unit's compute weights, or one chunk of a unit's
optimizer state). The executor keeps a resource on the device between consecutive events that share it
(the head from its forward into its backward; the embedding from one micro-batch's backward into the next
one's forward), prefetches the next `prefetch` distinct resources, and releases everything else.
"""
from __future__ import annotations

from dataclasses import dataclass

from streamer.store.host import chunks


@dataclass(frozen=True)
class Weights:
    unit: str


@dataclass(frozen=True)
class StateChunk:
    unit: str
    start: int
    count: int
    last: bool  # the unit's final chunk: its new state version can be closed after it


Resource = Weights | StateChunk


@dataclass(frozen=True)
class Event:
    phase: str  # "forward" | "backward" | "update" | "infer"
    resource: Resource
    micro: int = 0

    @property
    def unit(self) -> str:
        return self.resource.unit


def step_events(units: list[str], micro_batches: int, numels: dict[str, int], chunk: int,
                update_units: list[str] | None = None) -> list[Event]:
    """Forward and backward of every micro-batch, then the update of `update_units` (default: all).

    The update follows the whole backward because clipping needs the global gradient norm.
    """
    events: list[Event] = []
    for micro in range(micro_batches):
        events += [Event("forward", Weights(u), micro) for u in units]
        events += [Event("backward", Weights(u), micro) for u in reversed(units)]
    events += update_events(units if update_units is None else update_units, numels, chunk)
    return events


def update_events(units: list[str], numels: dict[str, int], chunk: int) -> list[Event]:
    events = []
    for unit in units:
        pieces = chunks(numels[unit], chunk)
        events += [Event("update", StateChunk(unit, start, count, i == len(pieces) - 1))
                   for i, (start, count) in enumerate(pieces)]
    return events


def forward_events(units: list[str]) -> list[Event]:
    """Evaluation: the training forward (loss in the head), without a backward."""
    return [Event("forward", Weights(u)) for u in units]


def inference_events(units: list[str]) -> list[Event]:
    """Generation: each unit called by the caller's code (KV caches, sampling) with its streamed weights."""
    return [Event("infer", Weights(u)) for u in units]


def lookahead(events: list[Event], index: int, depth: int) -> list[Resource]:
    """The next `depth` distinct resources after event `index`'s own, in order of first use.

    A unit's optimizer state is not fetched while any of its backward events is still to run: its
    gradient is final only after the last micro-batch's backward has been offloaded.
    """
    current = events[index].resource
    pending_backward = {e.unit for e in events[index:] if e.phase == "backward"}
    seen: list[Resource] = []
    for event in events[index + 1:]:
        if len(seen) >= depth:
            break
        if isinstance(event.resource, StateChunk) and event.unit in pending_backward:
            break
        if event.resource != current and event.resource not in seen:
            seen.append(event.resource)
    return seen
