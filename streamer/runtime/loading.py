"""Loading and residency: a step's streamed resources issued to the read queue ahead of their events, acquired
on the compute thread, and released when the schedule says.

The ledger is charged when a load is issued and credited when its resource is released, both on the main
thread, so the accounting is the same on every run whatever the I/O threads' timing.
"""
from __future__ import annotations

import concurrent.futures as cf
from functools import partial
from typing import Callable, Iterator, Sequence

import torch

from memory_model.schedule import (
    BlockInput, ExpertGroup, Resource, Weights, gathered_numel, resource_charges, shard_numel,
)
from streamer.runtime.residency import Residency, UnitState
from streamer.runtime.step import StepContext
from streamer.runtime.transport import Loaded
from streamer.runtime.wiring import Runtime


class Loader:
    """Each unit's device residency and the loads in flight: what is on the device, and what is coming."""

    def __init__(self, rt: Runtime) -> None:
        """Loads `rt`'s resources: weights loads in `rt.weights_dtype` (a 4-bit base's: bytes), the experts of the
        blocks in `rt.groups` a group at a time, their weights loads holding the rest."""
        layouts, step, groups = rt.layouts, rt.step, rt.groups
        self.layouts, self.step_cfg, self.dtype, self.groups = layouts, step, rt.weights_dtype, groups
        # One state per group of each grouped block: the handles its forward saves find its buffer through it.
        self.group_states = {(u, g): UnitState(f"{u} experts {g}") for u, e in groups.items() for g in range(e.count)}
        self.transport, self.io, self.ledger, self.trace = rt.transport, rt.io, rt.ledger, rt.trace
        self.on_host = step.update_on == "host"  # the update runs where the store lives
        self.states = {u: UnitState(u) for u in layouts}
        self.data_parallel = rt.data_parallel
        self.shards = rt.shards  # the slices of each unit's state
        # Weights loads read the master and cast it (the schedule's `master_from_weights`), for the run.
        self.loads_read_master = rt.placement.loads_read_master(rt.compute_is_master)
        self._inflight: dict[Resource, tuple[cf.Future[Loaded], list[int]]] = {}
        self._gathered: dict[str, torch.Tensor] = {}  # sharded: a unit's all-gathered weights, padding included

    def stored_numel(self, unit: str) -> int:
        """Elements of `unit` the store holds and the update walks: the unit, or this rank's slice of it."""
        return shard_numel(self.layouts[unit].numel, self.shards)

    def weights_numel(self, unit: str) -> int:
        """Elements of `unit`'s compute weights on the device (sharded: every rank's slice, all-gathered); a block
        whose experts load in groups: all but its experts."""
        groups = self.groups.get(unit)
        if groups is not None:
            return groups.rest.numel
        return gathered_numel([n for _, n in self.layouts[unit].device_parts], self.shards)

    def issue_ahead(self, resident: Sequence[Resource], ctx: StepContext, keeping_master: Iterator[bool]) -> None:
        """The prefetch: issue the load of every resource of the event's resident set not yet issued.
        `keeping_master` says, load by load in the order they are issued, whether it keeps the fp32 master."""
        for resource in resident:
            if resource not in self._inflight:
                self._issue(resource, ctx, keep_master=next(keeping_master))

    def _issue(self, resource: Resource, ctx: StepContext, keep_master: bool) -> None:
        step = ctx.step
        if isinstance(resource, BlockInput):  # an offloaded block input, back from host memory
            stashed = ctx.stashed.pop((resource.unit, resource.micro))
            host = stashed.tensors["input"]
            handles = [self.ledger.allocate(c.category, resource.unit, c.nbytes, c.what)
                       for c in resource_charges(resource, host.numel(), host.element_size(), self.step_cfg.update_on)]
            job = partial(self._traced, resource.unit, step, partial(self.transport.fetch_input, stashed))
            self._inflight[resource] = (self.io.reads.submit(job), handles)
            return
        layout, groups = self.layouts[resource.unit], self.groups.get(resource.unit)
        stored = self.stored_numel(resource.unit)
        if isinstance(resource, ExpertGroup):
            assert groups is not None  # a block loaded in groups
            on_device = groups.group.numel
        else:
            on_device = self.weights_numel(resource.unit)
        borrowed = [(owner, self.stored_numel(owner)) for _, owner in layout.borrowed]  # (a tied head)
        with self.transport.buffers.charging_loads():
            handles = [self.ledger.allocate(c.category, resource.unit, c.nbytes, c.what)
                       for c in resource_charges(resource, on_device, self.dtype.itemsize, self.step_cfg.update_on)]
        if isinstance(resource, Weights):
            self.states[resource.unit].residency = Residency.INFLIGHT
        if isinstance(resource, ExpertGroup) or (isinstance(resource, Weights) and groups is not None):
            # A grouped block's pieces of its slab: all but its experts, or one group of them.
            assert groups is not None  # a block loaded in groups
            ranges = groups.ranges(resource.group) if isinstance(resource, ExpertGroup) else groups.rest_ranges
            load = partial(self.transport.load_ranges, resource.unit, ranges, self.loads_read_master)
        elif isinstance(resource, Weights):
            load = partial(self.transport.load_weights, resource.unit, stored, self.loads_read_master, keep_master,
                           borrowed)
        else:
            load = partial(self.transport.load_state, resource.unit, resource.start, resource.count,
                           on_host=self.on_host, with_grad=resource.grad, with_master=resource.master)
        job = partial(self._traced, resource.unit, step, load)
        self._inflight[resource] = (self.io.reads.submit(job), handles)

    def _traced(self, unit: str, step: int, job: Callable[[], Loaded]) -> Loaded:
        with self.trace.span(unit, "load", step=step):
            return job()

    def acquire(self, resource: Resource, ctx: StepContext) -> dict[str, torch.Tensor]:
        """Wait for the resource's load; its weights become the unit's, its kept master the step's, a block input
        its backward's."""
        tensors = self._inflight[resource][0].result().wait()
        if isinstance(resource, BlockInput):
            ctx.inputs[resource.unit] = tensors["input"]
        if isinstance(resource, ExpertGroup):
            state = self.group_states[(resource.unit, resource.group)]
            state.buffer, state.residency = tensors["weights"], Residency.AVAILABLE
        if isinstance(resource, Weights):
            state = self.states[resource.unit]
            if "master" in tensors:
                ctx.kept_masters[resource.unit] = tensors["master"]
            if state.residency is not Residency.AVAILABLE:  # (the head's backward acquires what its forward did)
                state.buffer, state.residency = self._whole_unit(resource.unit, tensors["weights"]), Residency.AVAILABLE
        return tensors

    def load_group(self, group: ExpertGroup, ctx: StepContext) -> UnitState:
        """A group of a block's experts loaded now, inside the block's forward or backward (charged as it is
        issued); its state holds its buffer until `release`."""
        if group not in self._inflight:
            self._issue(group, ctx, keep_master=False)
        self.acquire(group, ctx)
        return self.group_states[(group.unit, group.group)]

    def _whole_unit(self, unit: str, weights: torch.Tensor) -> torch.Tensor:
        """The unit's weights as loaded, or (sharded) every rank's slices all-gathered on the device, here on the
        compute thread so that every rank issues its collectives in the same order. The load lays this rank's
        slice of each state the unit uses end to end (a tied head: the embedding's, then its own); each is
        gathered apart into the place its whole weights take, the next part overwriting its padding."""
        if self.shards == 1:
            return weights
        parts = self.layouts[unit].device_parts
        gathered = self.transport.device_buffer(gathered_numel([n for _, n in parts], self.shards), weights.dtype)
        loaded = whole = 0
        assert self.data_parallel is not None  # sharded only across ranks
        for owner, numel in parts:
            size = self.stored_numel(owner)
            self.data_parallel.gather_slices(gathered[whole:whole + size * self.shards], weights[loaded:loaded + size])
            loaded, whole = loaded + size, whole + numel
        if self.transport.owns(weights, unit, "compute"):  # (sharded means no fused update: no kept master)
            self.transport.give_back(weights)
        self._gathered[unit] = gathered
        return gathered[:whole]

    def release(self, resource: Resource, ctx: StepContext) -> None:
        """Credit the resource's charges; its weights (not a master the update still takes) leave the device."""
        future, handles = self._inflight.pop(resource)
        for handle in handles:
            self.ledger.free(handle)
        if isinstance(resource, ExpertGroup):
            state = self.group_states[(resource.unit, resource.group)]
            if state.buffer is not None:  # (None: issued, then the step was aborted)
                self.transport.give_back(state.buffer)
            state.buffer, state.residency = None, Residency.NOT_AVAILABLE
        if isinstance(resource, Weights):
            state = self.states[resource.unit]
            kept = ctx.kept_masters.get(resource.unit)
            gathered = self._gathered.pop(resource.unit, None)
            if gathered is not None:
                self.transport.give_back(gathered)
            elif (state.buffer is not None and state.buffer is not kept
                    and self.transport.owns(state.buffer, resource.unit, "compute")):
                self.transport.give_back(state.buffer)  # (None: loaded ahead, then the step was aborted)
            state.buffer, state.residency = None, Residency.NOT_AVAILABLE

    def release_all(self, ctx: StepContext) -> None:
        """A step stopped part-way (its I/O drained): release every resource issued."""
        for resource in list(self._inflight):
            self.release(resource, ctx)
