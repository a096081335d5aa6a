"""Runs a schedule: prefetch the next resources, compute the current event, release what is done.

The loop reads as the pipeline it is — issue loads `prefetch` resources ahead, wait for the current one,
compute, hand results back, release — and every device byte it creates is charged to the ledger in
program order (never from the I/O thread), so the accounting is the same on every run. Each concern has
its own collaborator: `Loader` (loading and residency), `Passes` (forward and backward) and `Updater` (AdamW
and write-backs); the Executor owns the I/O threads and the step running, and dispatches the events.
"""
from __future__ import annotations

from memory_model.schedule import Event, fetched_input, is_fused, loads_keeping_master, releases, resident_sets
from streamer.runtime.loading import Loader
from streamer.runtime.passes import Passes
from streamer.runtime.step import StepContext
from streamer.runtime.update import Updater
from streamer.runtime.wiring import Runtime


class Executor:
    def __init__(self, rt: Runtime) -> None:
        """Runs `rt`'s units as its step settings say (streamer.runtime.wiring.Runtime): a training step where its
        store takes writes, forward passes only where it is only read."""
        self.step_cfg, self.trace, self.device = rt.step, rt.trace, rt.device
        self.transport, self.io = rt.transport, rt.io
        self.loader = Loader(rt)
        self.passes = Passes(rt, self.loader)
        self.updater = Updater(rt)
        self.compute_is_master = rt.compute_is_master  # the compute weights are the masters (one dtype): no copy
        self.current = StepContext([], 0, 0.0)  # the step running, or the last one (none yet)
        self._rt = rt

    @property
    def grad_sq_norms(self) -> dict[str, float]:
        """Per unit, the squared norm of the last step's final gradient, in backward order."""
        return self.passes.grad_sq_norms

    @grad_sq_norms.setter
    def grad_sq_norms(self, sq_norms: dict[str, float]) -> None:
        self.passes.grad_sq_norms = sq_norms

    def stored_numel(self, unit: str) -> int:
        """Elements of `unit` the store holds and the update walks: the unit, or this rank's slice of it."""
        return self.loader.stored_numel(unit)

    def run(self, events: list[Event], ctx: StepContext) -> None:
        self.current = ctx
        ctx.fused = is_fused(events)
        ctx.training = any(e.phase == "backward" for e in events)
        if ctx.training:
            self.passes.grad_sq_norms = {}
        keeping_master = iter(loads_keeping_master(events, self.step_cfg.prefetch))  # in the order loads are issued
        for i, (event, resident) in enumerate(zip(events, resident_sets(events, self.step_cfg.prefetch), strict=True)):
            self.loader.issue_ahead(resident, ctx, keeping_master)
            tensors = self.loader.acquire(event.resource, ctx)
            fetched = fetched_input(event)
            if fetched is not None:
                self.loader.acquire(fetched, ctx)  # a backward's block input, back from the host
            phase = "generate" if event.phase == "infer" else event.phase  # the trace's name for inference
            with self.trace.span(event.unit, phase, step=ctx.step, micro=event.micro):
                if event.phase == "forward":
                    self.passes.forward(event, ctx)
                elif event.phase == "backward":
                    self.passes.backward(event, ctx)
                elif event.phase == "infer":
                    self.passes.infer(event.unit, ctx)
                else:
                    self.updater.update(event.chunk, tensors, ctx, self.passes.grad_sq_norms)
            for resource in () if ctx.keep_loaded else releases(events, i):
                self.loader.release(resource, ctx)
        self.io.drain()
        write_backs, ctx.write_backs = ctx.write_backs, []
        for future in write_backs:
            future.result()  # a failed write (disk full, ...) must stop the step before it commits

    def clear_graphs(self) -> None:
        """After a forward-only pass: drop the hidden states it kept and the activations it charged."""
        self.passes.clear_graphs(self.current)

    def release_kept(self) -> None:
        """After passes that kept their units loaded (`StepContext.keep_loaded`): every unit leaves the device."""
        self.io.drain()
        self.loader.release_all(self.current)

    def abort(self) -> None:
        """A step stopped part-way: wait for the I/O in flight, release everything, discard the new versions."""
        self.io.drain()
        self.loader.release_all(self.current)
        self.passes.abort(self.current)
        self.updater.abort(self.current)

    def close(self) -> None:
        self._rt.close()
        self.current.discard_writers()
