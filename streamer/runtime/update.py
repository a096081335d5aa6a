"""The update: AdamW over one chunk of a unit's flat state, its inputs when fused into the backward, and the
new state written back to the store on the write queue."""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from memory_model.host import narrowed_buffer_bytes, narrowed_layout, narrows_write_backs, write_lag
from memory_model.schedule import StateChunk, shard_numel, update_charges
from streamer.runtime.optim import adamw_chunk, rounding_key
from streamer.runtime.step import ClippingNeeded, StepContext, clip_coefficient
from streamer.runtime.transport import HOST_UPDATE, WRITE_BACK, BufferPool
from streamer.runtime.wiring import Runtime
from streamer.store.quant import stored_into
from streamer.store.spec import STATE_KINDS


class Updater:
    """AdamW of the update events' chunks, and their write-backs."""

    def __init__(self, rt: Runtime) -> None:
        self.step_cfg, self.optimizer, self.layouts, self.placement = rt.step, rt.optimizer, rt.layouts, rt.placement
        self.precision, self.dtype, self.compute_is_master, self.seed = rt.precision, rt.dtype, rt.compute_is_master, \
            rt.seed
        self.transport, self.io, self.ledger, self.trace = rt.transport, rt.io, rt.ledger, rt.trace
        self.store, self.writer, self.data_parallel = rt.store, rt.writer, rt.data_parallel
        self.on_host = rt.step.update_on == "host"  # the update runs where the store lives
        self.shards = rt.shards
        frozen = self.store is None or self.store.spec.frozen
        # Narrowed write-backs, each in a buffer of its own from this pool (at most `lag` of them).
        self.narrowed = BufferPool() if narrows_write_backs(rt.step, frozen, self.transport.mode == "shared") \
            else None
        numels = {unit: shard_numel(layout.numel, self.shards) for unit, layout in self.layouts.items()}
        self.lag = 0 if self.narrowed is None else write_lag(rt.step)
        # The stored kinds' dtypes, and each narrowed buffer's bytes: the largest chunk's, as the plan charges.
        self.stored_dtypes = [] if self.store is None else \
            [self.store.spec.kind_dtype_name(kind) for kind in STATE_KINDS]
        self.narrowed_bytes = 0 if self.narrowed is None else narrowed_buffer_bytes(self.stored_dtypes, rt.step, numels)

    def update(self, chunk: StateChunk, tensors: dict[str, torch.Tensor], ctx: StepContext,
               grad_sq_norms: dict[str, float]) -> None:
        """AdamW over the chunk as loaded, clipped by the step's gradient norm (`grad_sq_norms`, per unit)."""
        if ctx.fused:
            tensors = self._fused_inputs(chunk, tensors, ctx, grad_sq_norms)
        elif ctx.clip_coef is None:
            ctx.clip_coef = clip_coefficient(grad_sq_norms, self.optimizer.max_grad_norm, ctx.step)
            if ctx.on_first_update is not None:
                ctx.on_first_update(ctx)
        if not chunk.master:  # the master the unit's weights load kept, updated in place
            tensors = {**tensors, "master": self.transport.host_chunk(
                ctx.kept_masters[chunk.unit], chunk.start, chunk.count, on_host=self.on_host)}
        layout = self.layouts[chunk.unit]
        # Sharded, the chunk is of this rank's slice: decay is decided by where it sits in the whole unit.
        start = chunk.start + (0 if self.shards == 1 or self.data_parallel is None  # (sharded only across ranks)
                               else self.data_parallel.slice_start(layout.numel))
        assert ctx.clip_coef is not None  # set by the step's first update, or before a fused one
        rounding = None if self.precision.master == "fp32" else rounding_key(self.seed, ctx.step, chunk.unit)
        with torch.profiler.record_function(HOST_UPDATE if self.on_host else "ws: update"):
            adamw_chunk(tensors, start, layout.decay_numel, self.optimizer, ctx.step, ctx.lr, ctx.clip_coef, rounding)
        if ctx.fused and not chunk.grad:
            grad = tensors.pop("grad")
            if grad.device.type != "cpu" or chunk.unit in ctx.backward_grads:
                self.transport.give_back(grad)  # a copy; on the host, else, it is the accumulator itself
        new_compute, handles = None, []
        if self.store_keeps_compute():
            new_compute = self.transport.compute_target(chunk.unit, chunk.start, chunk.count,
                                                        on_host=self.on_host)
            handles = [self.ledger.allocate(c.category, chunk.unit, c.nbytes, c.what)
                       for c in update_charges(chunk, self.dtype.itemsize, self.step_cfg.update_on)]
            new_compute.copy_(tensors["master"])
        if self.narrowed is not None:
            ctx.wait_for_writes(self.lag - 1)
            job = partial(self._write_back, chunk, *self._narrow(chunk, tensors, ctx), new_compute, ctx)
        else:
            ctx.wait_for_writes(self.step_cfg.prefetch)
            job = partial(self._write_back, chunk, tensors, partial(self._give_back, chunk, tensors, ctx),
                          new_compute, ctx)
        ctx.write_backs.append(self.io.writes.submit(job))
        for handle in handles:
            self.ledger.free(handle)
        if chunk.last and chunk.unit in ctx.backward_grads:  # its gradient, every chunk taken
            for handle in ctx.backward_grads.pop(chunk.unit).handles:
                self.ledger.free(handle)

    def _narrow(self, chunk: StateChunk, tensors: dict[str, torch.Tensor],
                ctx: StepContext) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
        """The chunk's new state in its stored form, in a buffer of its write-back's own, and what gives that
        buffer back once written. Its fp32 state and gradient go back now: a write-back that lags behind the
        next updates holds a bf16 master and int8 moments (4 B a parameter), not 16."""
        assert self.store is not None and self.narrowed is not None  # (narrows_write_backs)
        spec = self.store.spec
        starts = narrowed_layout(self.stored_dtypes, chunk.count)[0]
        buffer = self.narrowed.take(self.narrowed_bytes, torch.uint8)
        narrowed = {kind: stored_into(spec, kind, tensors[kind], buffer[at:at + spec.kind_bytes(kind, chunk.count)])
                    for kind, at in zip(STATE_KINDS, starts, strict=True)}
        self._give_back(chunk, tensors, ctx)
        return narrowed, partial(self.narrowed.give_back, buffer)

    def _fused_inputs(self, chunk: StateChunk, tensors: dict[str, torch.Tensor], ctx: StepContext,
                      grad_sq_norms: dict[str, float]) -> dict[str, torch.Tensor]:
        """A fused update chunk's state and its gradient from the backward, once the step so far allows it.

        A speculative step runs with clip coefficient 1 (`ctx.clip_coef`), so it stands only while the norm of
        the gradients summed so far keeps the coefficient at 1: the norm only grows, so a coefficient below 1
        now is below 1 for the step, and the step is made again knowing it (`ClippingNeeded`). The fused pass
        of a norm-first step knows its coefficient from its norm pass: below 1, nothing is speculative. A
        non-finite gradient stops the step here, before this unit's update, as it would before the separate
        update.
        """
        if chunk.start == 0:
            coef = clip_coefficient(grad_sq_norms, self.optimizer.max_grad_norm, ctx.step)
            if ctx.clip_coef == 1.0 and coef != 1.0:
                raise ClippingNeeded(f"the gradient norm at {chunk.unit} makes step {ctx.step} clip")
        total = ctx.final_grads[chunk.unit]
        if chunk.last:
            del ctx.final_grads[chunk.unit]
        if chunk.grad:  # a unit folded by chunk: its gradient was loaded with the chunk's state
            return tensors
        made = ctx.backward_grads.get(chunk.unit)
        if made is not None:  # the backward's own, on the device: the chunk in fp32, in a buffer of its own
            grad = self.transport.backward_chunk(made.pieces, chunk.start, chunk.count)
        else:
            grad = self.transport.host_chunk(total, chunk.start, chunk.count, on_host=self.on_host)
        return {**tensors, "grad": grad}

    def store_keeps_compute(self) -> bool:
        """An update writes new compute-dtype weights: the store has a compute copy (in RAM), in a dtype other
        than the master's."""
        return not self.compute_is_master and self.placement.compute.zero_copy

    def _give_back(self, chunk: StateChunk, tensors: dict[str, torch.Tensor], ctx: StepContext) -> None:
        """The update's buffers, once its new state is written or narrowed: the chunk's, and after a unit's last
        chunk the master its weights load kept (the chunks' masters were views of it)."""
        kept = ctx.kept_masters.get(chunk.unit)
        for kind, t in tensors.items():
            borrowed = kind == "master" and kept is not None and t.device == kept.device  # a view
            if not borrowed and self.transport.owns(t, chunk.unit, kind):
                self.transport.give_back(t)
        if chunk.last and kept is not None:
            self.transport.give_back(ctx.kept_masters.pop(chunk.unit))

    def _write_back(self, chunk: StateChunk, tensors: dict[str, torch.Tensor], release: Callable[[], None],
                    new_compute: torch.Tensor | None, ctx: StepContext) -> None:
        """Write the chunk's new state (`tensors`) and compute weights, then `release` what held them."""
        if self.store is None:
            return
        assert self.writer is not None  # a store that an update writes to takes writes
        with self.trace.span(chunk.unit, "offload", step=ctx.step), torch.profiler.record_function(WRITE_BACK):
            if chunk.unit not in ctx.writers:
                ctx.writers[chunk.unit] = self.writer.unit_writer(chunk.unit, ctx.step)
            writer = ctx.writers[chunk.unit]
            values = {**tensors, "compute": new_compute}
            for kind in ("master", "exp_avg", "exp_avg_sq", "compute"):
                value = values[kind]
                if value is not None:
                    host = self.transport.to_host(value)
                    writer.write(kind, chunk.start, host)
                    if host is not value:
                        self.transport.give_back(host)
            if new_compute is not None and self.transport.owns(new_compute, chunk.unit, "compute"):
                self.transport.give_back(new_compute)
            release()
            if chunk.last:
                ctx.writers.pop(chunk.unit).close()

    def abort(self, ctx: StepContext) -> None:
        """A step stopped part-way (its writes drained): discard the new versions and the update's inputs."""
        ctx.discard_writers()
        ctx.write_backs.clear()  # their failures were reported; the next step must not raise them again
        ctx.final_grads.clear()
        for made in ctx.backward_grads.values():
            for handle in made.handles:
                self.ledger.free(handle)
        ctx.backward_grads.clear()
        for master in ctx.kept_masters.values():
            self.transport.give_back(master)
        ctx.kept_masters.clear()
