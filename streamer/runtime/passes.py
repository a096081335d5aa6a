"""Forward and backward: calling a unit with its streamed weights, the gradient flowing between units, and
each unit's weight gradient offloaded to the host accumulator while the next unit's backward runs."""
from __future__ import annotations

import contextlib
from collections import Counter
from functools import partial
from typing import Iterator

import torch
from torch import nn
from torch.func import functional_call

from layers import build_unit, unit_kind
from layers.lora import add_adapters
from layers.loss import ReferenceOf, TokenMean
from layers.model import family_units
from layers.moe.units import Experts, sparse_mlp
from layers.quant4 import dequantized_into, quantize_linears
from memory_model.schedule import (
    Event, ExpertGroup, adapter_charges, folded_by_chunk, gradient_charges, resource_charges, updated_from_backward,
)
from memory_model.lora import dequantized_bytes
from memory_model.shapes import backward_workspace_bytes, block_backward_transient_bytes, loss_vocab_chunk
from streamer.runtime.distributed import Reduction
from streamer.runtime.loading import Loader
from streamer.runtime.residency import SavedTensorRecorder, StreamedWeights, UnitState
from streamer.runtime.step import BackwardGradient, MicroBatch, PendingOffload, StepContext
from streamer.runtime.transport import GRADIENT_FOLD
from streamer.runtime.wiring import Runtime
from streamer.store.layout import DTYPES


class Passes:
    """The units' forward and backward over the weights `states` holds, and the step's gradient norms."""

    def __init__(self, rt: Runtime, loader: Loader) -> None:
        """`loader` holds the units' weights (`states`), and loads the groups of a block's experts where they
        load in groups (`groups`)."""
        cfg, layouts, ledger, adapters, data_parallel = rt.cfg, rt.layouts, rt.ledger, rt.adapters, rt.data_parallel
        self.cfg, self.step_cfg, self.layouts, self.loader = cfg, rt.step, layouts, loader
        self.states, self.groups, self.stored_numel = loader.states, loader.groups, loader.stored_numel
        self.dtype = dtype = rt.dtype
        self.transport, self.io, self.ledger, self.trace = rt.transport, rt.io, ledger, rt.trace
        self.store, self.writer, self.data_parallel = rt.store, rt.writer, data_parallel
        self.shards = rt.shards
        self.units = list(layouts)
        # Units whose weights another unit borrows (a tied head's embedding): that unit's backward, earlier in
        # each micro-batch, starts their accumulator, so their own backward always adds to it.
        self.lent = cfg.params().lenders()
        kinds: dict[str, nn.Module] = {}  # one module shell per kind of unit; only the weights differ
        for unit in self.units:
            if unit_kind(cfg, unit) not in kinds:
                kinds[unit_kind(cfg, unit)] = build_unit(cfg, unit)
        self.shells = {unit: kinds[unit_kind(cfg, unit)] for unit in self.units}
        self.recorder = SavedTensorRecorder(ledger)
        # LoRA: the base is frozen (no weight gradients, no update); the adapters are on the device for the run.
        self.adapters = adapters
        if adapters is not None:
            packed = next((layouts[u].packed for u in self.units if u.startswith("block.")), None)
            lora = adapters.lora
            for kind, shell in kinds.items():
                if kind not in ("embed", "head"):
                    if packed is not None:  # a 4-bit base's blocks (the head's lm_head stays 16-bit)
                        quantize_linears(shell, packed.quant, DTYPES[lora.bnb_4bit_compute_dtype]
                                         if lora.bnb_4bit_compute_dtype else dtype, cfg.lora().projections)
                    add_adapters(shell, adapters.targets, adapters.lora.rank, adapters.lora.scaling,
                                 adapters.lora.dropout)
            self.recorder.resident |= adapters.storages()
            for c in adapter_charges(adapters.numel()):
                ledger.allocate(c.category, "lora", c.nbytes, c.what)
        self.anchor = torch.zeros((), device=rt.device, requires_grad=True)
        # A micro-batch's auxiliary loss (a mixture's router load balance), where the config asks for one: scaled
        # by the processes as the language-model loss is (each micro-batch's summed cross-entropy over the step's
        # tokens over the processes), so the all-reduce's mean sums it over them, as HF Trainer does (its loss
        # times the processes with average_tokens_across_devices).
        self.auxiliary = family_units(cfg).auxiliary
        self.processes = 1 if data_parallel is None else data_parallel.world
        self.device = rt.device
        self.forward_calls: Counter[str] = Counter()  # tests check each block runs forward once per micro-batch
        self.grad_sq_norms: dict[str, float] = {}  # per unit, of the step's final gradient, in backward order
        self._scratch: torch.Tensor | None = None
        self.by_chunk = folded_by_chunk(cfg, rt.step, rt.shards)  # units folded through their files by blocks
        # Of those, the units whose fused update takes its gradient from the backward, not from their files.
        self.from_backward = updated_from_backward(cfg, rt.step, self.processes)
        # A grouped block's expert gradients on the host, by group, until the rest of its gradient joins them.
        self._expert_grads: dict[str, dict[int, list[torch.Tensor]]] = {}

    def _call_unit(self, unit: str, x: torch.Tensor, micro: int, ctx: StepContext, *args: object,
                   recompute: bool = False) -> torch.Tensor:
        layout = self.layouts[unit]
        kind = unit.split(".", 1)[0]
        self.forward_calls[unit] += 1
        auxiliary = ctx.auxiliary.get(micro) if kind == "block" else None
        # A block adds to the micro-batch's auxiliary loss in its forward; its recompute adds nothing again.
        with contextlib.nullcontext() if auxiliary is None else auxiliary.recording(counting=not recompute):
            if self.adapters is not None:  # a frozen base: its weights enter as plain views, without a gradient
                shell = self.shells[unit].train(ctx.training)
                named = {**layout.views(self.states[unit].weights()),
                         **self.adapters.for_unit(unit, self.dtype, off=ctx.adapters_off)}
                with self.adapters.dropout_rng(ctx.step, micro, unit) if kind == "block" else contextlib.nullcontext():
                    return functional_call(shell, named, (x, *args))
            groups = self.groups.get(unit)
            layout = layout if groups is None else groups.rest
            params = StreamedWeights.apply(self.anchor, self.states[unit].weights(), layout,
                                           lambda grads: self._offload(unit, micro, grads, ctx))
            with self._experts_from(unit, ctx):
                return functional_call(self.shells[unit], dict(zip(layout.keys, params, strict=True)), (x, *args))

    @contextlib.contextmanager
    def _experts_from(self, unit: str, ctx: StepContext) -> Iterator[None]:
        """A grouped block's experts, while its shell runs, take their weights a group at a time from the loader."""
        groups = self.groups.get(unit)
        if groups is None:
            yield
            return
        experts = self.shells[unit].get_submodule(sparse_mlp(self.cfg).keys[0].rpartition(".")[0])
        assert isinstance(experts, Experts)  # a mixture's experts module
        experts.source = _GroupSource(self, unit, ctx, groups.count)
        try:
            yield
        finally:
            experts.source = None

    def call_plain(self, unit: str, ctx: StepContext, *args: object, adapters_off: bool = False) -> torch.Tensor:
        """A unit's forward with its streamed weights and no autograd (generation; with `adapters_off`, LoRA's
        frozen base: DPO's reference model)."""
        groups = self.groups.get(unit)
        named = (self.layouts[unit] if groups is None else groups.rest).views(self.states[unit].weights())
        if self.adapters is not None:
            named.update(self.adapters.for_unit(unit, self.dtype, off=adapters_off))
        with torch.no_grad(), self._experts_from(unit, ctx):
            return functional_call(self.shells[unit].train(False), named, args)

    def infer(self, unit: str, ctx: StepContext) -> None:
        """An inference pass's unit (generation): what `ctx.infer` does with it, given the unit's call; a quantized
        base's block charges its dequantized weight meanwhile, as a step's forward does."""
        assert ctx.infer is not None  # an inference pass says what to do with each unit
        with self._dequantizing(unit):
            ctx.infer(unit, partial(self.call_plain, unit, ctx))

    def forward(self, event: Event, ctx: StepContext) -> None:
        unit, micro = event.unit, event.micro
        batch = ctx.micro_batches[micro]
        if unit == "embed":
            with self.recorder.hooks(self.states[unit]):
                ctx.graphs[unit] = (batch.input_ids, self._call_unit(unit, batch.input_ids, micro, ctx))
            return
        with self._dequantizing(unit):
            if batch.objective is not None and batch.objective.reference_in_step:
                self._reference(unit, event.micro, ctx)
            self._forward(event, batch, ctx)

    def _reference(self, unit: str, micro: int, ctx: StepContext) -> None:
        """The reference model's forward of the unit, before the policy's, on the weights loaded for both: LoRA's
        base with the adapters off, without autograd. Its hidden state, the embedding's output at first (the
        embedding has no adapters), is charged from the first block's forward to the head's, which hands the
        reference's log-probabilities to the micro-batch's objective."""
        batch = ctx.micro_batches[micro]
        objective = batch.objective
        assert objective is not None  # one whose reference the step computes
        if unit == self.units[1]:
            hidden = ctx.graphs[self.units[0]][1]
            assert hidden is not None  # the embedding's output
            handle = self.ledger.allocate("activations", unit, hidden.numel() * hidden.element_size(),
                                          "the reference model's hidden state")
        else:
            hidden, handle = ctx.references.pop(micro)
        if unit == "head":
            self.call_plain(unit, ctx, hidden, batch.labels, loss_vocab_chunk(self.cfg, batch.labels.numel()),
                            ReferenceOf(objective))
            self.ledger.free(handle)
            return
        ctx.references[micro] = (self.call_plain(unit, ctx, hidden, *_packed(batch), adapters_off=True), handle)

    def _forward(self, event: Event, batch: MicroBatch, ctx: StepContext) -> None:
        unit, micro = event.unit, event.micro
        before = self.units[self.units.index(unit) - 1]
        kept, previous = ctx.graphs[before]
        if kept is None:  # an offloaded block: its output is this unit's input, to keep or to offload
            ctx.graphs[before] = (None, None)
        # A frozen base needs no gradient w.r.t. the embedding's output: the embedding has no backward.
        frozen_first = not self._input_needs_grad(unit)
        if frozen_first:
            del ctx.graphs[self.units[0]]  # no backward will come for it
        assert previous is not None  # the previous unit's output, kept or offloaded
        x = previous.detach().requires_grad_(torch.is_grad_enabled() and not frozen_first)
        if unit == self.units[1]:
            self._start_auxiliary(unit, micro, ctx)
        if unit == "head":
            with self.recorder.hooks(self.states[unit]):
                chunk = loss_vocab_chunk(self.cfg, batch.labels.numel())
                objective = batch.objective or TokenMean(ctx.tokens)
                loss = self._call_unit(unit, x, micro, ctx, batch.labels, chunk, objective)
            for name, value in objective.metrics().items():
                ctx.metrics[name] = ctx.metrics[name] + value if name in ctx.metrics else value
            auxiliary = ctx.auxiliary.get(micro)
            # This micro-batch's share of the step's token mean, and its auxiliary term (whose gradient the blocks'
            # backward adds).
            ctx.losses.append(loss.detach() if auxiliary is None else loss.detach() + auxiliary.value())
            ctx.graphs[unit] = (x, loss)
        elif event.stash is not None:
            self._forward_offloaded(event, x, ctx)
        elif self.step_cfg.activations != "resident":  # (offload without a backward to come keeps it as this)
            self.recorder.charge(unit, x, "checkpointed block input")
            with torch.no_grad():
                ctx.graphs[unit] = (x, self._call_unit(unit, x, micro, ctx, *_packed(batch)))
        else:
            with self.recorder.hooks(self.states[unit]):
                ctx.graphs[unit] = (x, self._call_unit(unit, x, micro, ctx, *_packed(batch)))

    def _start_auxiliary(self, unit: str, micro: int, ctx: StepContext) -> None:
        """The micro-batch's auxiliary loss, where the config asks for one: its sums are charged to the first
        block, from its forward to its backward, the last to read them."""
        auxiliary = self.auxiliary(self.cfg, self.processes, self.device, ctx.micro_batches[micro].attention_mask)
        if auxiliary is not None:
            ctx.auxiliary[micro] = auxiliary
            self.recorder.charge(unit, auxiliary.state, "the auxiliary loss's sums")

    def _forward_offloaded(self, event: Event, x: torch.Tensor, ctx: StepContext) -> None:
        """A block's forward without a graph, its input copied to host memory meanwhile: the input is charged
        to the device until the copy is waited for, at the forward's end, and then leaves it."""
        unit, micro = event.unit, event.micro
        assert event.stash is not None  # a forward that offloads its input
        handles = [self.ledger.allocate(c.category, unit, c.nbytes, c.what)
                   for c in resource_charges(event.stash, x.numel(), x.element_size(), self.step_cfg.update_on)]
        copy = self.transport.stash_input(x)
        with torch.no_grad():
            y = self._call_unit(unit, x, micro, ctx, *_packed(ctx.micro_batches[micro]))
        copy.wait()
        ctx.stashed[(unit, micro)] = copy
        self.transport.drop(x)
        for handle in handles:
            self.ledger.free(handle)
        ctx.graphs[unit] = (None, y)

    def _input_needs_grad(self, unit: str) -> bool:
        """False for the first block of a frozen base: nothing before it takes a gradient."""
        return self.adapters is None or self.units.index(unit) != 1

    def backward(self, event: Event, ctx: StepContext) -> None:
        unit, micro = event.unit, event.micro
        x, y = ctx.graphs.pop(unit)
        if event.stash is not None:  # the input back from the host (the loader acquired it)
            x = ctx.inputs.pop(unit).detach().requires_grad_(self._input_needs_grad(unit))
            self.recorder.charged_elsewhere(unit, x)  # the loaded BlockInput holds its bytes
        assert x is not None  # kept by the forward, or back from the host
        if unit == "head":
            assert y is not None  # the loss
            nbytes = backward_workspace_bytes(self.cfg, unit, x.shape[0], x.shape[1], self.dtype.itemsize)
            logits_grad = self.ledger.allocate("workspace", unit, nbytes, "a vocabulary chunk's logits gradient")
            with self._making_gradient(unit):
                y.backward()
            self.ledger.free(logits_grad)
        else:
            assert ctx.flowing_grad is not None  # the gradient from the unit after it
            incoming, incoming_handle = ctx.flowing_grad
            transient = self._charge_transient(unit, x)
            try:
                with self._dequantizing(unit), self._making_gradient(unit):
                    if unit.startswith("block") and self.step_cfg.activations != "resident":
                        with torch.enable_grad(), self.recorder.hooks(self.states[unit]):
                            # recompute: the only second forward, by policy
                            y = self._call_unit(unit, x, micro, ctx, *_packed(ctx.micro_batches[micro]),
                                                recompute=True)
                    assert y is not None  # kept by the forward, or just recomputed
                    torch.autograd.backward(y, incoming)
            finally:  # (a step stopped in this backward leaves nothing of it charged)
                if transient is not None:
                    self.ledger.free(transient)
            self.ledger.free(incoming_handle)
        del y
        self.recorder.release(unit)
        if unit == self.units[1]:
            ctx.auxiliary.pop(micro, None)
        ctx.flowing_grad = None
        if unit != "embed" and x.grad is not None:  # (None: the first block of a frozen base)
            grad = x.grad
            ctx.flowing_grad = (grad, self.ledger.allocate("workspace", unit, grad.numel() * grad.element_size(),
                                                           "gradient w.r.t. the unit's input"))
        if unit == self.units[0] or (ctx.fused and micro == self.step_cfg.grad_accum - 1):
            self._finish_pending_offload(ctx)  # the update (or the next micro-batch) needs the gradient home
        if unit == self.units[0] and micro == self.step_cfg.grad_accum - 1 and self.shards > 1:
            assert self.data_parallel is not None  # several shards only across ranks
            self.grad_sq_norms = self.data_parallel.sum_squares(self.grad_sq_norms)  # of the whole gradients

    def _making_gradient(self, unit: str) -> contextlib.AbstractContextManager[None]:
        """While `unit`'s backward runs: autograd makes its weight gradient before the sink charges it
        (`_offload`), so the device's buffer pool makes room for it first (`BufferPool.reserving`). A frozen base
        makes none."""
        if self.adapters is not None:
            return contextlib.nullcontext()
        return self.transport.buffers.reserving(self.loader.weights_numel(unit) * self.dtype.itemsize)

    @contextlib.contextmanager
    def _dequantizing(self, unit: str) -> Iterator[None]:
        """A quantized base's block (4-bit, 8-bit, GGUF): the weight each matmul dequantizes, one at a time, charged
        from the start of its forward or backward to its end (memory_model.lora.dequantized_bytes). A 4-bit base's
        are dequantized into one buffer of those bytes (layers.quant4.dequantized_into), not each into its own."""
        if self.adapters is None or self.layouts[unit].packed is None or not unit.startswith("block."):
            yield
            return
        lora = self.adapters.lora
        nbytes = dequantized_bytes(self.cfg, lora, unit, self.dtype.itemsize)
        handle = self.ledger.allocate("workspace", unit, nbytes, "a projection's weight dequantized for its matmul")
        into = dequantized_into(torch.empty(nbytes, dtype=torch.uint8, device=self.device)) if lora.load_in_4bit \
            else contextlib.nullcontext()
        try:
            with into:
                yield
        finally:
            self.ledger.free(handle)

    def _charge_transient(self, unit: str, x: torch.Tensor) -> int | None:
        """A trained block's backward: autograd's buffers beyond its charges, and its output (held until the
        backward ends), charged from its start (memory_model.shapes.block_backward_transient_bytes)."""
        if not unit.startswith("block") or self.adapters is not None:
            return None
        groups = self.groups.get(unit)
        group = 0 if groups is None else self.cfg.params().experts() // groups.count
        nbytes = block_backward_transient_bytes(self.cfg, x.shape[0], x.shape[1], self.dtype.itemsize, group)
        return self.ledger.allocate("workspace", unit, nbytes, "autograd's buffers in the block's backward")

    def _offload(self, unit: str, micro: int, grads: tuple[torch.Tensor, ...], ctx: StepContext) -> None:
        """StreamedWeights' backward: the unit's weight gradient (one tensor per parameter) leaves for the host
        accumulator. A grouped block's is the rest of it, after its experts' (`_offload_group`), which join it
        here in their places.

        The previous unit's offload (and all-reduce, under data parallel) overlapped this unit's backward,
        while autograd made this unit's gradient; it is finished only now, so at most two units' gradients are
        on the device, and they are charged so.
        """
        ranks = 1 if self.data_parallel is None else self.data_parallel.world
        groups = self.groups.get(unit)
        charged = ([sum(g.numel() for g in grads)] if groups is not None else
                   [sum(g.numel() for g in pieces) for _, pieces in self.layouts[unit].split_device(grads)])
        handles = [self.ledger.allocate(c.category, unit, c.nbytes, c.what)
                   for c in gradient_charges(charged, grads[0].element_size(), ranks, self.shards > 1)]
        self._finish_pending_offload(ctx)
        if groups is not None:
            experts = self._expert_grads.pop(unit)
            grads = tuple(groups.whole(grads, [experts[g] for g in range(groups.count)]))
        parts = self.layouts[unit].split_device(grads)  # (unit, pieces) of each state the gradient goes to
        first, last = micro == 0 and unit not in self.lent, micro == self.step_cfg.grad_accum - 1
        # Each state's part apart: sharded, a rank's slice of the embedding's part is its slice of the embedding.
        reductions = (None if self.data_parallel is None else
                      [(owner, self.data_parallel.start_reduce(pieces)) for owner, pieces in parts])
        # The last micro-batch's sum stays in memory for a fused update (which loads it, folded by chunk, unless it
        # takes it from the backward's gradient, which is then folded only for its norm) or a norm.
        direct = ctx.fused and last and unit in self.from_backward
        kept = (ctx.fused and (unit not in self.by_chunk or direct)) or ctx.norm_pass
        step, persist = ctx.step, not (kept and last)
        job = partial(self._traced_offload, unit, step, parts, first, last, reductions, persist)
        ctx.pending_offload = PendingOffload(unit, last, self.io.folds.submit(job), handles,
                                             tuple(grads) if direct else None)

    def _offload_group(self, group: ExpertGroup, grads: tuple[torch.Tensor, ...], ctx: StepContext) -> None:
        """A group's StreamedWeights' backward: its experts' gradient leaves for host memory while the next
        group's backward runs (charged until then, as a unit's), and the group leaves the device."""
        handles = [self.ledger.allocate(c.category, group.unit, c.nbytes, c.what)
                   for c in gradient_charges([sum(g.numel() for g in grads)], grads[0].element_size(), 1)]
        self._finish_pending_offload(ctx)
        held = self._expert_grads.setdefault(group.unit, {})

        def job() -> tuple[float, None]:
            with self.trace.span(group.unit, "offload", step=ctx.step):
                host = self.transport.pieces_to_host(grads)
                if len(host) != len(grads):  # one flat host tensor they were copied into
                    pieces = host[0].split([g.numel() for g in grads])
                    host = [piece.view(g.shape) for piece, g in zip(pieces, grads, strict=True)]
                held[group.group] = list(host)
            return 0.0, None

        ctx.pending_offload = PendingOffload(group.unit, False, self.io.folds.submit(job), handles)
        self.loader.release(group, ctx)

    def _traced_offload(self, unit: str, step: int, parts: list[tuple[str, list[torch.Tensor]]], first: bool,
                        last: bool, reductions: list[tuple[str, Reduction]] | None,
                        persist: bool) -> tuple[float, torch.Tensor | None]:
        with self.trace.span(unit, "offload", step=step):
            if reductions is not None:
                assert self.data_parallel is not None  # reductions only across ranks
                parts = [(owner, [self.data_parallel.finish_reduce(r)]) for owner, r in reductions]
            if self.store is None:
                return 0.0, None
            assert self.writer is not None  # a store that takes gradients takes writes
            if not self.store.spec.placement.grad.zero_copy and self._scratch is None:
                # Of the largest unit folded whole: those larger are folded through their files in blocks of it.
                self._scratch = torch.empty(max(self.stored_numel(u) for u in self.layouts if u not in self.by_chunk),
                                            dtype=torch.float32)
            # A borrowed part goes to its owner's accumulator, which the owner's own backward finishes. The unit's
            # own part comes last: `total` ends as its accumulator (None where folded by chunk).
            total, sq_norm = None, 0.0
            for owner, pieces in parts:
                host = self.transport.pieces_to_host(pieces)
                with torch.profiler.record_function(GRADIENT_FOLD):
                    total, sq_norm = self.writer.accumulate_grad(owner, host, first, self._scratch,
                                                                 persist or owner != unit, norm=last and owner == unit)
                if host is not pieces:
                    self.transport.give_back(host[0])
            return (sq_norm, total) if last else (0.0, None)

    def _finish_pending_offload(self, ctx: StepContext) -> None:
        pending, ctx.pending_offload = ctx.pending_offload, None
        if pending is None:
            return
        sq_norm, total = pending.future.result()
        if pending.kept is None:
            for handle in pending.handles:
                self.ledger.free(handle)
        else:  # freed by the unit's update, after its last chunk
            ctx.backward_grads[pending.unit] = BackwardGradient(pending.kept, pending.handles)
        if pending.last:
            self.grad_sq_norms[pending.unit] = sq_norm
            if ctx.fused:
                ctx.final_grads[pending.unit] = total

    def clear_graphs(self, ctx: StepContext) -> None:
        """Drop the hidden states the step kept and the activations it charged."""
        for unit in self.units:
            self.recorder.release(unit)
        ctx.graphs.clear()
        ctx.auxiliary.clear()
        self._drop_references(ctx)

    def _drop_references(self, ctx: StepContext) -> None:
        for _, handle in ctx.references.values():
            self.ledger.free(handle)
        ctx.references.clear()

    def abort(self, ctx: StepContext) -> None:
        """A step stopped part-way: credit the gradient on its way home and the one flowing, drop the graphs."""
        if ctx.pending_offload is not None:
            for handle in ctx.pending_offload.handles:
                self.ledger.free(handle)
            ctx.pending_offload = None
        if ctx.flowing_grad is not None:
            self.ledger.free(ctx.flowing_grad[1])
            ctx.flowing_grad = None
        for unit in list(ctx.graphs):
            self.recorder.release(unit)
        ctx.graphs.clear()
        ctx.stashed.clear()
        ctx.inputs.clear()
        ctx.auxiliary.clear()
        self._drop_references(ctx)
        self._expert_grads.clear()
        self.recorder.forget_groups()


class _GroupSource:
    """A grouped block's experts for one call of its shell (layers.moe.units.ExpertSource): each group loaded by
    the loader, its parameters entering autograd through a StreamedWeights of its own whose backward offloads
    the group's gradient; released after its experts run, and loaded again by the backward that needs it."""

    def __init__(self, passes: Passes, unit: str, ctx: StepContext, groups: int) -> None:
        self.passes, self.unit, self.ctx, self.groups = passes, unit, ctx, groups

    def _load(self, group: int) -> UnitState:
        return self.passes.loader.load_group(ExpertGroup(self.unit, group), self.ctx)

    def load(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        passes, resource = self.passes, ExpertGroup(self.unit, group)
        state = self._load(group)
        passes.recorder.group_loaded(state, lambda: self._load(group))
        gate_up, down = StreamedWeights.apply(passes.anchor, state.weights(), passes.groups[self.unit].group,
                                              lambda grads: passes._offload_group(resource, grads, self.ctx))
        return gate_up, down

    def release(self, group: int) -> None:
        resource = ExpertGroup(self.unit, group)
        self.passes.recorder.group_released(self.passes.loader.group_states[(self.unit, group)])
        self.passes.loader.release(resource, self.ctx)


def _packed(batch: MicroBatch) -> tuple[object, ...]:
    """A block's arguments after its input: none, or (start_pos, cache, positions) for packed examples."""
    return () if batch.positions is None else (0, None, batch.positions)
