"""Runs a schedule: prefetch the next resources, compute the current event, release what is done.

The loop reads as the pipeline it is — issue loads `prefetch` resources ahead, wait for the current one,
compute, hand results back, release — and every device byte it creates is charged to the ledger in
program order (never from the I/O thread), so the accounting is the same on every run.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
from collections import Counter
from typing import Callable, Sequence

import torch
from torch.func import functional_call

from layers import ModelConfig, build_unit
from layers.lora import add_adapters
from memory_model import Ledger, Trace
from memory_model.shapes import backward_workspace_bytes, loss_vocab_chunk
from memory_model.schedule import (
    Event, Resource, StateChunk, Weights, adapter_charges, gathered_numel, gradient_charges, is_fused,
    loads_keeping_master, released_after, resident_sets, resource_charges, shard_numel, update_charges,
)
from streamer.runtime.distributed import DataParallel
from streamer.store.layout import Placement, UnitLayout
from streamer.runtime.lora import Adapters
from streamer.runtime.optim import OptimizerConfig, adamw_chunk
from streamer.runtime.residency import Residency, SavedTensorRecorder, StreamedWeights, UnitState
from streamer.store.interface import StoreReader, StoreWriter
from streamer.runtime.step import ClippingNeeded, MicroBatch, PendingOffload, StepConfig, StepContext, clip_coefficient
from streamer.runtime.transport import IOQueues, Loaded, Transport


class Executor:
    def __init__(self, cfg: ModelConfig, step: StepConfig, optimizer: OptimizerConfig, device: torch.device,
                 dtype: torch.dtype, placement: Placement, store: StoreReader | None, ledger: Ledger, trace: Trace,
                 layouts: dict[str, UnitLayout], data_parallel: DataParallel | None = None,
                 adapters: Adapters | None = None, writer: StoreWriter | None = None) -> None:
        """Runs `cfg`'s units as `step` says, updating them as `optimizer` says, computing on `device` in `dtype`
        from a store placed as `placement`. `store` is read by every run; `writer`, the same store where it takes
        writes, takes a training step's gradients and updates (None: the store is only read, and only forward
        passes run)."""
        self.cfg, self.store, self.ledger, self.trace, self.layouts = cfg, store, ledger, trace, layouts
        self.step_cfg, self.optimizer, self.placement, self.writer = step, optimizer, placement, writer
        self.device, self.dtype = device, dtype
        self.on_host = step.update_on == "host"  # the update runs where the store lives
        self.transport = Transport(store, self.device, self.dtype)
        inline_fold = (self.device.type == "cpu" and store is not None and store.spec.placement.grad == "ram"
                       and data_parallel is None)
        self.io = IOQueues(threaded=self.device.type != "meta" and step.prefetch > 0, inline_fold=inline_fold)
        self.shells = {kind: build_unit(cfg, name) for kind, name in
                       (("embed", "embed"), ("block", "block.0"), ("head", "head"))}
        self.states = {u: UnitState(u) for u in layouts}
        self.recorder = SavedTensorRecorder(ledger)
        # LoRA: the base is frozen (no weight gradients, no update); the adapters are on the device for the run.
        self.adapters = adapters
        if adapters is not None:
            add_adapters(self.shells["block"], adapters.lora.target_names, adapters.lora.rank,
                         adapters.lora.scaling, adapters.lora.dropout)
            self.recorder.resident |= adapters.storages()
            for c in adapter_charges(adapters.numel()):
                ledger.allocate(c.category, "lora", c.nbytes, c.what)
        self.anchor = torch.zeros((), device=self.device, requires_grad=True)
        self.forward_calls: Counter[str] = Counter()  # tests check each block runs forward once per micro-batch
        self._inflight: dict[Resource, tuple[cf.Future[Loaded], list[int]]] = {}
        self.grad_sq_norms: dict[str, float] = {}  # per unit, of the step's final gradient, in backward order
        self.units = list(layouts)
        self.data_parallel = data_parallel
        self.shards = 1 if data_parallel is None else data_parallel.shards  # the slices of each unit's state
        # Weights loads read the fp32 master and cast it (the schedule's `master_from_weights`), for the run.
        self.loads_read_master = placement.loads_read_master(self.dtype == torch.float32)
        self._gathered: dict[str, torch.Tensor] = {}  # sharded: a unit's all-gathered weights, padding included
        self._scratch: torch.Tensor | None = None
        self.current = StepContext([], 0, 0.0)  # the step running, or the last one (none yet)

    # --- the pipeline ----------------------------------------------------------------------------
    def run(self, events: list[Event], ctx: StepContext) -> None:
        self.current = ctx
        ctx.fused = is_fused(events)
        ctx.training = any(e.phase == "backward" for e in events)
        if self.current.training:
            self.grad_sq_norms = {}
        keeping_master = iter(loads_keeping_master(events, self.step_cfg.prefetch))  # in the order loads are issued
        for i, (event, resident) in enumerate(zip(events, resident_sets(events, self.step_cfg.prefetch))):
            for resource in resident:
                if resource not in self._inflight:
                    self._issue(resource, ctx.step, keep_master=next(keeping_master))
            tensors = self._acquire(event.resource)
            phase = "generate" if event.phase == "infer" else event.phase  # the trace's name for inference
            with self.trace.span(event.unit, phase, step=ctx.step, micro=event.micro):
                if event.phase == "forward":
                    self._forward(event, tensors, ctx)
                elif event.phase == "backward":
                    self._backward(event, ctx)
                elif event.phase == "infer":
                    ctx.infer(event.unit, lambda *args, unit=event.unit: self._call_plain(unit, *args))
                else:
                    self._update(event.resource, tensors, ctx)
            if released_after(events, i):
                self._release(event.resource)
        self.io.drain()
        write_backs, self.current.write_backs = self.current.write_backs, []
        for future in write_backs:
            future.result()  # a failed write (disk full, ...) must stop the step before it commits

    def _issue(self, resource: Resource, step: int, keep_master: bool) -> None:
        numel = self.layouts[resource.unit].numel
        stored = self.stored_numel(resource.unit)
        on_device = gathered_numel(numel, self.shards)  # sharded: every rank's slice, all-gathered
        handles = [self.ledger.allocate(c.category, resource.unit, c.nbytes, c.what)
                   for c in resource_charges(resource, on_device, self.dtype.itemsize, self.step_cfg.update_on)]
        if isinstance(resource, Weights):
            self.states[resource.unit].residency = Residency.INFLIGHT
            job = lambda: self._traced(resource.unit, step, lambda: self.transport.load_weights(
                resource.unit, stored, self.loads_read_master, keep_master))
        else:
            job = lambda: self._traced(resource.unit, step, lambda: self.transport.load_state(
                resource.unit, resource.start, resource.count, on_host=self.on_host,
                with_grad=not self.current.fused, with_master=resource.master))
        self._inflight[resource] = (self.io.reads.submit(job), handles)

    def _traced(self, unit: str, step: int, job: Callable[[], Loaded]) -> Loaded:
        with self.trace.span(unit, "load", step=step):
            return job()

    def _acquire(self, resource: Resource) -> dict[str, torch.Tensor]:
        tensors = self._inflight[resource][0].result().wait()
        if isinstance(resource, Weights):
            state = self.states[resource.unit]
            if "master" in tensors:
                self.current.kept_masters[resource.unit] = tensors["master"]
            if state.residency is not Residency.AVAILABLE:  # (the head's backward acquires what its forward did)
                state.buffer, state.residency = self._whole_unit(resource.unit, tensors["weights"]), Residency.AVAILABLE
        return tensors

    def stored_numel(self, unit: str) -> int:
        """Elements of `unit` the store holds and the update walks: the unit, or this rank's slice of it."""
        return shard_numel(self.layouts[unit].numel, self.shards)

    def _whole_unit(self, unit: str, weights: torch.Tensor) -> torch.Tensor:
        """The unit's weights as loaded, or (sharded) every rank's slice all-gathered on the device, here on the
        compute thread so that every rank issues its collectives in the same order."""
        numel = self.layouts[unit].numel
        if weights.numel() == numel:
            return weights
        gathered = self.data_parallel.gather_slices(
            self.transport.device_buffer(weights.numel() * self.data_parallel.world, weights.dtype), weights)
        if self.transport.owns(weights, unit, "compute"):  # (sharded means no fused update: no kept master)
            self.transport.give_back(weights)
        self._gathered[unit] = gathered
        return gathered[:numel]

    def _release(self, resource: Resource) -> None:
        future, handles = self._inflight.pop(resource)
        for handle in handles:
            self.ledger.free(handle)
        if isinstance(resource, Weights):
            state = self.states[resource.unit]
            kept = self.current.kept_masters.get(resource.unit)
            gathered = self._gathered.pop(resource.unit, None)
            if gathered is not None:
                self.transport.give_back(gathered)
            elif (state.buffer is not None and state.buffer is not kept
                    and self.transport.owns(state.buffer, resource.unit, "compute")):
                self.transport.give_back(state.buffer)  # (None: loaded ahead, then the step was aborted)
            state.buffer, state.residency = None, Residency.NOT_AVAILABLE

    # --- forward and backward ------------------------------------------------------------------------
    def _call_unit(self, unit: str, x: torch.Tensor, micro: int, *args: object) -> torch.Tensor:
        layout = self.layouts[unit]
        kind = unit.split(".", 1)[0]
        self.forward_calls[unit] += 1
        if self.adapters is not None:  # a frozen base: its weights enter as plain views, without a gradient
            shell = self.shells[kind].train(self.current.training)
            named = {**layout.views(self.states[unit].weights()), **self.adapters.for_unit(unit, self.dtype)}
            with self.adapters.dropout_rng(self.current.step, micro, unit) if kind == "block" else contextlib.nullcontext():
                return functional_call(shell, named, (x, *args))
        params = StreamedWeights.apply(self.anchor, self.states[unit].weights(), layout,
                                       lambda grads: self._offload(unit, micro, grads))
        return functional_call(self.shells[kind], {s.key: p for s, p in zip(layout.slots, params)}, (x, *args))

    def _call_plain(self, unit: str, *args: object) -> torch.Tensor:
        """A unit's forward with its streamed weights and no autograd (generation)."""
        kind = unit.split(".", 1)[0]
        named = self.layouts[unit].views(self.states[unit].weights())
        if self.adapters is not None:
            named.update(self.adapters.for_unit(unit, self.dtype))
        with torch.no_grad():
            return functional_call(self.shells[kind].train(False), named, args)

    def _forward(self, event: Event, tensors: dict[str, torch.Tensor], ctx: StepContext) -> None:
        unit, micro = event.unit, event.micro
        batch = ctx.micro_batches[micro]
        if unit == "embed":
            with self.recorder.hooks(self.states[unit]):
                self.current.graphs[unit] = (batch.input_ids, self._call_unit(unit, batch.input_ids, micro))
            return
        previous = self._previous_output(unit)
        # A frozen base needs no gradient w.r.t. the embedding's output: the embedding has no backward.
        frozen_first = self.adapters is not None and self.units.index(unit) == 1
        if frozen_first:
            del self.current.graphs[self.units[0]]  # no backward will come for it
        x = previous.detach().requires_grad_(torch.is_grad_enabled() and not frozen_first)
        if unit == "head":
            with self.recorder.hooks(self.states[unit]):
                chunk = loss_vocab_chunk(self.cfg, batch.labels.numel())
                loss = self._call_unit(unit, x, micro, batch.labels, chunk, ctx.tokens)
            ctx.losses.append(loss.detach())  # this micro-batch's share of the step's token mean
            self.current.graphs[unit] = (x, loss)
        elif self.step_cfg.activations == "checkpoint":
            self.recorder.charge(unit, x, "checkpointed block input")
            with torch.no_grad():
                self.current.graphs[unit] = (x, self._call_unit(unit, x, micro, *_packed(batch)))
        else:
            with self.recorder.hooks(self.states[unit]):
                self.current.graphs[unit] = (x, self._call_unit(unit, x, micro, *_packed(batch)))

    def _previous_output(self, unit: str) -> torch.Tensor:
        names = list(self.layouts)
        return self.current.graphs[names[names.index(unit) - 1]][1]

    def _backward(self, event: Event, ctx: StepContext) -> None:
        unit, micro = event.unit, event.micro
        x, y = self.current.graphs.pop(unit)
        if unit == "head":
            nbytes = backward_workspace_bytes(self.cfg, unit, x.shape[0], x.shape[1], self.dtype.itemsize)
            logits_grad = self.ledger.allocate("workspace", unit, nbytes, "a vocabulary chunk's logits gradient")
            y.backward()
            self.ledger.free(logits_grad)
        else:
            incoming, incoming_handle = self.current.flowing_grad
            if unit.startswith("block") and self.step_cfg.activations == "checkpoint":
                with torch.enable_grad(), self.recorder.hooks(self.states[unit]):
                    # recompute: the only second forward, by policy
                    y = self._call_unit(unit, x, micro, *_packed(ctx.micro_batches[micro]))
            torch.autograd.backward(y, incoming)
            self.ledger.free(incoming_handle)
        del y
        self.recorder.release(unit)
        self.current.flowing_grad = None
        if unit != "embed" and x.grad is not None:  # (None: the first block of a frozen base)
            grad = x.grad
            self.current.flowing_grad = (grad, self.ledger.allocate("workspace", unit, grad.numel() * grad.element_size(),
                                                             "gradient w.r.t. the unit's input"))
        if unit == self.units[0] or (self.current.fused and micro == self.step_cfg.grad_accum - 1):
            self._finish_pending_offload()  # the update (or the next micro-batch) needs the gradient home
        if unit == self.units[0] and micro == self.step_cfg.grad_accum - 1 and self.shards > 1:
            self.grad_sq_norms = self.data_parallel.sum_squares(self.grad_sq_norms)  # of the whole gradients

    def _offload(self, unit: str, micro: int, grads: tuple[torch.Tensor, ...]) -> None:
        """StreamedWeights' backward: the unit's weight gradient (one tensor per parameter) leaves for the host
        accumulator.

        The previous unit's offload (and all-reduce, under data parallel) overlapped this unit's backward;
        it is finished only now, so at most one unit's gradient is on the device.
        """
        self._finish_pending_offload()
        ranks = 1 if self.data_parallel is None else self.data_parallel.world
        handles = [self.ledger.allocate(c.category, unit, c.nbytes, c.what)
                   for c in gradient_charges(sum(g.numel() for g in grads), grads[0].element_size(), ranks,
                                             self.shards > 1)]
        first, last = micro == 0, micro == self.step_cfg.grad_accum - 1
        reduction = self.data_parallel.start_reduce(grads) if self.data_parallel is not None else None
        step, persist = self.current.step, not (self.current.fused and last)
        job = lambda: self._traced_offload(unit, step, grads, first, last, reduction, persist)
        self.current.pending_offload = PendingOffload(unit, last, self.io.folds.submit(job), handles)

    def _traced_offload(self, unit: str, step: int, grads: Sequence[torch.Tensor], first: bool, last: bool,
                        reduction: object | None, persist: bool) -> tuple[float, torch.Tensor | None]:
        with self.trace.span(unit, "offload", step=step):
            if reduction is not None:
                grads = [self.data_parallel.finish_reduce(reduction)]
            if self.store is None:
                return 0.0, None
            host = self.transport.pieces_to_host(grads)
            if self.store.spec.placement.grad == "disk" and self._scratch is None:
                self._scratch = torch.empty(max(map(self.stored_numel, self.layouts)), dtype=torch.float32)
            scratch = None if self._scratch is None else self._scratch[:self.stored_numel(unit)]
            total = self.writer.accumulate_grad(unit, host, first, scratch, persist)
            if host is not grads:
                self.transport.give_back(host[0])
            # fp32, as torch's clip_grad_norm_ computes per-tensor norms; a float64 copy costs 25x more.
            return (float(torch.linalg.vector_norm(total)) ** 2, total) if last else (0.0, None)

    def _finish_pending_offload(self) -> None:
        pending, self.current.pending_offload = self.current.pending_offload, None
        if pending is None:
            return
        sq_norm, total = pending.future.result()
        for handle in pending.handles:
            self.ledger.free(handle)
        if pending.last:
            self.grad_sq_norms[pending.unit] = sq_norm
            if self.current.fused:
                self.current.final_grads[pending.unit] = total

    # --- update --------------------------------------------------------------------------------------
    def _update(self, chunk: StateChunk, tensors: dict[str, torch.Tensor], ctx: StepContext) -> None:
        if self.current.fused:
            tensors = self._fused_inputs(chunk, tensors, ctx)
        elif ctx.clip_coef is None:
            ctx.clip_coef = clip_coefficient(self.grad_sq_norms, self.optimizer.max_grad_norm, ctx.step)
            if ctx.on_first_update is not None:
                ctx.on_first_update(ctx)
        if not chunk.master:  # the master the unit's weights load kept, updated in place
            tensors = {**tensors, "master": self.transport.host_chunk(
                self.current.kept_masters[chunk.unit], chunk.start, chunk.count, on_host=self.on_host)}
        layout = self.layouts[chunk.unit]
        # Sharded, the chunk is of this rank's slice: decay is decided by where it sits in the whole unit.
        start = chunk.start + (0 if self.shards == 1 else self.data_parallel.slice_start(layout.numel))
        adamw_chunk(tensors, start, layout.decay_numel, self.optimizer, ctx.step, ctx.lr, ctx.clip_coef)
        if self.current.fused:
            grad = tensors.pop("grad")
            if grad.device.type != "cpu":
                self.transport.give_back(grad)  # a device copy; on the host it is the accumulator itself
        new_compute, handles = None, []
        if self.store_keeps_compute():
            new_compute = self.transport.compute_target(chunk.unit, chunk.start, chunk.count,
                                                        on_host=self.on_host)
            handles = [self.ledger.allocate(c.category, chunk.unit, c.nbytes, c.what)
                       for c in update_charges(chunk, self.dtype.itemsize, self.step_cfg.update_on)]
            new_compute.copy_(tensors["master"])
        job = lambda: self._write_back(chunk, tensors, new_compute, ctx.step)
        self.current.wait_for_writes(self.step_cfg.prefetch)
        self.current.write_backs.append(self.io.writes.submit(job))
        for handle in handles:
            self.ledger.free(handle)

    def _fused_inputs(self, chunk: StateChunk, tensors: dict[str, torch.Tensor],
                      ctx: StepContext) -> dict[str, torch.Tensor]:
        """A fused update chunk's state and its gradient from the backward, once the step so far allows it.

        It runs with clip coefficient 1 (`ctx.clip_coef`), so it stands only while the norm of the gradients
        summed so far keeps the coefficient at 1: the norm only grows, so a coefficient below 1 now is below
        1 for the step, and the step is made again after the backward (`ClippingNeeded`). A non-finite
        gradient stops the step here, before this unit's update, as it would before the separate update.
        """
        if chunk.start == 0 and clip_coefficient(self.grad_sq_norms, self.optimizer.max_grad_norm, ctx.step) != 1.0:
            raise ClippingNeeded(f"the gradient norm at {chunk.unit} makes step {ctx.step} clip")
        total = self.current.final_grads[chunk.unit]
        if chunk.last:
            del self.current.final_grads[chunk.unit]
        grad = self.transport.host_chunk(total, chunk.start, chunk.count, on_host=self.on_host)
        return {**tensors, "grad": grad}

    def store_keeps_compute(self) -> bool:
        """An update writes new compute-dtype weights: the store has a compute copy (in RAM), not fp32."""
        return self.dtype != torch.float32 and self.placement.compute == "ram"

    def _write_back(self, chunk: StateChunk, tensors: dict[str, torch.Tensor],
                    new_compute: torch.Tensor | None, step: int) -> None:
        if self.store is None:
            return
        with self.trace.span(chunk.unit, "offload", step=step):
            if chunk.unit not in self.current.writers:
                self.current.writers[chunk.unit] = self.writer.unit_writer(chunk.unit, step)
            writer = self.current.writers[chunk.unit]
            values = {**tensors, "compute": new_compute}
            for kind in ("master", "exp_avg", "exp_avg_sq", "compute"):
                if values[kind] is not None:
                    host = self.transport.to_host(values[kind])
                    writer.write(kind, chunk.start, host)
                    if host is not values[kind]:
                        self.transport.give_back(host)
            kept = self.current.kept_masters.get(chunk.unit)
            for kind, t in values.items():
                borrowed = kind == "master" and kept is not None and t.device == kept.device  # a view of it
                if t is not None and not borrowed and self.transport.owns(t, chunk.unit, kind):
                    self.transport.give_back(t)
            if chunk.last:
                self.current.writers.pop(chunk.unit).close()
                if kept is not None:
                    self.transport.give_back(self.current.kept_masters.pop(chunk.unit))

    def clear_graphs(self) -> None:
        """After a forward-only pass: drop the hidden states it kept and the activations it charged."""
        for unit in self.units:
            self.recorder.release(unit)
        self.current.graphs.clear()

    def abort(self) -> None:
        """A step stopped part-way: wait for the I/O in flight, release everything, discard the new versions."""
        self.io.drain()
        for resource in list(self._inflight):
            self._release(resource)
        if self.current.pending_offload is not None:
            for handle in self.current.pending_offload.handles:
                self.ledger.free(handle)
            self.current.pending_offload = None
        if self.current.flowing_grad is not None:
            self.ledger.free(self.current.flowing_grad[1])
            self.current.flowing_grad = None
        for unit in list(self.current.graphs):
            self.recorder.release(unit)
        self.current.graphs.clear()
        self.current.discard_writers()
        self.current.write_backs.clear()  # their failures were reported; the next step must not raise them again
        self.current.final_grads.clear()
        for master in self.current.kept_masters.values():
            self.transport.give_back(master)
        self.current.kept_masters.clear()

    def close(self) -> None:
        self.io.close()
        self.current.discard_writers()


def _packed(batch: MicroBatch) -> tuple[object, ...]:
    """A block's arguments after its input: none, or (start_pos, cache, positions) for packed examples."""
    return () if batch.positions is None else (0, None, batch.positions)
