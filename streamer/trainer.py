"""StreamingTrainer: the runtime's public Python API (README.md, "Python API").

It wires the runtime once (`streamer.runtime.wiring.Runtime`), and hands each step to its step policy
(`streamer.step_policy`) and each commit to its persistence (`streamer.persistence`).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from layers import ModelConfig, learned_tokens
from layers.loss import IGNORE_INDEX, Objective
from layers.preference import DPOObjective, RowLogProbs
from memory_model import BASELINE_BYTES_PER_PARAM, Ledger, Trace
from memory_model.allocator import cuda_block_bytes, workspace_blocks
from memory_model.devices import DeviceSpec
from memory_model.expert_groups import checked_group
from memory_model.schedule import StepSpec, step_events
from memory_model.settings import SettingError
from memory_model.trace import rss_high_water
from streamer.config import TrainerConfig
from streamer.errors import CheckpointError, ConfigError, StoreError, StreamerError
from streamer.persistence import Persistence, create_store, open_store
from streamer.runtime.distributed import DataParallel
from streamer.runtime.executor import Executor
from streamer.runtime.lora import Adapters
from streamer.runtime.step import MicroBatch, NonFiniteError, StepContext, check_runnable
from streamer.runtime.wiring import Runtime
from streamer.step_policy import StepPolicy
from streamer.store.interface import StoreReader, StoreWriter
from streamer.store.ranks import rank_dir
from streamer.weights import hf_state_dict, hf_tensors, initial_unit, read_master


class StreamingTrainer:
    """Full AdamW fine-tuning with one unit's weights, gradients and Adam state on the device at a time."""

    def __init__(self, cfg: ModelConfig, tc: TrainerConfig | None = None, store_dir: str | Path | None = None,
                 *, _store: StoreReader | None = None, _initialize: bool = True) -> None:
        self.cfg, self.tc = cfg, tc or TrainerConfig()
        device, step = self.tc.device, self.tc.resolved_step
        check_runnable(step)
        if self.tc.lora.load_in_4bit or self.tc.lora.load_in_8bit:
            _check_bitsandbytes("--load-in-4bit" if self.tc.lora.load_in_4bit else "--load-in-8bit")
        if device.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {device.device} but torch sees no CUDA GPU; use --device cpu")
        self.units = cfg.unit_names()
        self.metrics: dict[str, float] = {}  # the last step's objective's (DPO's rewards and log-probabilities)
        self.eval_metrics: dict[str, float] = {}  # and the last `evaluate`'s
        self.data_parallel = None if device.device == "meta" else DataParallel.from_environment(
            device.device, sharded=step.data_parallel == "sharded")
        if store_dir is not None and self.data_parallel is not None:
            store_dir = rank_dir(Path(store_dir), self.data_parallel.rank)
        self.processes = 1 if self.data_parallel is None else self.data_parallel.world
        try:
            checked_group(cfg, step.expert_group_size, self.tc.lora.enabled, self.processes)
        except SettingError as exc:
            raise ConfigError.of(exc.key, exc.problem) from None
        self.store: StoreReader | None = (
            None if device.device == "meta" else _store if _store is not None else
            create_store(cfg, self.tc, None if store_dir is None else Path(store_dir), self.processes))
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
        # The one wiring every collaborator of a step reads, built here once.
        self.runtime = Runtime(cfg, step, self.tc.optimizer, torch.device(device.device), self.store, self.writer,
                               self.ledger, self.trace, self.layouts, self.data_parallel, self.adapters, self.tc.seed)
        self.executor = Executor(self.runtime)
        self.persistence = Persistence(self.runtime, self.executor, self.tc)
        self.policy = StepPolicy(self.runtime, self.executor, self.tc, self.persistence)
        self.step_bytes = (0, 0)  # (read, written) by the store's files in the last step
        if _store is None and self.store is not None and _initialize:
            self._initialize(seed=self.tc.seed)

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def open(cls, store_dir: str | Path, overrides: Mapping[str, Any] | None = None,
             read_only: bool = False, step: int | None = None) -> "StreamingTrainer":
        """Continue from a store: its last committed step, finishing a step a crash interrupted, or going back to
        the newest intact kept step where that is damaged (`store.fell_back` says so). `read_only`: read it without
        writing in its folder, which may be read-only (HostReader.open); `step`: read that kept step."""
        store, tc, journal = open_store(store_dir, overrides, read_only, step)
        trainer = None
        try:  # on any error, let go of the store (and its lock) before saying why
            trainer = cls(store.spec.config, tc, _store=store)
            trainer.persistence.resume(journal)
        except BaseException:
            trainer.close() if trainer is not None else store.close()
            raise
        return trainer

    @classmethod
    def from_pretrained(cls, hf_dir: str | Path, tc: TrainerConfig | None = None,
                        store_dir: str | Path | None = None) -> "StreamingTrainer":
        """Import a Hugging Face folder tensor by tensor (about one unit in memory at a time); a GGUF file
        (`streamer.io.gguf`) as a frozen base kept in its own blocks, which LoRA trains on."""
        from streamer.io.gguf import GGUFCheckpoint, is_gguf
        from streamer.io.hf import HFCheckpoint, check_quantization
        checkpoint: HFCheckpoint | GGUFCheckpoint
        if is_gguf(hf_dir):
            checkpoint = GGUFCheckpoint.open(hf_dir)
            tc = (tc or TrainerConfig()).on_base(checkpoint.base())
        else:
            check_quantization(Path(hf_dir) / "config.json", (tc or TrainerConfig()).lora)
            checkpoint = HFCheckpoint.open(hf_dir)
        checkpoint.validate()
        trainer = cls(checkpoint.config, tc, store_dir, _initialize=False)
        try:
            def tensors_of(unit: str) -> dict[str, Any]:
                """A folder saved 4-bit or 8-bit gives each weight the run holds quantized as its pieces, as
                saved. A Linear's weight it saved 16-bit (llm_int8_skip_modules) is refused rather than quantized
                here; a mixture's fused expert tensors, which bitsandbytes leaves 16-bit, are quantized. Tensors
                are read in the checkpoint's own dtype (exact: a 16-bit value's fp32 is the same value), never
                widened whole: a chunk at a time as they are stored (streamer.weights)."""
                layout = trainer.layouts[unit]
                kept = layout.packed.quantized if layout.packed is not None else ()
                tensors: dict[str, Any] = {}
                for s in layout.slots:
                    pieces = checkpoint.read_4bit(s.hf_key) if s.key in kept else None
                    if s.key in kept and pieces is None and s.key.endswith(".weight") \
                            and isinstance(checkpoint, HFCheckpoint) and checkpoint.quantized:
                        raise CheckpointError(f"{hf_dir}: {s.hf_key} is saved in 16 bits (its llm_int8_skip_modules)"
                                              ", and a quantized base holds every block projection quantized: pass "
                                              "the 16-bit checkpoint it was made from")
                    # A GGUF base's dequantized tensors straight into the compute dtype it stores them in.
                    dtype = trainer.tc.compute_dtype if isinstance(checkpoint, GGUFCheckpoint) \
                        else checkpoint.dtype(s.hf_key)
                    tensors[s.key] = pieces if pieces is not None else checkpoint.read(s.hf_key, dtype)
                return tensors

            trainer.persistence.write_units(tensors_of)
        except BaseException:
            trainer.close()
            raise
        return trainer

    def _initialize(self, seed: int) -> None:
        """HF's initialisation, one unit at a time."""
        self.persistence.write_units(lambda unit: initial_unit(self.cfg, unit, self.units.index(unit), seed))

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load HF-keyed weights (the transformers class's state_dict); resets the Adam moments."""
        given = hf_tensors(self.layouts.values(), state_dict)
        self.persistence.write_units(lambda unit: {s.key: given[s.hf_key] for s in self.layouts[unit].slots})

    # --- training --------------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        return self.store.step if self.store is not None else 0

    def _micro_batches(self, input_ids: torch.Tensor, labels: torch.Tensor | None, positions: torch.Tensor | None,
                       attention_mask: torch.Tensor | None,
                       reference: torch.Tensor | None = None,
                       objectives: Sequence[Objective] | None = None) -> tuple[list[MicroBatch], float]:
        """This process's micro-batches, and StepContext's tokens (counted on the global batch every rank holds).
        `reference`: DPO's pairs (`step`), each micro-batch's with its objective; `objectives`: each micro-batch's
        own (`step`)."""
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
        context, why = self.cfg.attention().context()
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
        if self.tc.objective.preference:
            pairs = input_ids.shape[0] // 2  # this process's share of the step's pairs
            if reference is not None and self.data_parallel is not None:
                reference = self.data_parallel.shard(reference)
            refs = [None] * len(micro) if reference is None else reference.chunk(self.tc.step.grad_accum)
            for batch, ref in zip(micro, refs, strict=True):
                lengths = (batch.labels != IGNORE_INDEX).sum(dim=1)
                batch.objective = DPOObjective(self.tc.objective, None if ref is None else ref.to(device), lengths,
                                               float(pairs))
        if objectives is not None:
            if len(objectives) != len(micro):
                raise StreamerError(f"step takes one objective per micro-batch of this process ({len(micro)}, "
                                    f"grad_accum); got {len(objectives)}")
            for batch, objective in zip(micro, objectives, strict=True):
                batch.objective = objective
        return micro, tokens

    def _pair_blocks(self, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None,
                     attention_mask: torch.Tensor | None, reference: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """DPO's rows, chosen then rejected (TRL's order), laid out so that every micro-batch of every process
        holds whole pairs: one block of chosen rows then their rejected rows per micro-batch. With LoRA a missing
        `reference` is computed in the step's own forward (the base with the adapters off)."""
        if positions is not None:
            raise StreamerError("DPO takes rows of one pair each, not packed rows; drop --pack")
        rows = input_ids.shape[0]
        blocks = self.tc.step.grad_accum * self.processes
        if (reference is None and self.adapters is None) or (reference is not None and reference.shape != (rows,)):
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
                None if reference is None else blocked(reference))

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
             reference: torch.Tensor | None = None, objectives: Sequence[Objective] | None = None) -> float:
        """One optimizer step over the batch (in grad_accum micro-batches); returns the mean loss per learned token.
        `positions` (batch, seq): rows of packed examples, each token's position in its own example (restarting
        at 0, streamer.io.data.Dataset.positions); each example then attends only to itself. `attention_mask`
        (batch, seq): transformers', False on the padding after a row's examples (Dataset.attention_mask), which
        a mixture's load-balancing loss leaves out; None: no padding.
        With --method dpo the rows are pairs, every chosen row then every rejected row (TRL's order), labels -100
        but on the completion, `reference` each row's `reference_logps` (with LoRA it may be None: the step's own
        forward computes it, each unit loaded once for the policy and the reference); it returns the pairs' mean
        DPO loss, and `metrics` TRL's logged metrics of the step. `objectives`: each micro-batch's loss (the rows
        split in grad_accum parts, in order; under data parallel this process's share's), in place of the method's
        (GRPO's, streamer.grpo)."""
        micro, tokens = self._micro_batches(input_ids, labels, positions, attention_mask, reference, objectives)
        if self.store is not None:
            self.persistence.writable().check_consistent()  # an update stopped part-way in this process: reopen it
        self.ledger.hint_context.update(batch=input_ids.shape[0], seq=input_ids.shape[1])
        self.trace.meta.update(batch=input_ids.shape[0], seq=input_ids.shape[1])
        step = self.step_count + 1
        moved = self.store.bytes_moved() if self.store is not None else (0, 0)
        try:
            ctx = self.policy.make(micro, tokens, step, *input_ids.shape)
        except NonFiniteError:
            if self.tc.optimizer.nonfinite == "stop":
                raise
            return float("nan")
        loss = self.policy.mean_loss(ctx)
        self.metrics = self._step_metrics(ctx)
        self.losses.append(loss)
        if self.executor.device.type == "cuda":
            # The allocator's own peak beside the ledger's (docs/MEMORY_MODEL.md: CUDA workspace allowance).
            self.trace.meta["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(self.executor.device)
            self.trace.meta["ledger_peak_bytes"] = self.ledger.peak
        self.trace.meta["host_rss_high_water_bytes"] = rss_high_water()
        if self.store is not None:
            self.persistence.finish_step(step)
            (read, written), (read_before, written_before) = self.store.bytes_moved(), moved
            self.step_bytes = (read - read_before, written - written_before)
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
        """A step of this trainer, made from its step settings as the planner makes it (`Runtime.step_spec`)."""
        return self.runtime.step_spec(micro_batches, fused, backward, update_units)

    # --- the step policy's state (streamer.step_policy) ------------------------------------------
    @property
    def fused(self) -> bool:
        """Whether the update may be fused into the backward (`StepConfig.fused`)."""
        return self.policy.fused

    @property
    def speculate(self) -> bool:
        """Whether the next step first tries the fused update as one that does not clip."""
        return self.policy.speculate

    @speculate.setter
    def speculate(self, value: bool) -> None:
        self.policy.speculate = value

    @property
    def clipped_redos(self) -> int:
        """Fused steps clipping undid, made again knowing the clip coefficient."""
        return self.policy.clipped_redos

    @property
    def last_schedule(self) -> str:
        """How the last step was made: "fused", "norm-first" or "after-backward"."""
        return self.policy.last_schedule

    @property
    def last_redone(self) -> bool:
        """Whether a speculative fused attempt was undone before the last step."""
        return self.policy.last_redone

    @property
    def local_target(self) -> DeviceSpec | None:
        """This machine's calibrated DeviceSpec, which a caller may give (`streamer train` reads runs/' cache): the
        target `clipped_schedule` prices a cpu run on when --price-on names no device preset."""
        return self.policy.local_target

    @local_target.setter
    def local_target(self, spec: DeviceSpec | None) -> None:
        self.policy.local_target = spec

    def clipped_schedule(self, batch: int, seq: int) -> str:
        """How a fused step of `batch` x `seq` that clips is made (`StepPolicy.clipped_schedule`)."""
        return self.policy.clipped_schedule(batch, seq)

    def target(self) -> DeviceSpec | None:
        """The device the run's steps are priced on and its MFU read against, or None where none is known."""
        return self.policy.target()

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 reference: torch.Tensor | None = None) -> float:
        """The mean loss per learned token (this rank's share, as step's), by forward passes only; no state changes.
        With --method dpo, the pairs' mean DPO loss (`reference` as step's)."""
        micro, tokens = self._micro_batches(input_ids, labels, positions, attention_mask, reference)
        losses, sums = [], StepContext([], self.step_count, 0.0, tokens)  # `sums`: the objective's metrics
        for batch in micro:
            ctx = StepContext([batch], self.step_count, 0.0, tokens)
            with torch.no_grad():
                self.executor.run(step_events(self.step_spec(1, backward=False)), ctx)
            self.executor.clear_graphs()
            losses.append(ctx.losses[0])
            for name, value in ctx.metrics.items():
                sums.metrics[name] = sums.metrics[name] + value if name in sums.metrics else value
        self.eval_metrics = self._step_metrics(sums)
        return float(torch.stack(losses).sum()) if self.executor.device.type != "meta" else float("nan")

    # --- persistence (streamer.persistence) -----------------------------------------------------
    @property
    def losses(self) -> list[float]:
        """Every committed step's loss, the first step's first."""
        return self.persistence.losses

    @losses.setter
    def losses(self, losses: list[float]) -> None:
        self.persistence.losses = losses

    @property
    def extra_state(self) -> dict[str, Any]:
        """The caller's resumable state (data order, RNG), committed with each step."""
        return self.persistence.extra_state

    @extra_state.setter
    def extra_state(self, state: dict[str, Any]) -> None:
        self.persistence.extra_state = state

    def save(self) -> None:
        """Make the current step durable (the disk tier already is after every step)."""
        self.persistence.save()

    def keep(self, note: dict[str, Any] | None = None) -> None:
        """Keep the last commit (on the RAM tier: `save()` first): no later step deletes its state (or a LoRA run's
        adapters), so it can be exported (`open(..., read_only=True, step=N)`) and is what a damaged store goes
        back to. `note` (JSON) is kept with it: the CLI's eval loss."""
        self.persistence.keep(note)

    def drop_kept(self, step: int) -> None:
        """Let a kept step go: its state files are deleted (the LoRA run's adapters at the next commit)."""
        self.persistence.drop_kept(step)

    def kept(self) -> dict[int, dict[str, Any]]:
        """The kept steps, oldest first, with their notes."""
        return self.persistence.kept()

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


def _check_bitsandbytes(flag: str) -> None:
    """--load-in-4bit and --load-in-8bit quantize with bitsandbytes' own functions: it must be installed."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(f"{flag} needs the bitsandbytes package: pip install 'weight-streaming[qlora]'") from None

