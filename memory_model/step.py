"""One step's settings (`StepConfig`): what the planner prices and the runtime makes, declared once.

The trainer's settings nest it (`TrainerConfig.step`), the planner's take it (`PlanConfig.step`), and the store
takes its chunk and placement from it. With it live the rules that depend on these settings alone: whether the
update is fused (`StepConfig.fused`), and whether a weights load reads the master (`Placement.loads_read_master`).
memory_model.schedule.step_spec turns it, with a model, into the step's `StepSpec`. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memory_model.settings import Choice, Integer, SettingError, branch, check_settings, setting
from memory_model.tiers import RAM, TIERS, Tier, tier
from memory_model.units import BLOCK_SCALE_BYTES, QUANT_BLOCK, Precision

ACTIVATION_POLICIES = ("resident", "checkpoint", "offload")
UPDATE_PLACES = ("device", "host")
UPDATE_TIMINGS = ("auto", "fused", "after-backward", "overlapped")
CLIPPED_STEPS = ("auto", "after-backward", "norm-first")
DATA_PARALLEL_MODES = ("replicated", "sharded")


@dataclass(frozen=True)
class Placement:
    """Which tier (`memory_model.tiers.Tier`) holds each slab kind, each given as a tier or its name. `state` is
    the master and the Adam moments: what a commit makes durable.

    Compute weights are a cache of the master weights, kept only on a zero-copy tier: RAM keeps a compute-dtype
    copy (rebuilt from the masters on open, rewritten by every update); the disk keeps none, and a load reads the
    master from the state files and casts it on its way to the device. A mixed placement (compute weights in RAM,
    the state on disk) is priced and run like a whole one.
    """

    compute: Tier = RAM
    state: Tier = RAM
    grad: Tier = RAM

    def __post_init__(self) -> None:
        for kind in ("compute", "state", "grad"):
            try:
                object.__setattr__(self, kind, tier(getattr(self, kind)))
            except ValueError as exc:
                raise SettingError("store", f"placement: {kind} {exc}") from None
        if self.state.journaled and not self.grad.durable:
            # A step commits by journaling durable gradients and rolling the update forward after a crash.
            raise SettingError("store", f"placement with state on {self.state} needs grad on a durable tier too "
                                        "(the commit journal replays it)")

    def loads_read_master(self, compute_is_master: bool) -> bool:
        """A weights load reads the master from the state files (and casts it): there is no compute copy on a
        zero-copy tier, and compute weights in the master's dtype are the masters themselves. The one rule for
        `StepSpec.master_from_weights`."""
        return not self.compute.zero_copy or (compute_is_master and not self.state.zero_copy)

    @classmethod
    def of(cls, store: "str | Placement") -> "Placement":
        """A placement, or a tier for all of it (`--store disk`)."""
        if isinstance(store, Placement):
            return store
        try:
            whole = tier(store)
        except ValueError:
            raise SettingError("store", f"must be {', '.join(map(repr, TIERS))} or a Placement, got {store!r}") \
                from None
        return cls(whole, whole, whole)

    def to_dict(self) -> dict[str, str]:
        return {"compute": self.compute.name, "state": self.state.name, "grad": self.grad.name}

    @property
    def needs_folder(self) -> bool:
        """The store keeps files of its own beyond saves (the state or the compute weights on such a tier): a
        trainer must be given the folder."""
        return self.state.needs_folder or self.compute.needs_folder

    @property
    def tier(self) -> Tier | None:
        """The one tier of a store placed whole in RAM or on disk (`--store`); None for a mixed placement."""
        return self.compute if self.compute == self.state == self.grad else None


class Placements(Choice):
    """The check of a store's placement: a tier (`--store ram` or `disk`, taken as `Placement.of` it) or a
    Placement."""

    def __init__(self) -> None:
        super().__init__(tuple(TIERS))

    def __call__(self, value: Any) -> Any:
        if isinstance(value, Placement):
            return value
        return Placement.of(value) if super().__call__(value) is not None else None


@dataclass(frozen=True)
class StepConfig:
    """How one step is made: micro-batches, activations, the update's place, chunk and timing, the lookahead, the
    data-parallel layout, where the store lives and its dtypes (`precision`, one `Precision`). The batch and its
    sequence length are the planner's (`PlanConfig`) and the trainer's other branches'."""

    grad_accum: int = setting(1, "micro-batches the batch is split into", Integer())
    activations: str = setting(
        "resident", "resident (no recompute), checkpoint (keep only each block's input, recompute the rest in the "
                    "backward) or offload (checkpoint with the block inputs in host memory, pinned on CUDA, "
                    "copied back ahead of each block's backward)", Choice(ACTIVATION_POLICIES), "POLICY")
    update_on: str = setting("device", "run AdamW on the device (streamed state) or on the host",
                             Choice(UPDATE_PLACES), "WHERE")
    prefetch: int = setting(1, "units loaded ahead of the one computing", Integer(0))
    update_chunk: int = setting(16 * 2**20, "parameters per update chunk: the optimizer state on the device at once",
                                Integer())
    update_timing: str = setting(
        "auto", "when AdamW runs: fused (each unit as soon as its gradient is final, in the last backward; an "
                "update on the host then overlaps the backward of the units before it; gradients never reach the "
                "store; needs the disk tier and one process), after-backward (a separate phase), auto (fused "
                "where it is allowed), or overlapped (`streamer plan` only, with --update-on host: each unit's "
                "host update starts once its gradient is folded into the store, as LoHan and ZeRO-Offload "
                "overlap it; the runtime clips by the global norm, known only after the backward)",
        Choice(UPDATE_TIMINGS), "WHEN")
    clipped_steps: str = setting(
        "auto", "how a fused step that clips is made: norm-first (a forward and backward that only sum the "
                "gradient norm, then the fused step, clipped), after-backward (undone and made again with the "
                "update after the backward, its gradients through the store), or auto (the one the planner "
                "prices faster on the run's target). norm-first needs the fused update and --grad-accum 1",
        Choice(CLIPPED_STEPS), "SCHEDULE")
    data_parallel: str = setting(
        "replicated", "with more than one process: every process keeps a whole store (replicated), or each keeps "
                      "and updates its 1/N slice of every unit's state and the weights are all-gathered for "
                      "compute (sharded: 1/N of the host RAM and disk per process)", Choice(DATA_PARALLEL_MODES),
        "MODE")
    expert_group_size: int = setting(
        0, "experts of a mixture-of-experts block on the device at once: its attention, norms and router load as "
           "its weights, then its experts a group at a time in its forward and again in its backward, each group's "
           "gradient offloaded before the next loads (a divisor of the experts). 0: all of "
           "them where they fit (`streamer train`'s --budget, `streamer plan`'s device), else the most that fit "
           "(the fewest groups)", Integer(0), "N")
    precision: Precision = branch(Precision, names={"compute": "dtype", "master": "master_dtype",
                                                    "moments": "moment_dtype"})
    # A Placement from Python: a mixed one (compute weights in RAM, the state on disk) is priced and run too.
    store: Placement = setting(Placement(), "where the host store lives: ram, or disk (committed every step)",
                               Placements(), "TIER")

    def __post_init__(self) -> None:
        check_settings(self)
        check_chunk_blocks(self.update_chunk, self.precision.moments)

    def fused(self, devices: int, frozen_base: bool) -> bool:
        """Whether AdamW runs inside backward: the one rule. The fused update is speculative (clip coefficient 1)
        and a step whose clipping triggers, or whose gradient is not finite, is undone by going back to the
        previous generation of the state files: so the state must be on disk. Under data parallel the ranks
        commit together through the journal, which the fused update does not write, so it needs one process. A
        frozen base (LoRA) has no streamed update to fuse. An explicit "fused" where it cannot run fails here."""
        allowed = self.store.state.durable and devices == 1
        if self.update_timing == "fused" and not allowed:
            why = f"--store {self.store.state}" if not self.store.state.durable else f"{devices} processes"
            raise SettingError("update_timing", f"fused needs the state on disk (--store disk) and one process, "
                                                f"not {why}: the speculative update is undone from the previous "
                                                "state files; use --update-timing after-backward or auto")
        return not frozen_base and (self.update_timing == "fused" or (self.update_timing == "auto" and allowed))

    def shards(self, devices: int) -> int:
        """The slices each unit's state is stored in on `devices` data-parallel devices, one per device (1: every
        device stores it whole)."""
        return devices if self.data_parallel == "sharded" else 1

    @property
    def recomputes(self) -> bool:
        """Blocks keep only their input and run their forward again in the backward (checkpoint, offload)."""
        return self.activations != "resident"

    @property
    def offloads_inputs(self) -> bool:
        """The kept block inputs wait for their backward in host memory."""
        return self.activations == "offload"


def check_chunk_blocks(chunk: int, moment_dtype: str) -> None:
    """Block-quantized moments are quantized in blocks that never straddle an update chunk: each chunk is
    dequantized, updated and quantized alone, and a state file's chunks are read and written alone."""
    if moment_dtype in BLOCK_SCALE_BYTES and chunk % QUANT_BLOCK:
        raise SettingError("update_chunk", f"must be a multiple of {QUANT_BLOCK} with --moment-dtype {moment_dtype} "
                                           f"(its quantization blocks), not {chunk}")
