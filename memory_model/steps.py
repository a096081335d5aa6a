"""The step as the runtime executes it (streamer/runtime/schedule.py), reduced to what costs memory and time.

Each event needs one resource: a unit's compute weights, or one update chunk's state (on the device, or on
the host for update_on="host"). When event k starts, its resource and the next `prefetch` distinct resources
are issued unless already in flight; when it ends, its resource is released unless the next event uses it
too (the head from its forward into its backward, the embedding from one micro-batch's backward into the
next one's forward). A resource released and needed again later is loaded again.
"""
from __future__ import annotations

from dataclasses import dataclass

from memory_model.shapes import ModelShape, PlanConfig

# ("weights", unit) or ("chunk", unit, start, count): hashable, equal when the runtime's resources are equal.
Resource = tuple


@dataclass(frozen=True)
class StepEvent:
    unit: str
    phase: str  # "forward" | "backward" | "update"
    micro: int
    resource: Resource


def step_events(shape: ModelShape, cfg: PlanConfig) -> list[StepEvent]:
    """Forward and backward of every micro-batch, then the update in chunks of <= update_chunk params."""
    units = shape.unit_names()
    events: list[StepEvent] = []
    for micro in range(cfg.grad_accum):
        events += [StepEvent(u, "forward", micro, ("weights", u)) for u in units]
        events += [StepEvent(u, "backward", micro, ("weights", u)) for u in reversed(units)]
    chunks = [(u, start, min(cfg.update_chunk, shape.unit_params(u) - start))
              for u in units for start in range(0, shape.unit_params(u), cfg.update_chunk)]
    # Under data parallel every device applies the whole update to its own copy (the runtime's choice).
    events += [StepEvent(u, "update", 0, ("chunk", u, start, count)) for u, start, count in chunks]
    return events


def lookahead(events: list[StepEvent], index: int, depth: int,
              last_backward: dict[str, int] | None = None) -> list[Resource]:
    """The next `depth` distinct resources after event `index`'s own, in order of first use.

    A unit's update state is not fetched while any of its backward events is still to run (its gradient is
    final only once the last micro-batch's backward has been offloaded), so the lookahead stops there.
    `last_backward` (unit -> index of its last backward event) may be passed to avoid recomputing it.
    """
    if last_backward is None:
        last_backward = _last_backward(events)
    current = events[index].resource
    seen: list[Resource] = []
    for k in range(index + 1, len(events)):  # not a slice: that would copy the whole tail per event
        if len(seen) >= depth:
            break
        event = events[k]
        if event.resource[0] == "chunk" and last_backward.get(event.unit, -1) >= index:
            break
        if event.resource != current and event.resource not in seen:
            seen.append(event.resource)
    return seen


def _last_backward(events: list[StepEvent]) -> dict[str, int]:
    return {e.unit: k for k, e in enumerate(events) if e.phase == "backward"}


def resident_sets(events: list[StepEvent], prefetch: int) -> list[list[Resource]]:
    """What is loaded or in flight while each event runs: its own resource, then its lookahead."""
    last_backward = _last_backward(events)
    return [[e.resource, *lookahead(events, k, prefetch, last_backward)] for k, e in enumerate(events)]
