"""Runs a schedule: prefetch the next resources, compute the current event, release what is done.

The loop reads as the pipeline it is — issue loads `prefetch` resources ahead, wait for the current one,
compute, hand results back, release — and every device byte it creates is charged to the ledger in
program order (never from the I/O thread), so the accounting is the same on every run. Each concern has
its own collaborator: `Loader` (loading and residency), `Passes` (forward and backward) and `Updater` (AdamW
and write-backs); the Executor owns the I/O threads and the step running, and dispatches the events.
"""
from __future__ import annotations

from functools import partial

import torch

from layers import ModelConfig
from memory_model import Ledger, Trace
from memory_model.schedule import Event, fetched_input, is_fused, loads_keeping_master, releases, resident_sets
from memory_model.units import compute_is_master
from streamer.runtime.distributed import DataParallel
from streamer.runtime.loading import Loader
from streamer.runtime.lora import Adapters
from streamer.runtime.optim import OptimizerConfig
from streamer.runtime.passes import Passes
from memory_model.step import StepConfig
from streamer.runtime.step import StepContext
from streamer.runtime.transport import IOQueues, Transport
from streamer.runtime.update import Updater
from streamer.store.interface import StoreReader, StoreWriter
from streamer.store.layout import UnitLayout, dtype_name, expert_groups


class Executor:
    def __init__(self, cfg: ModelConfig, step: StepConfig, optimizer: OptimizerConfig, device: torch.device,
                 dtype: torch.dtype, store: StoreReader | None, ledger: Ledger, trace: Trace,
                 layouts: dict[str, UnitLayout], data_parallel: DataParallel | None = None,
                 adapters: Adapters | None = None, writer: StoreWriter | None = None, seed: int = 0) -> None:
        """Runs `cfg`'s units as `step` says, updating them as `optimizer` says, computing on `device` in `dtype`
        from a store placed as `step.store`. `store` is read by every run; `writer`, the same store where it takes
        writes, takes a training step's gradients and updates (None: the store is only read, and only forward
        passes run). `seed`: the run's, from which a bf16 master's stochastic rounding draws its bits."""
        self.step_cfg, self.trace, self.device = step, trace, device
        # A 4-bit base's units load as their byte slabs (UnitLayout.packed).
        packed = any(layout.packed is not None for layout in layouts.values())
        weights_dtype = torch.uint8 if packed else dtype
        self.transport = Transport(store, device, dtype, weights_dtype if packed else None, lambda: ledger.in_use)
        if device.type == "cpu":  # the device's bytes are the host's: idle buffers give way to what it allocates
            ledger.add_listener(lambda _: self.transport.buffers.trim())
        inline_fold = (device.type == "cpu" and store is not None and store.spec.placement.grad == "ram"
                       and data_parallel is None)
        self.io = IOQueues(threaded=device.type != "meta" and step.prefetch > 0, inline_fold=inline_fold)
        one_copy = compute_is_master(dtype_name(dtype), optimizer.master_dtype)
        self.loader = Loader(layouts, step, step.store, weights_dtype, one_copy, self.transport, self.io, ledger,
                             trace, data_parallel, expert_groups(cfg, step.expert_group_size, layouts))
        self.passes = Passes(cfg, step, layouts, self.loader, device, dtype, self.transport, self.io, ledger, trace,
                             store, writer, data_parallel, adapters)
        self.updater = Updater(step, optimizer, layouts, step.store, dtype, one_copy, self.transport, self.io,
                               ledger, trace, store, writer, data_parallel, seed)
        self.compute_is_master = one_copy  # the compute weights are the masters (one dtype): no copy
        self.current = StepContext([], 0, 0.0)  # the step running, or the last one (none yet)

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
                    assert ctx.infer is not None  # an inference pass says what to do with each unit
                    ctx.infer(event.unit, partial(self.passes.call_plain, event.unit, ctx))
                else:
                    self.updater.update(event.chunk, tensors, ctx, self.passes.grad_sq_norms)
            for resource in releases(events, i):
                self.loader.release(resource, ctx)
        self.io.drain()
        write_backs, ctx.write_backs = ctx.write_backs, []
        for future in write_backs:
            future.result()  # a failed write (disk full, ...) must stop the step before it commits

    def clear_graphs(self) -> None:
        """After a forward-only pass: drop the hidden states it kept and the activations it charged."""
        self.passes.clear_graphs(self.current)

    def abort(self) -> None:
        """A step stopped part-way: wait for the I/O in flight, release everything, discard the new versions."""
        self.io.drain()
        self.loader.release_all(self.current)
        self.passes.abort(self.current)
        self.updater.abort(self.current)

    def close(self) -> None:
        self.io.close()
        self.transport.close()
        self.current.discard_writers()
