"""The step as the runtime executes it (streamer/schedule.py), reduced to what costs memory and time.

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
    # Data-parallel devices split the update: device 0 takes every devices-th chunk.
    events += [StepEvent(u, "update", 0, ("chunk", u, start, count)) for u, start, count in chunks[::cfg.devices]]
    return events


def lookahead(events: list[StepEvent], index: int, depth: int) -> list[Resource]:
    """The next `depth` distinct resources after event `index`'s own, in order of first use.

    A unit's update state is not fetched while any of its backward events is still to run (its gradient is
    final only once the last micro-batch's backward has been offloaded), so the lookahead stops there.
    """
    current = events[index].resource
    pending_backward = {e.unit for e in events[index:] if e.phase == "backward"}
    seen: list[Resource] = []
    for event in events[index + 1:]:
        if len(seen) >= depth:
            break
        if event.resource[0] == "chunk" and event.unit in pending_backward:
            break
        if event.resource != current and event.resource not in seen:
            seen.append(event.resource)
    return seen


def resident_sets(events: list[StepEvent], prefetch: int) -> list[list[Resource]]:
    """What is loaded or in flight while each event runs: its own resource, then its lookahead."""
    return [[e.resource, *lookahead(events, k, prefetch)] for k, e in enumerate(events)]
