"""StreamingTrainer: the runtime's public Python API (README.md, "Python API").

Long because the API is one class today: construction and opening, steps, evaluation, a preference run's
reference pass, resume and roll-forward. Its step policy and persistence are to move out of it.
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from layers import ModelConfig, learned_tokens
from layers.loss import IGNORE_INDEX
from layers.preference import DPOObjective, RowLogProbs
from memory_model import BASELINE_BYTES_PER_PARAM, Ledger, Trace
from memory_model.allocator import cuda_block_bytes, workspace_blocks
from streamer.config import TrainerConfig
from streamer.runtime.distributed import DataParallel, agree_on_journal, check_sharding
from streamer.errors import ConfigError, StoreError, StreamerError
from streamer.runtime.executor import Executor
from streamer.runtime.hardware import DeviceConfig
from streamer.runtime.step import (
    ClippingNeeded, MicroBatch, NonFiniteError, StepContext, check_runnable, clip_coefficient,
)
from streamer.runtime.lora import Adapters
from memory_model.devices import DEVICE_PRESETS, DeviceSpec, with_sets
from memory_model.expert_groups import checked_group
from memory_model.planner import clipped_schedule, clipped_steps
from memory_model.schedule import StepSpec, norm_pass_spec, step_events, step_spec
from memory_model.settings import SettingError
from memory_model.shapes import check_norm_first, norm_first_allowed
from streamer.store.commit import read_manifest
from streamer.store.host import HostReader, HostStore
from streamer.store.ranks import rank_dir, store_dirs
from streamer.store.shards import MergedShards
from streamer.store.interface import StoreReader, StoreWriter
from streamer.weights import hf_state_dict, hf_tensors, initial_unit, read_master, write_fresh_state


class StreamingTrainer:
    """Full AdamW fine-tuning with one unit's weights, gradients and Adam state on the device at a time."""

    def __init__(self, cfg: ModelConfig, tc: TrainerConfig | None = None, store_dir: str | Path | None = None,
                 *, _store: StoreReader | None = None, _initialize: bool = True) -> None:
        self.cfg, self.tc = cfg, tc or TrainerConfig()
        device, step = self.tc.device, self.tc.step
        check_runnable(step)
        if self.tc.lora.load_in_4bit:
            _check_bitsandbytes()
        if device.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {device.device} but torch sees no CUDA GPU; use --device cpu")
        self.units = cfg.unit_names()
        self.extra_state: dict[str, Any] = {}  # the caller's resumable state (data order, RNG), committed per step
        self.losses: list[float] = []
        self.metrics: dict[str, float] = {}  # the last step's objective's (DPO's rewards and log-probabilities)
        self.data_parallel = None if device.device == "meta" else DataParallel.from_environment(
            device.device, sharded=step.data_parallel == "sharded")
        if store_dir is not None and self.data_parallel is not None:
            store_dir = rank_dir(Path(store_dir), self.data_parallel.rank)
        self.processes = 1 if self.data_parallel is None else self.data_parallel.world
        try:
            checked_group(cfg, step.expert_group_size, self.tc.lora.enabled, self.processes)
        except SettingError as exc:
            raise ConfigError.of(exc.key, exc.problem) from None
        if device.device == "meta":
            self.store = None
        elif _store is not None:
            self.store = _store
        else:
            if store_dir is None:
                if "disk" in (step.store.state, step.store.compute):
                    raise StoreError("a disk-tier store needs store_dir (the run directory to write it in)")
                store_dir = Path(tempfile.mkdtemp(prefix="ws-store-")) / "store"
            self.store = HostStore.create(store_dir, self.tc.store_spec(cfg, self.processes),
                                          _pin_memory(device.device, device.pin_memory))
        # The same store where it takes writes (training, new weights, saves); None where it is only read.
        self.writer = self.store if isinstance(self.store, StoreWriter) else None
        layouts = self.tc.store_spec(cfg, self.processes).layouts() if self.store is None else \
            [self.store.layouts[u] for u in self.units]
        self.layouts = {lay.name: lay for lay in layouts}
        arch = device.cuda_arch()
        self.ledger = Ledger(device.budget_bytes(), device.device,
                             hint_context={"activations": step.activations, "grad_accum": step.grad_accum},
                             block_bytes=cuda_block_bytes if arch else None)
        for nbytes in workspace_blocks(arch, os.environ.get("CUBLAS_WORKSPACE_CONFIG")):  # (none off CUDA)
            self.ledger.allocate("workspace", "cublas", nbytes, "cuBLAS workspace, kept for the run")
        self.trace = Trace(self.ledger, meta={"model": cfg.describe(), "params": cfg.num_params(),
                                              "baseline_bytes": BASELINE_BYTES_PER_PARAM * cfg.num_params(),
                                              "budget": device.budget_bytes(), "device": device.device})
        self.adapters = None
        if self.tc.lora.enabled:
            self.adapters = Adapters(cfg, self.tc.lora, self.tc.optimizer, torch.device(device.device), self.tc.seed)
        self.executor = Executor(cfg, step, self.tc.optimizer, torch.device(device.device), self.tc.compute_dtype,
                                 self.store, self.ledger, self.trace, self.layouts, self.data_parallel,
                                 self.adapters, writer=self.writer, seed=self.tc.seed)
        try:
            # LoRA has no update of the streamed base to fuse: its adapters are updated on the device.
            self.fused = step.fused(self.processes, frozen_base=self.adapters is not None)
        except ValueError as exc:
            raise StreamerError(str(exc)) from None
        self.step_bytes: tuple[int, ...] = (0, 0)  # (read, written) by the store's files in the last step
        self.clipped_redos = 0  # fused steps clipping undid, made again knowing the clip coefficient
        # The next step tries the fused update (the last one did not clip); False: it is made as one that clips.
        self.speculate = True
        # How the last step was made ("fused", "norm-first" or "after-backward"), and whether a speculative fused
        # attempt was undone before it (`streamer plan --compare` prices each logged step so).
        self.last_schedule, self.last_redone = "", False
        try:  # TrainerConfig checked it for one process; data parallel never fuses
            check_norm_first(step.clipped_steps, self.fused, step.grad_accum)
        except SettingError as exc:
            raise ConfigError.of(exc.key, exc.problem) from None
        self._clipped_schedules: dict[tuple[int, int], str] = {}  # by (batch, seq), as `clipped_schedule` chose
        # This machine's calibrated DeviceSpec, which a caller may give (`streamer train` reads runs/' cache): the
        # target `clipped_schedule` prices a cpu run on when --budget names no device preset.
        self.local_target: DeviceSpec | None = None
        if _store is None and self.store is not None and _initialize:
            self._initialize(seed=self.tc.seed)

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def open(cls, store_dir: str | Path, overrides: Mapping[str, Any] | None = None,
             read_only: bool = False, step: int | None = None) -> "StreamingTrainer":
        """Continue from a store: its last committed step, finishing a step a crash interrupted, or going back to
        the newest intact kept step where that is damaged (`store.fell_back` says so). `read_only`: read it without
        writing in its folder, which may be read-only (HostReader.open); `step`: read that kept step."""
        device = dict(overrides or {}).get("device", "cpu")
        data_parallel = DataParallel.from_environment(device)
        rank, world = (None, 1) if data_parallel is None else (data_parallel.rank, data_parallel.world)
        dirs = store_dirs(Path(store_dir), rank, world)  # several: a sharded run, read in one process
        # The store's RAM slabs are pinned (or not) as they are allocated, before its trainer settings are read:
        # pin_memory comes from the overrides, else from the settings the store was committed with.
        try:
            committed = read_manifest(dirs[0]).get("trainer", {}).get("config", {})
        except StoreError:  # the store's open says what is wrong, or goes back to a kept step
            committed = {}
        settings = {**committed, **dict(overrides or {})}
        pin_memory = _pin_memory(str(settings.get("device", "cpu")),
                                 settings.get("pin_memory", DeviceConfig.pin_memory))
        if step is not None and not read_only:
            raise StoreError("a kept step is opened read_only; training continues from the last commit (or goes "
                             "back to a kept step where that is damaged)")
        if step is not None and len(dirs) > 1:
            raise StoreError(f"{store_dir} holds a sharded run, whose kept steps cannot be read yet; read its last "
                             "step (no --step)")
        # Under torchrun the ranks would have to agree on the kept step to go back to: a damaged store stops them.
        try:
            store: StoreReader = (MergedShards.open(dirs) if len(dirs) > 1 else
                                  HostReader.open(dirs[0], pin_memory, step=step) if read_only else
                                  HostStore.open(dirs[0], pin_memory, fall_back=data_parallel is None))
        except StoreError as damage:
            if data_parallel is not None:  # the other ranks hear of it where they agree on the journal
                agree_on_journal(data_parallel, 0, None, damage)
            raise
        trainer = None
        try:  # on any error, let go of the store (and its lock) before saying why
            journal = store.journal if isinstance(store, StoreWriter) else None  # a reader refuses one at open
            if data_parallel is not None:
                agreed = agree_on_journal(data_parallel, store.step, journal)
                if journal is not None and agreed is None:
                    assert isinstance(store, StoreWriter)  # only a writer holds a journal
                    store.discard_journal()  # another rank never journaled it, so no rank updated anything of it
                journal = agreed
            saved = dict(store.trainer_state.get("config", {}))
            tc = TrainerConfig.from_dict({**saved, **dict(overrides or {})})
            check_sharding(store, tc.step.data_parallel, data_parallel)
            if tc.step.store != store.spec.placement:
                raise StoreError(f"{store.root} was created with placement {store.spec.placement.to_dict()}; "
                                 "the placement of an existing store cannot change")
            if store.spec.frozen and not tc.lora.enabled:
                raise StoreError(f"{store_dir} holds a LoRA run's frozen base only; resume it with its --lora-rank")
            trainer = cls(store.spec.config, tc, _store=store)
            if trainer.adapters is not None:
                trainer.adapters.load(store.root, store.step)
            trainer.losses = list(store.trainer_state.get("losses", []))
            trainer.extra_state = dict(store.trainer_state.get("extra", {}))
            if journal is not None:
                trainer._roll_forward(journal)
        except BaseException:
            trainer.close() if trainer is not None else store.close()
            raise
        return trainer

    @classmethod
    def from_pretrained(cls, hf_dir: str | Path, tc: TrainerConfig | None = None,
                        store_dir: str | Path | None = None) -> "StreamingTrainer":
        """Import a Hugging Face folder tensor by tensor (about one unit in memory at a time)."""
        from streamer.io.hf import HFCheckpoint, check_quantization
        check_quantization(Path(hf_dir) / "config.json", (tc or TrainerConfig()).lora)
        checkpoint = HFCheckpoint.open(hf_dir)
        checkpoint.validate()
        trainer = cls(checkpoint.config, tc, store_dir, _initialize=False)
        try:
            def tensors_of(unit: str) -> dict[str, Any]:
                """A folder saved 4-bit gives each weight the run holds 4-bit as its pieces, as saved."""
                layout = trainer.layouts[unit]
                kept = layout.packed.quantized if layout.packed is not None else ()
                tensors: dict[str, Any] = {}
                for s in layout.slots:
                    pieces = checkpoint.read_4bit(s.hf_key) if s.key in kept else None
                    tensors[s.key] = pieces if pieces is not None else checkpoint.read(s.hf_key)
                return tensors

            trainer._write_units(tensors_of)
        except BaseException:
            trainer.close()
            raise
        return trainer

    def _initialize(self, seed: int) -> None:
        """HF's initialisation, one unit at a time."""
        self._write_units(lambda unit: initial_unit(self.cfg, unit, self.units.index(unit), seed))

    def _write_units(self, tensors_of: Callable[[str], dict[str, torch.Tensor]]) -> None:
        """Every unit's weights (by slot key) as a fresh state, committed as the store's current step."""
        assert self.store is not None
        for unit in self.units:
            write_fresh_state(self.writing, self.layouts[unit], tensors_of(unit), self.tc.compute_dtype,
                              self.data_parallel)
        self._finish_step(self.store.step, self._trainer_state())

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load HF-keyed weights (the transformers class's state_dict); resets the Adam moments."""
        given = hf_tensors(self.layouts.values(), state_dict)
        self._write_units(lambda unit: {s.key: given[s.hf_key] for s in self.layouts[unit].slots})

    # --- training --------------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        return self.store.step if self.store is not None else 0

    def _micro_batches(self, input_ids: torch.Tensor, labels: torch.Tensor | None, positions: torch.Tensor | None,
                       attention_mask: torch.Tensor | None,
                       reference: torch.Tensor | None = None) -> tuple[list[MicroBatch], float]:
        """This process's micro-batches, and StepContext's tokens (counted on the global batch every rank holds).
        `reference`: DPO's pairs (`step`), each micro-batch's with its objective."""
        labels = input_ids if labels is None else labels
        if self.tc.objective.preference:
            input_ids, labels, attention_mask, reference = self._pair_blocks(input_ids, labels, positions,
                                                                             attention_mask, reference)
        if input_ids.dim() != 2 or any(t is not None and t.shape != input_ids.shape
                                       for t in (labels, positions, attention_mask)):
            raise StreamerError(f"input_ids must be (batch, seq) and labels, positions and attention_mask the same "
                                f"shape; got {tuple(input_ids.shape)}, {tuple(labels.shape)}, "
                                f"{None if positions is None else tuple(positions.shape)} and "
                                f"{None if attention_mask is None else tuple(attention_mask.shape)}")
        context, why = self.cfg.context()
        if input_ids.shape[1] > context:
            raise StreamerError(f"sequence length {input_ids.shape[1]} exceeds the model's context "
                                f"{why}; use --seq <= {context}")
        if positions is not None and not positions.is_meta and not (
                (positions >= 0).all() and (positions < input_ids.shape[1]).all()):
            raise StreamerError(f"positions must lie in [0, {input_ids.shape[1]}) (the sequence length)")
        # Over the ranks, whose gradients the all-reduce averages.
        tokens = (labels.numel() if labels.is_meta else learned_tokens(labels)) / self.processes
        rows = [input_ids, labels, positions, None if attention_mask is None else attention_mask.bool()]
        if self.data_parallel is not None:
            rows = [None if t is None else self.data_parallel.shard(t) for t in rows]
        first = rows[0]
        assert first is not None  # the input ids, sharded or not
        input_ids = first
        if input_ids.shape[0] % self.tc.step.grad_accum:
            raise StreamerError(f"this process's batch {input_ids.shape[0]} is not divisible by "
                                f"grad_accum={self.tc.step.grad_accum}")
        device = self.executor.device
        # Each micro-batch owns its storage, so the ledger charges the ids one micro-batch saves, not the batch's.
        pieces = [[None] * self.tc.step.grad_accum if t is None else
                  [p.to(device, copy=True) for p in t.chunk(self.tc.step.grad_accum)] for t in rows]
        micro = [MicroBatch(*piece) for piece in zip(*pieces, strict=True)]
        if reference is not None:
            pairs = input_ids.shape[0] // 2  # this process's share of the step's pairs
            if self.data_parallel is not None:
                reference = self.data_parallel.shard(reference)
            for batch, ref in zip(micro, reference.chunk(self.tc.step.grad_accum), strict=True):
                lengths = (batch.labels != IGNORE_INDEX).sum(dim=1)
                batch.objective = DPOObjective(self.tc.objective, ref.to(device), lengths, float(pairs))
        return micro, tokens

    def _pair_blocks(self, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None,
                     attention_mask: torch.Tensor | None, reference: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """DPO's rows, chosen then rejected (TRL's order), laid out so that every micro-batch of every process
        holds whole pairs: one block of chosen rows then their rejected rows per micro-batch."""
        if positions is not None:
            raise StreamerError("DPO takes rows of one pair each, not packed rows; drop --pack")
        rows = input_ids.shape[0]
        blocks = self.tc.step.grad_accum * self.processes
        if reference is None or reference.shape != (rows,):
            raise StreamerError(f"DPO needs the reference log-probability of each of the {rows} rows "
                                "(StreamingTrainer.reference_logps); got "
                                f"{None if reference is None else tuple(reference.shape)}")
        if rows % (2 * blocks):
            raise StreamerError(f"{rows // 2} pairs do not split into {blocks} micro-batches of whole pairs "
                                f"(grad_accum x processes); use a multiple of {blocks} pairs")

        def blocked(t: torch.Tensor) -> torch.Tensor:
            chosen, rejected = t.chunk(2)
            pairs = zip(chosen.chunk(blocks), rejected.chunk(blocks), strict=True)
            return torch.cat([part for pair in pairs for part in pair])
        return (blocked(input_ids), blocked(labels), None if attention_mask is None else blocked(attention_mask),
                blocked(reference))

    def reference_logps(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each row's log-probability of its learned tokens (labels not -100, shifted) under the reference model,
        fp32 on the host, by forward passes only (one micro-batch's rows at a time): DPO's reference. With LoRA
        it is the frozen base (the adapters off, as TRL's reference of a PEFT model); else the weights as they
        are now, so a full fine-tuning run computes them before its first step (TRL's precompute_ref_log_probs).
        Under data parallel each process gives its rows' and every process gets all of them."""
        if input_ids.dim() != 2 or labels.shape != input_ids.shape:
            raise StreamerError(f"input_ids and labels must be (batch, seq) alike; got {tuple(input_ids.shape)} "
                                f"and {tuple(labels.shape)}")
        rows = [t if self.data_parallel is None else self.data_parallel.shard(t) for t in (input_ids, labels)]
        micro = max(1, rows[0].shape[0] // self.tc.step.grad_accum)
        out = []
        for ids, lab in zip(rows[0].split(micro), rows[1].split(micro), strict=True):
            device = self.executor.device
            objective = RowLogProbs()
            ctx = StepContext([MicroBatch(ids.to(device), lab.to(device), objective=objective)], self.step_count,
                              0.0, adapters_off=self.adapters is not None)
            with torch.no_grad():
                self.executor.run(step_events(self.step_spec(1, backward=False)), ctx)
            self.executor.clear_graphs()
            assert objective.rows is not None  # its forward ran
            out.append(objective.rows.float().cpu())
        local = torch.cat(out)
        return local if self.data_parallel is None else torch.cat(self.data_parallel.gather(local))

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
             positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             reference: torch.Tensor | None = None) -> float:
        """One optimizer step over the batch (in grad_accum micro-batches); returns the mean loss per learned token.
        `positions` (batch, seq): rows of packed examples, each token's position in its own example (restarting
        at 0, streamer.io.data.Dataset.positions); each example then attends only to itself. `attention_mask`
        (batch, seq): transformers', False on the padding after a row's examples (Dataset.attention_mask), which
        a mixture's load-balancing loss leaves out; None: no padding.
        With --method dpo the rows are pairs, every chosen row then every rejected row (TRL's order), labels -100
        but on the completion, `reference` each row's `reference_logps`; it returns the pairs' mean DPO loss, and
        `metrics` TRL's logged metrics of the step."""
        micro, tokens = self._micro_batches(input_ids, labels, positions, attention_mask, reference)
        if self.store is not None:
            self.writing.check_consistent()  # an update stopped part-way in this process: reopen the run
        self.ledger.hint_context.update(batch=input_ids.shape[0], seq=input_ids.shape[1])
        self.trace.meta.update(batch=input_ids.shape[0], seq=input_ids.shape[1])
        step = self.step_count + 1
        moved = self.store.bytes_moved() if self.store is not None else (0, 0)
        redos = self.clipped_redos
        try:
            ctx = self._fused_step(micro, tokens, step) if self.fused and self.speculate else None
            self.last_schedule = "fused"
            if ctx is None:  # after the backward, or a fused step that clipping undid, made again
                norm_first = self.fused and self.clipped_schedule(*input_ids.shape) == "norm-first"
                self.last_schedule = "norm-first" if norm_first else "after-backward"
                ctx = (self._norm_first_step(micro, tokens, step) if norm_first
                       else self._run_step(micro, tokens, step, fused=False))
                # Clipping comes in runs (early training): speculate again only after a step that did not clip.
                self.speculate = ctx.clip_coef == 1.0
        except NonFiniteError:
            if self.tc.optimizer.nonfinite == "stop":
                raise
            return float("nan")
        self.last_redone = self.clipped_redos > redos
        loss = self._mean_loss(ctx)
        self.metrics = self._step_metrics(ctx)
        self.losses.append(loss)
        if self.executor.device.type == "cuda":
            # The allocator's own peak beside the ledger's (docs/MEMORY_MODEL.md: CUDA workspace allowance).
            self.trace.meta["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(self.executor.device)
            self.trace.meta["ledger_peak_bytes"] = self.ledger.peak
        if self.store is not None:
            self._finish_step(step, self._trainer_state())
            self.step_bytes = tuple(now - before for now, before in zip(self.store.bytes_moved(), moved, strict=True))
            self.trace.meta.update(step_disk_read_bytes=self.step_bytes[0], step_disk_write_bytes=self.step_bytes[1])
        self.trace.keep_last_steps(self.tc.trace_steps, every=self.tc.trace_every)
        return loss

    def _step_metrics(self, ctx: StepContext) -> dict[str, float]:
        """The objective's metrics as means over the step's pairs (TRL's rewards/* and logps/*); none for sft."""
        if not ctx.metrics or self.executor.device.type == "meta":
            return {}
        pairs = float(ctx.metrics["pairs"])
        means = {name: float(value) / pairs for name, value in ctx.metrics.items() if name != "pairs"}
        if self.data_parallel is not None:
            means = {name: self.data_parallel.mean(value) for name, value in means.items()}
        return means

    @property
    def grad_norm(self) -> float:
        """The global gradient norm of the last step, before clipping (0 before any step)."""
        return math.sqrt(sum(self.executor.grad_sq_norms.values()))

    def step_spec(self, micro_batches: int, fused: bool = False, backward: bool = True,
                  update_units: tuple[str, ...] | None = None) -> StepSpec:
        """A step of this trainer, made from its step settings as the planner makes it (`schedule.step_spec`):
        each process updates its slice of the state; `backward=False`: an evaluation; `update_units`: a step rolled
        forward."""
        return step_spec(self.cfg, self.tc.step, self.executor.compute_is_master, self.processes,
                         self.adapters is not None, micro_batches, fused, backward, update_units)

    def _run_step(self, micro: list[MicroBatch], tokens: float, step: int, fused: bool,
                  clip_coef: float = 1.0) -> StepContext:
        """Forward, backward and update; on any failure nothing of the step stays (a journaled step aside:
        the store then refuses to train on until it is reopened and rolled forward). A fused step clips by
        `clip_coef`: 1 is speculative (validated as it goes, Updater._fused_inputs), else a norm pass's."""
        lr = self.tc.schedule.lr_at(step, self.tc.optimizer.lr)
        ctx = (StepContext(micro, step, lr, tokens, clip_coef=clip_coef) if fused
               else StepContext(micro, step, lr, tokens, on_first_update=self._journal))
        events = step_events(self.step_spec(len(micro), fused))
        if fused and self.store is not None:
            self.writing.begin_speculative_step(step)
        try:
            self.executor.run(events, ctx)
            if self.adapters is not None:
                self._update_adapters(ctx)
            elif fused:
                self._check_loss(ctx)
        except BaseException:
            self._abort()
            if fused and self.store is not None:
                self.writing.rollback()  # back to the previous state files: the step never happened
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
            self.executor.run(step_events(norm_pass_spec(self.step_spec(len(micro), fused=True))), probe)
            self._check_loss(probe)
            clip = clip_coefficient(self.executor.grad_sq_norms, self.tc.optimizer.max_grad_norm, step)
        except BaseException:
            self._abort()
            raise
        try:
            return self._run_step(micro, tokens, step, fused=True, clip_coef=clip)
        except ClippingNeeded:  # a coefficient of 1 that a device's recomputed norm crossed: it clips after all
            self.clipped_redos += 1
            self.last_schedule = "after-backward"
            return self._run_step(micro, tokens, step, fused=False)

    def clipped_schedule(self, batch: int, seq: int) -> str:
        """How a fused step of `batch` x `seq` that clips is made: "norm-first" or "after-backward".
        `--clipped-steps auto` takes the one the planner prices faster on the run's target: the --budget
        device preset (with --set), else `local_target` on the cpu; with neither, after-backward."""
        key = (batch, seq)
        if key not in self._clipped_schedules:
            choice = self.tc.step.clipped_steps
            if not norm_first_allowed(self.fused, self.tc.step.grad_accum):
                choice = "after-backward"
            elif choice == "auto":
                target = self.target()
                choice = "after-backward" if target is None else clipped_schedule(
                    clipped_steps(self.cfg, target, self.tc.plan_config(batch, seq)), choice).schedule
            self._clipped_schedules[key] = choice
        return self._clipped_schedules[key]

    def target(self) -> DeviceSpec | None:
        """The device the run's steps are priced on (`clipped_schedule`) and its MFU read against, or None where
        none is known."""
        device = self.tc.device
        budget = DEVICE_PRESETS.get(device.budget, device.budget) if isinstance(device.budget, str) else device.budget
        if isinstance(budget, DeviceSpec):
            return with_sets(budget, device.set, ConfigError.of)
        if device.device != "cpu" or self.local_target is None:
            return None
        return with_sets(self.local_target, device.set, ConfigError.of)

    def _abort(self) -> None:
        self.executor.abort()
        if self.adapters is not None:
            self.adapters.zero_grad()  # a later step must not add to this one's partial gradients

    def _update_adapters(self, ctx: StepContext) -> None:
        """LoRA's update, after the last backward: clip by the adapters' global gradient norm, then AdamW."""
        self._check_loss(ctx)
        assert self.adapters is not None  # a LoRA run's
        if self.data_parallel is not None:
            handle = self.ledger.allocate("gradients", "lora", self.adapters.numel() * 4,
                                          "fp32 adapter gradients for the all-reduce")
            self.adapters.all_reduce(self.data_parallel)
            self.ledger.free(handle)
        self.executor.grad_sq_norms = {"lora": self.adapters.grad_sq_norm()}  # the step's reported norm
        clip = clip_coefficient(self.executor.grad_sq_norms, self.tc.optimizer.max_grad_norm, ctx.step)
        with self.trace.span("lora", "update", step=ctx.step):
            self.adapters.step(ctx.lr, clip)

    def _finish_step(self, step: int, trainer_state: dict[str, Any]) -> None:
        """Commit a step; a LoRA run's adapters are written first where the store commits to disk."""
        store = self.held_store
        durable = store.spec.placement.state == "disk"
        if self.adapters is not None and durable:
            self.adapters.save(store.root, step)
        self.writing.finish_step(step, trainer_state)
        if self.adapters is not None and durable:
            self.adapters.prune(store.root, {step, *store.kept()})

    def _check_loss(self, ctx: StepContext) -> None:
        loss = self._mean_loss(ctx)
        if self.executor.device.type != "meta" and not torch.isfinite(torch.tensor(loss)):
            raise NonFiniteError(f"loss is {loss} at step {ctx.step}; nothing was committed — "
                                 "lower the lr or check the data")

    def _mean_loss(self, ctx: StepContext) -> float:
        """The loss over the global batch (every rank's micro-batches); computed once per step."""
        if ctx.mean_loss is None:
            local = float("nan") if self.executor.device.type == "meta" else float(torch.stack(ctx.losses).sum())
            ctx.mean_loss = local if self.data_parallel is None else self.data_parallel.mean(local)
        return ctx.mean_loss

    def _journal(self, ctx: StepContext) -> None:
        """Before the first update: the loss must be finite, then the step is journaled (durable)."""
        self._check_loss(ctx)
        if self.store is not None:
            state = self._trainer_state(extra_losses=[self._mean_loss(ctx)])
            self.writing.begin_step(ctx.step, {"lr": ctx.lr, "clip_coef": ctx.clip_coef, "trainer": state})
        if self.data_parallel is not None:
            self.data_parallel.barrier()  # no rank updates a weight before every rank has journaled the step

    def _roll_forward(self, journal: dict[str, Any]) -> None:
        """Finish an update a crash interrupted: the same gradients, lr and clip coefficient, so bit-identical."""
        step = journal["step"]
        pending = [u for u in self.units if self.writing.unit_version(u) != step]
        ctx = StepContext([], step, journal["lr"], clip_coef=journal["clip_coef"])
        # No micro-batch is left to run: the step is the update of the units it had not finished.
        self.executor.run(step_events(self.step_spec(0, update_units=tuple(pending))), ctx)
        trainer_state = journal["trainer"]
        self.losses = list(trainer_state.get("losses", []))
        self.extra_state = dict(trainer_state.get("extra", {}))
        self.writing.finish_step(step, trainer_state)

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 reference: torch.Tensor | None = None) -> float:
        """The mean loss per learned token (this rank's share, as step's), by forward passes only; no state changes.
        With --method dpo, the pairs' mean DPO loss (`reference` as step's)."""
        micro, tokens = self._micro_batches(input_ids, labels, positions, attention_mask, reference)
        losses = []
        for batch in micro:
            ctx = StepContext([batch], self.step_count, 0.0, tokens)
            with torch.no_grad():
                self.executor.run(step_events(self.step_spec(1, backward=False)), ctx)
            self.executor.clear_graphs()
            losses.append(ctx.losses[0])
        return float(torch.stack(losses).sum()) if self.executor.device.type != "meta" else float("nan")

    def _trainer_state(self, extra_losses: list[float] | None = None) -> dict[str, Any]:
        return {"config": self.tc.to_dict(), "losses": self.losses + (extra_losses or []),
                "extra": self.extra_state}

    def save(self) -> None:
        """Make the current step durable (the disk tier already is after every step)."""
        if self.store is not None:
            writer = self.writing
            if self.adapters is not None:
                self.adapters.save(writer.root, writer.step)
            writer.save(self._trainer_state())
            if self.adapters is not None:
                self.adapters.prune(self.store.root, {self.store.step, *self.store.kept()})

    def keep(self, note: dict[str, Any] | None = None) -> None:
        """Keep the last commit (on the RAM tier: `save()` first): no later step deletes its state (or a LoRA run's
        adapters), so it can be exported (`open(..., read_only=True, step=N)`) and is what a damaged store goes
        back to. `note` (JSON) is kept with it: the CLI's eval loss."""
        self.writing.keep(dict(note or {}))

    def drop_kept(self, step: int) -> None:
        """Let a kept step go: its state files are deleted (the LoRA run's adapters at the next commit)."""
        self.writing.drop_kept(step)

    def kept(self) -> dict[int, dict[str, Any]]:
        """The kept steps, oldest first, with their notes."""
        return {} if self.store is None else self.store.kept()

    # --- weights out -----------------------------------------------------------------------------
    def unit_master(self, unit: str) -> torch.Tensor:
        """A unit's fp32 master weights as one flat host tensor (a frozen base's: its compute weights)."""
        return read_master(self.held_store, self.layouts[unit], self.executor.stored_numel(unit), self.data_parallel)

    def merged_unit_master(self, unit: str) -> torch.Tensor:
        """unit_master with LoRA's adapters merged into the weights they adapt (the model that was trained)."""
        flat = self.unit_master(unit)
        if self.adapters is not None:
            self.adapters.merge_into(unit, flat, self.layouts[unit])
        return flat

    def state_dict(self, merged: bool = True) -> dict[str, torch.Tensor]:
        """HF-keyed fp32 weights (copies), LoRA's adapters merged; `merged=False`: the frozen base alone."""
        return hf_state_dict([self.layouts[u] for u in self.units],
                             self.merged_unit_master if merged else self.unit_master)

    @property
    def held_store(self) -> StoreReader:
        """The store; only a dry run (the meta device) has none."""
        assert self.store is not None, "a dry run holds no store"
        return self.store

    @property
    def writing(self) -> StoreWriter:
        """The store, to change it; one opened for reading says why it takes no writes."""
        if self.writer is None:
            raise StoreError(self.held_store.read_only_reason)
        return self.writer

    def close(self) -> None:
        self.executor.close()
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> "StreamingTrainer":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _check_bitsandbytes() -> None:
    """--load-in-4bit quantizes and dequantizes with bitsandbytes' own functions: it must be installed."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError("--load-in-4bit needs the bitsandbytes package: pip install 'weight-streaming[qlora]'") \
            from None


def _pin_memory(device: str, pin_memory: str) -> str:
    """The store's pin_memory: what the settings ask for on CUDA, nothing elsewhere."""
    return pin_memory if device.startswith("cuda") else "none"
