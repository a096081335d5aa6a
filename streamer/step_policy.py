"""How a trainer makes each step: the step policy, one state machine.

A step is made fused (the update inside the backward), norm-first (a norm pass, then the fused step clipped by
the coefficient it gives) or after the backward. Where the update may be fused, a step first speculates that it
does not clip: a fused attempt with coefficient 1. Clipping undoes it (`ClippingNeeded`, nothing written), and the
step is made again as one that clips, on the schedule `clipped_schedule` chooses; the next step speculates again
only after one that did not clip. Every way gives the same bits.
"""
from __future__ import annotations

import torch

from memory_model.devices import DeviceSpec, with_sets
from memory_model.planner import clipped_schedule, clipped_steps
from memory_model.schedule import norm_pass_spec, step_events
from memory_model.settings import SettingError
from memory_model.shapes import check_norm_first, norm_first_allowed
from streamer.config import TrainerConfig
from streamer.errors import ConfigError, StreamerError
from streamer.persistence import Persistence
from streamer.runtime.executor import Executor
from streamer.runtime.step import ClippingNeeded, MicroBatch, NonFiniteError, StepContext, clip_coefficient
from streamer.runtime.wiring import Runtime


class StepPolicy:
    """Which schedule each step of `rt` is made on, and making it: its state is whether the next step speculates,
    the schedule the last one was made on, and the fused attempts clipping undid."""

    def __init__(self, rt: Runtime, executor: Executor, tc: TrainerConfig, persistence: Persistence) -> None:
        self.rt, self.executor, self.tc, self.persistence = rt, executor, tc, persistence
        try:
            # LoRA has no update of the streamed base to fuse: its adapters are updated on the device.
            self.fused = tc.step.fused(rt.processes, frozen_base=rt.adapters is not None)
        except ValueError as exc:
            raise StreamerError(str(exc)) from None
        self.clipped_redos = 0  # fused steps clipping undid, made again knowing the clip coefficient
        # The next step tries the fused update (the last one did not clip); False: it is made as one that clips.
        self.speculate = True
        # How the last step was made ("fused", "norm-first" or "after-backward"), and whether a speculative fused
        # attempt was undone before it (`streamer plan --compare` prices each logged step so).
        self.last_schedule, self.last_redone = "", False
        try:  # TrainerConfig checked it for one process; data parallel never fuses
            check_norm_first(tc.step.clipped_steps, self.fused, tc.step.grad_accum)
        except SettingError as exc:
            raise ConfigError.of(exc.key, exc.problem) from None
        self._clipped_schedules: dict[tuple[int, int], str] = {}  # by (batch, seq), as `clipped_schedule` chose
        # This machine's calibrated DeviceSpec, which a caller may give (`streamer train` reads runs/' cache): the
        # target `clipped_schedule` prices a cpu run on when --price-on names no device preset.
        self.local_target: DeviceSpec | None = None

    def make(self, micro: list[MicroBatch], tokens: float, step: int, batch: int, seq: int) -> StepContext:
        """Step `step` over the micro-batches of a `batch` x `seq` batch, made on the schedule the state says."""
        redos = self.clipped_redos
        ctx = self._fused_step(micro, tokens, step) if self.fused and self.speculate else None
        self.last_schedule = "fused"
        if ctx is None:  # after the backward, or a fused step that clipping undid, made again
            norm_first = self.fused and self.clipped_schedule(batch, seq) == "norm-first"
            self.last_schedule = "norm-first" if norm_first else "after-backward"
            ctx = (self._norm_first_step(micro, tokens, step) if norm_first
                   else self._run_step(micro, tokens, step, fused=False))
            # Clipping comes in runs (early training): speculate again only after a step that did not clip.
            self.speculate = ctx.clip_coef == 1.0
        self.last_redone = self.clipped_redos > redos
        return ctx

    def _run_step(self, micro: list[MicroBatch], tokens: float, step: int, fused: bool,
                  clip_coef: float = 1.0) -> StepContext:
        """Forward, backward and update; on any failure nothing of the step stays (a journaled step aside:
        the store then refuses to train on until it is reopened and rolled forward). A fused step clips by
        `clip_coef`: 1 is speculative (validated as it goes, Updater._fused_inputs), else a norm pass's."""
        lr = self.tc.schedule.lr_at(step, self.tc.optimizer.lr)
        ctx = (StepContext(micro, step, lr, tokens, clip_coef=clip_coef) if fused
               else StepContext(micro, step, lr, tokens, on_first_update=self._journal))
        events = step_events(self.rt.step_spec(len(micro), fused))
        writer = self.rt.writer if fused and self.rt.store is not None else None
        if writer is not None:
            writer.begin_speculative_step(step)
        try:
            self.executor.run(events, ctx)
            if self.rt.adapters is not None:
                self._update_adapters(ctx)
            elif fused:
                self.check_loss(ctx)
        except BaseException:
            self.abort()
            if writer is not None:
                writer.rollback()  # back to the previous state files: the step never happened
            raise
        return ctx

    def _fused_step(self, micro: list[MicroBatch], tokens: float, step: int) -> StepContext | None:
        """The step with the update fused into the backward; None when clipping undid it (made again after the
        backward: the gradients are recomputed, so the result is the same bit for bit)."""
        try:
            return self._run_step(micro, tokens, step, fused=True)
        except ClippingNeeded:
            self.clipped_redos += 1
            self.speculate = False
            return None

    def _norm_first_step(self, micro: list[MicroBatch], tokens: float, step: int) -> StepContext:
        """A step that clips, made norm-first: a norm pass (forward and backward, each unit's gradient dropped
        once its squared norm is summed, nothing written), then the fused step clipped by the coefficient that
        norm gives. The fused pass recomputes the same gradients, so the step is bit for bit the one after the
        backward; it writes nothing until that pass, which rolls back on failure as any fused step does."""
        probe = StepContext(micro, step, self.tc.schedule.lr_at(step, self.tc.optimizer.lr), tokens,
                            norm_pass=True)
        try:
            self.executor.run(step_events(norm_pass_spec(self.rt.step_spec(len(micro), fused=True))), probe)
            self.check_loss(probe)
            clip = clip_coefficient(self.executor.grad_sq_norms, self.tc.optimizer.max_grad_norm, step)
        except BaseException:
            self.abort()
            raise
        try:
            return self._run_step(micro, tokens, step, fused=True, clip_coef=clip)
        except ClippingNeeded:  # a coefficient of 1 that a device's recomputed norm crossed: it clips after all
            self.clipped_redos += 1
            self.last_schedule = "after-backward"
            return self._run_step(micro, tokens, step, fused=False)

    def clipped_schedule(self, batch: int, seq: int) -> str:
        """How a fused step of `batch` x `seq` that clips is made: "norm-first" or "after-backward".
        `--clipped-steps auto` takes the one the planner prices faster on the run's target: the --price-on
        device preset (with --set; never the --budget's), else `local_target` on the cpu; with neither,
        after-backward."""
        key = (batch, seq)
        if key not in self._clipped_schedules:
            choice = self.tc.step.clipped_steps
            if not norm_first_allowed(self.fused, self.tc.step.grad_accum):
                choice = "after-backward"
            elif choice == "auto":
                target = self.target()
                choice = "after-backward" if target is None else clipped_schedule(
                    clipped_steps(self.rt.cfg, target, self.tc.plan_config(batch, seq)), choice).schedule
            self._clipped_schedules[key] = choice
        return self._clipped_schedules[key]

    def target(self) -> DeviceSpec | None:
        """The device the run's steps are priced on (`clipped_schedule`) and its MFU read against, or None where
        none is known."""
        device = self.tc.device
        named = device.priced_on(ConfigError.of)
        if named is not None:
            return named
        if device.device != "cpu" or self.local_target is None:
            return None
        return with_sets(self.local_target, device.set, ConfigError.of)

    def abort(self) -> None:
        self.executor.abort()
        if self.rt.adapters is not None:
            self.rt.adapters.zero_grad()  # a later step must not add to this one's partial gradients

    def _update_adapters(self, ctx: StepContext) -> None:
        """LoRA's update, after the last backward: clip by the adapters' global gradient norm, then AdamW."""
        adapters = self.rt.adapters
        assert adapters is not None
        self.check_loss(ctx)
        if self.rt.data_parallel is not None:
            handle = self.rt.ledger.allocate("gradients", "lora", adapters.numel() * 4,
                                             "fp32 adapter gradients for the all-reduce")
            adapters.all_reduce(self.rt.data_parallel)
            self.rt.ledger.free(handle)
        self.executor.grad_sq_norms = {"lora": adapters.grad_sq_norm()}  # the step's reported norm
        clip = clip_coefficient(self.executor.grad_sq_norms, self.tc.optimizer.max_grad_norm, ctx.step)
        with self.rt.trace.span("lora", "update", step=ctx.step):
            adapters.step(ctx.lr, clip)

    def check_loss(self, ctx: StepContext) -> None:
        loss = self.mean_loss(ctx)
        if self.rt.device.type != "meta" and not torch.isfinite(torch.tensor(loss)):
            raise NonFiniteError(f"loss is {loss} at step {ctx.step}; nothing was committed — "
                                 "lower the lr or check the data")

    def mean_loss(self, ctx: StepContext) -> float:
        """The loss over the global batch (every rank's micro-batches); computed once per step."""
        if ctx.mean_loss is None:
            local = float("nan") if self.rt.device.type == "meta" else float(torch.stack(ctx.losses).sum())
            ctx.mean_loss = local if self.rt.data_parallel is None else self.rt.data_parallel.mean(local)
        return ctx.mean_loss

    def _journal(self, ctx: StepContext) -> None:
        """Before the first update: the loss must be finite, then the step is journaled (durable)."""
        self.check_loss(ctx)
        self.persistence.journal(ctx, self.mean_loss(ctx))
