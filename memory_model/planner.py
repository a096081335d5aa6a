"""The analytic plan of one training step: device bytes by category at every event, the peak, and time.

The planner walks the event list the runtime executes (memory_model/schedule.py): the forward and backward
of every micro-batch, then the update in chunks. At each event the device holds the event's own resource
and the next `prefetch` distinct resources (a unit's compute weights, or one update chunk's state), the
activations of every unit whose forward ran and whose backward has not, and during a backward the unit's
weight gradient and workspace. docs/MEMORY_MODEL.md states this charging contract (as streamer/runtime/executor.py
implements it) and derives every formula and the time model.

Long because the walk over the events, the plan it gives and that plan's tables are one concern; what could
stand apart already does (the weak-scaling curve, the host's bytes, the search for expert groups).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable

from rich.table import Table

from layers.config import ModelConfig
from memory_model.allocator import cuda_block_bytes, workspace_bytes
from memory_model.devices import DeviceSpec
from memory_model.expert_groups import (
    backward_moment, expert_group, forward_moment, group_sizes, grouped, grouped_block_numel, last_gradient, reloaded,
)
from memory_model.host import HostBytes, SharedPeak, host_bytes, offloaded_bytes, shared_peak, store_kinds
from memory_model.ledger import CATEGORIES
from memory_model.settings import flatten
from memory_model.shapes import (
    PlanConfig, backward_workspace_bytes, block_input_numel, block_layer_type,
    block_saved_bytes, checkpoint_input_bytes, embed_saved_bytes, forward_flops, frozen_block_saved_bytes,
    head_saved_bytes, norm_first_allowed, rotary_shared, step_model_flops,
)
from memory_model.lora import adapter_params, dequantized_bytes, targets_of, weights_bytes
from memory_model.schedule import (
    BlockInput, Charge, Event, Resource, StepSpec, Weights, adapter_charges, disk_bytes, gathered_numel,
    gradient_charges, is_fused, kept_masters, load_order, norm_pass_spec, resident_sets, resource_charges,
    shard_numel, step_events, step_spec, store_bytes, update_charges, updated_from_backward,
)
from memory_model.timing import RESOURCES, simulate
from memory_model.units import format_size

BASELINE_BYTES_PER_PARAM = 16  # bf16 weights + bf16 grads + fp32 master, exp_avg, exp_avg_sq (mixed precision)
# The time and throughput of a step, left out (null) where the step does not fit.
_THROUGHPUT = ("step_time_s", "tokens_per_s", "utilisation", "step_s", "model_flops_per_s", "mfu")
_MAX_BATCH_SEARCH = 2**24
# The real step's ledger peak minus the planner's, measured on CPU (one step, budget off) for gptj-demo
# (2x64, 8x128) and a 2-layer d64 model (2x16, 4x64) over resident/checkpoint x device/host update x
# grad-accum 1/2 x fp32/bf16 (56 runs): equal in 50, 8 bytes over in 6 (grad-accum 2; ratio 1.000022 at most).
PLAN_MARGIN_BYTES = 1024


@dataclass(frozen=True)
class UnitRow:
    """One unit's bytes (per device), FLOPs and times over one step."""

    unit: str
    params: int
    weight_bytes: int  # compute weights while on the device
    gradient_bytes: int  # its weight gradient on the device, during its backward
    optimizer_bytes: int  # fp32 master + moments in their dtype (on the host; streamed through the device in chunks)
    activation_bytes: int  # held from its forward to its backward, per micro-batch
    recompute_bytes: int  # saved tensors recomputed during its backward (checkpoint policy)
    workspace_bytes: int  # during its backward
    forward_flops: int  # per step, every micro-batch
    backward_flops: int  # per step, recompute included
    h2d_bytes: int
    d2h_bytes: int
    disk_read_bytes: int
    disk_write_bytes: int
    load_s: float  # weights and update-state loads
    forward_s: float
    backward_s: float
    offload_s: float  # gradient and updated-state write-backs, host accumulation included
    update_s: float  # AdamW over its chunks
    peak_bytes: int  # the device total at its highest event
    peak_phase: str


@dataclass(frozen=True)
class Plan:
    """One step of `shape` on `device` under `config`: bytes (per device), fit, time, and the baselines."""

    shape: ModelConfig
    device: DeviceSpec
    config: PlanConfig
    params: int
    baseline_bytes: int  # 16 B/param
    resident_baseline_bytes: int  # 16 B/param + every unit's resident activations for one micro-batch
    peak_device_bytes: int
    peak_breakdown: dict[str, int]
    peak_at: tuple[str, str]  # (unit, phase) of the first event at the peak
    # What torch.cuda.max_memory_allocated would count at the peak on a CUDA device (`DeviceSpec.cuda_arch`):
    # each moment's bytes of each category rounded as the caching allocator rounds a block, and cuBLAS's
    # workspaces (memory_model.allocator); the peak itself elsewhere.
    allocated_peak_bytes: int
    fits: bool  # the allocated peak plus the device's reserve (CUDA context) fit its memory
    host_store_bytes: int  # per rank (1/N with the state sharded): compute weights, master, moments, gradient
    # (a frozen LoRA base: its compute weights alone)
    # Offloaded block inputs in host memory at most, per device: every block's input of one micro-batch.
    host_activation_bytes: int
    host_stores: int  # stores on one host: ranks sharing it, each with its own store (1 with an in-network reduce)
    host_fits: bool  # the RAM tier needs every store of the host in its RAM, and offloaded inputs need their room
    host_peak: HostBytes  # one process's resident host memory at its peak, by part (memory_model.host)
    step_time_s: float
    tokens_per_s: float
    utilisation: float  # MFU: model FLOPs per second / the device's dense peak for the compute dtype
    model_flops: int  # per step and device: 3 x forward matmul FLOPs (attention included), no recompute
    bottleneck: str  # the resource busy longest in the step (timing.RESOURCES)
    resource_s: dict[str, float]  # seconds each resource is busy per step, before overlap
    link_bytes: dict[str, int]  # bytes per step and device over h2d, d2h, and read from / written to disk
    # The largest batch at this seq that fits (0 when none), and seq; the largest seq at this batch that fits, up
    # to the model's context (0 when none). None when not searched (plan(..., limits=False): the sweep).
    max_batch_seq: tuple[int, int] | None
    max_seq: int | None
    rows: tuple[UnitRow, ...]

    @property
    def does_not_fit(self) -> str | None:
        """Why the step cannot run on this device and its host, with the flags that would make it fit; None when
        it fits. A step that does not fit has no throughput: `to_json` and `table` leave it out."""
        why = []
        if not self.fits:
            room = self.device.memory_bytes - self.device.reserve_bytes
            cfg, fixes = self.config, []
            if cfg.step.activations == "resident" and not cfg.lora.enabled:
                fixes.append("--activations checkpoint")
            if self.max_batch_seq is not None and self.max_batch_seq[0]:
                fixes.append(f"--batch {self.max_batch_seq[0]} (the largest that fits at --seq {cfg.seq})")
            elif self.max_seq:
                fixes.append(f"--seq {self.max_seq} (the longest that fits at --batch {cfg.batch})")
            if cfg.micro_batch > 1:
                fixes.append(f"more --grad-accum than {cfg.step.grad_accum} (smaller micro-batches, the same batch)")
            group = fewest_expert_groups(self.shape, self.device, cfg.replace(expert_group_size=0))
            if group and group != cfg.step.expert_group_size:
                fixes.append(f"--expert-group-size {group} (the fewest groups of experts that fit)")
            fixes.append("a --target with more memory")
            why.append(f"its device peak {format_size(self.allocated_peak_bytes)} exceeds the "
                       f"{format_size(room)} {self.device.name} leaves to tensors; to fit: {', or '.join(fixes)}")
        if not self.host_fits:
            stores = f"{self.host_stores} stores of " if self.host_stores > 1 else ""
            why.append(f"its RAM-tier store needs {stores}{format_size(self.host_store_bytes)} of host RAM and "
                       f"{self.device.name}'s host has {format_size(self.device.host_ram_bytes)}; to fit: --store disk")
        return "; and ".join(why) or None

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON values; a step that does not fit has null time and throughput and says why in
        `does_not_fit` (null when it fits)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("shape", "device", "config")}
        # inner_dim: resolved when n_inner is None
        out["model"] = {**asdict(self.shape), "inner_dim": self.shape.intermediate_size}
        out["device"] = self.device.name
        out["device_memory_bytes"] = self.device.memory_bytes
        store = self.config.step.store  # a tier, as `--store` names it, or a mixed placement's tiers
        out["config"] = {**flatten(self.config), "store": store.tier or store.to_dict(),
                         "lora": asdict(self.config.lora)}
        out["peak_at"] = {"unit": self.peak_at[0], "phase": self.peak_at[1]}
        out["host_peak"] = asdict(self.host_peak)
        out["host_peak_bytes"] = self.host_peak.total
        if self.max_batch_seq is not None:
            out["max_batch_seq"] = {"batch": self.max_batch_seq[0], "seq": self.max_batch_seq[1]}
        out["rows"] = [asdict(r) for r in self.rows]
        out.update(self.summary())
        out["does_not_fit"] = self.does_not_fit
        if out["does_not_fit"] is not None:
            out.update(dict.fromkeys(_THROUGHPUT))
        return out

    def summary(self) -> dict[str, Any]:
        """The headline numbers under short names: the what-if sweep's columns and `plan --json`'s top keys."""
        return {"step_s": self.step_time_s, "peak_bytes": self.peak_device_bytes, "tokens_per_s": self.tokens_per_s,
                "model_flops_per_s": self.model_flops / self.step_time_s, "mfu": self.utilisation,
                "bottleneck": self.bottleneck, "fits": self.fits, "host_fits": self.host_fits,
                **{f"{name}_bytes_per_step": n for name, n in self.link_bytes.items()}}

    def table(self) -> Table:
        """Per unit: bytes on the device and time per phase; the caption holds the totals."""
        group = expert_group(self.shape, self.config)
        experts = f", experts {group} of {self.shape.params().experts()} at a time" if group else ""
        lora = self.config.lora
        base = f", 4-bit {lora.bnb_4bit_quant_type}{' (double quant)' * lora.bnb_4bit_use_double_quant} base" * \
            lora.load_in_4bit + ", 8-bit base" * lora.load_in_8bit + ", GGUF base" * (lora.gguf is not None)
        table = Table(title=f"plan: {self.device.name}, batch {self.config.batch} x {self.config.seq}, "
                            f"{self.config.step.activations}, {self.config.precision.compute}{experts}{base}")
        for name in ("unit", "params", "weights", "grads", "activations", "workspace", "peak", "load ms",
                     "fwd ms", "bwd ms", "offload ms", "update ms"):
            table.add_column(name, justify="left" if name == "unit" else "right")
        for r in self.rows:
            table.add_row(r.unit, f"{r.params:,}", format_size(r.weight_bytes), format_size(r.gradient_bytes),
                          format_size(r.activation_bytes + r.recompute_bytes), format_size(r.workspace_bytes),
                          format_size(r.peak_bytes),
                          *(f"{t * 1e3:.1f}" for t in (r.load_s, r.forward_s, r.backward_s, r.offload_s,
                                                       r.update_s)))
        parts = ", ".join(f"{c} {format_size(self.peak_breakdown[c])}" for c in CATEGORIES)
        allocated = (f"; {format_size(self.allocated_peak_bytes)} as torch's CUDA allocator counts it (rounded "
                     f"blocks, cuBLAS workspaces)" if self.allocated_peak_bytes != self.peak_device_bytes else "")
        reserve = f" less a {format_size(self.device.reserve_bytes)} reserve" if self.device.reserve_bytes else ""
        table.caption = (f"peak {format_size(self.peak_device_bytes)} at {self.peak_at[1]} {self.peak_at[0]} "
                         f"({parts}){allocated}; {'fits' if self.fits else 'does NOT fit'} "
                         f"{format_size(self.device.memory_bytes)}{reserve}"
                         f"; 16 B/param baseline "
                         f"{format_size(self.baseline_bytes)} ({self.baseline_bytes / self.peak_device_bytes:.1f}x); "
                         + self._throughput() + self._host_activations() + self._disk_volume())
        return table

    def _throughput(self) -> str:
        if self.does_not_fit is not None:
            return f"does not fit, so no throughput: {self.does_not_fit}"
        return (f"step {self.step_time_s:.3g} s, {self.tokens_per_s:,.0f} tokens/s, MFU {self.utilisation:.0%} "
                "(bound by " + self.bottleneck + "; busy s: "
                + ", ".join(f"{r} {t:.3g}" for r, t in self.resource_s.items() if t) + ")")

    def _host_activations(self) -> str:
        """Offloaded block inputs: their room in host memory, and their bytes over the links per step."""
        if not self.host_activation_bytes:
            return ""
        return (f"; block inputs in host memory {format_size(self.host_activation_bytes)}, each copied out after "
                f"its forward and back before its backward")

    def _disk_volume(self) -> str:
        """The disk tier's bytes per step (what the SSD's write endurance pays for), or nothing in RAM."""
        read, written = self.link_bytes["disk_read"], self.link_bytes["disk_write"]
        if not written:
            return ""
        return (f"; disk per step: read {format_size(read)} ({read / self.params:.2f} B/param), written "
                f"{format_size(written)} ({written / self.params:.2f} B/param; {written * 1000 / 1e12:.1f} TB "
                "per 1,000 steps)")


# --- memory -----------------------------------------------------------------------------------------------------
def _activations(shape: ModelConfig, cfg: PlanConfig, unit: str, batch: int, seq: int) -> tuple[int, int]:
    """(held from forward to backward, recomputed during backward) for one unit and micro-batch. The first
    block's hold the micro-batch's auxiliary loss too (Costs.auxiliary_loss_bytes), read until its
    backward."""
    kept, recompute = _unit_activations(shape, cfg, unit, batch, seq)
    return kept + (shape.costs().auxiliary_loss_bytes() if unit == "block.0" else 0), recompute


def _unit_activations(shape: ModelConfig, cfg: PlanConfig, unit: str, batch: int, seq: int) -> tuple[int, int]:
    es = cfg.dtype_bytes
    if unit == "embed":  # with a frozen base nothing in the embedding needs a gradient: it saves nothing
        return (0 if cfg.lora.enabled else embed_saved_bytes(shape, batch, seq)), 0
    if unit == "head":
        objective = cfg.objective.saved_bytes(batch, seq)
        return head_saved_bytes(shape, batch, seq, es, frozen=cfg.lora.enabled) + objective, 0
    if cfg.lora.enabled:
        return _frozen_block_activations(shape, cfg, unit, batch, seq)
    kind = block_layer_type(shape, unit)
    if cfg.step.recomputes:
        kept = checkpoint_input_bytes(shape, batch, seq, es)
        # Where the block saves its input, the recompute re-saves the kept input itself (same storage, charged
        # once). In fp32 it charges the shared rotary table for the duration of this block's backward.
        # Offloaded, the input is charged as a resource (BlockInput) instead, held for no event beyond its own.
        saved = block_saved_bytes(shape, batch, seq, es, packed=cfg.packed, layer_type=kind)
        saves_input = shape.costs().block_saves_input(es)
        return (0 if cfg.step.offloads_inputs else kept), saved - (kept if saves_input else 0)
    # Resident: storages are charged once per run, so a shared fp32 rotary table goes to its first block only.
    rotary = not rotary_shared(shape, es, cfg.packed) or _first_with_table(shape, unit, lambda i: True)
    return block_saved_bytes(shape, batch, seq, es, rotary=rotary, packed=cfg.packed, layer_type=kind), 0


def _first_with_table(shape: ModelConfig, unit: str, rotates: Callable[[int], bool]) -> bool:
    """Whether the block is the first of those that save a rotary table (`rotates(i)`) with its own
    (`AttentionLayout.rotary_table` of its layer type): the one a shared table is charged to."""
    attention, index = shape.attention(), int(unit.split(".")[1])
    kinds = attention.layer_types()
    table = attention.rotary_table(kinds[index])
    return index == next(i for i, kind in enumerate(kinds) if rotates(i) and attention.rotary_table(kind) == table)


def _frozen_block_activations(shape: ModelConfig, cfg: PlanConfig, unit: str, batch: int, seq: int) -> tuple[int, int]:
    """_activations of a LoRA block. Whether its recompute re-saves the kept input is the family's
    (`FrozenBlockSaves.input_saved`: a norm's input needing a gradient, which the first block's does not, or an
    adapter reading the input itself); a shared fp32 rotary table goes to the first block with it that rotates a
    tensor needing a gradient."""
    es, first, kind = cfg.dtype_bytes, unit == "block.0", block_layer_type(shape, unit)
    targets = frozenset(targets_of(shape, cfg.lora))
    if cfg.step.recomputes:
        kept = checkpoint_input_bytes(shape, batch, seq, es)
        saved = frozen_block_saved_bytes(shape, cfg.lora, batch, seq, es, first, packed=cfg.packed, layer_type=kind)
        saves = shape.costs().frozen_block_saves(es, targets, cfg.lora.dropout == 0, grad_in=not first)
        saves_input = saves.input_saved
        return (0 if cfg.step.offloads_inputs else kept), saved - (kept if saves_input else 0)
    rotates_first = shape.costs().frozen_block_saves(es, targets, cfg.lora.dropout == 0, grad_in=False).rotary
    rotary = (not rotary_shared(shape, es, cfg.packed)
              or _first_with_table(shape, unit, lambda i: i > 0 or rotates_first))
    return frozen_block_saved_bytes(shape, cfg.lora, batch, seq, es, first, rotary=rotary, packed=cfg.packed,
                                    layer_type=kind), 0


def _add(bytes_by_category: dict[str, int], charges: tuple[Charge, ...]) -> None:
    for charge in charges:
        bytes_by_category[charge.category] += charge.nbytes


def _device_numel(resource: Resource, shape: ModelConfig, cfg: PlanConfig, batch: int, seq: int) -> int:
    """The elements a resource holds on the device: a unit's whole weights (all-gathered where sharded; a block
    whose experts load in groups: all but its experts), a chunk's parameters, or a block input's (B, T, d)."""
    if isinstance(resource, BlockInput):
        return block_input_numel(shape, batch, seq)
    if isinstance(resource, Weights) and grouped(shape, cfg, resource.unit):
        return grouped_block_numel(shape, expert_group(shape, cfg))
    return gathered_numel(shape.params().device_parts(resource.unit), cfg.shards)  # (a tied head: the embedding's too)


def loaded_bytes(shape: ModelConfig, cfg: PlanConfig, resident: list[Resource], batch: int, seq: int
                 ) -> dict[str, int]:
    """Device bytes by category of LoRA's adapters (held for the whole run; none without LoRA) and of the
    resources loaded or in flight (`resident`), as the executor charges them when it issues their loads."""
    es = cfg.dtype_bytes
    at = dict.fromkeys(CATEGORIES, 0)
    if cfg.lora.enabled:
        _add(at, adapter_charges(adapter_params(shape, cfg.lora)))
    for r in resident:
        four_bit = isinstance(r, Weights) and cfg.lora.quantized  # a quantized base's units: in bytes
        numel = weights_bytes(shape, cfg.lora, r.unit, es) if four_bit else _device_numel(r, shape, cfg, batch, seq)
        _add(at, resource_charges(r, numel, 1 if four_bit else es, cfg.step.update_on))
    return at


def _memory_walk(shape: ModelConfig, cfg: PlanConfig, events: list[Event], resident: list[list[Resource]],
                 batch: int, seq: int) -> list[tuple[Event, tuple[int, ...]]]:
    """Device bytes by category (CATEGORIES order) at the highest moment of every event.

    That moment is the end of a forward (all of the unit's saved tensors exist; an offloaded input is still
    on the device, its copy to the host waited for there), the point in a backward where the weight gradient
    appears (activations, recompute and workspace still held), and an update chunk's new compute weights
    being written.
    """
    es = cfg.dtype_bytes
    from_backward = updated_from_backward(shape, cfg.step, cfg.devices) if cfg.fused else frozenset()
    held: dict[str, int] = {}
    moments = []
    for index, (event, res) in enumerate(zip(events, resident, strict=True)):
        at = loaded_bytes(shape, cfg, res, batch, seq)
        in_groups = grouped(shape, cfg, event.unit)
        if event.phase == "update":
            _add(at, update_charges(event.chunk, cfg.new_compute_bytes, cfg.step.update_on))
            if event.unit in from_backward:  # the backward's gradient, which the unit's chunks are taken from
                _add(at, gradient_charges(shape.params().device_parts(event.unit), es, cfg.devices))
            if cfg.fused:  # inside the backward: the units still to run keep their activations, and the
                # gradient w.r.t. this unit's input waits for the next unit's backward
                at["activations"] += sum(held.values())
                at["workspace"] = 0 if event.unit == "embed" else batch * seq * shape.hidden_size * es
        else:
            kept, recompute = _activations(shape, cfg, event.unit, batch, seq)
            # (a quantized base's block: the weight dequantized for each matmul)
            dequantized = dequantized_bytes(shape, cfg.lora, event.unit, es)
            if event.phase == "forward":
                held[event.unit] = kept
                at["workspace"] += dequantized
                if cfg.reference_in_step and event.unit.startswith("block."):  # the reference's hidden state
                    at["activations"] += block_input_numel(shape, batch, seq) * es
            at["activations"] += sum(held.values()) + (recompute if event.phase == "backward" else 0)
            if event.phase == "forward" and event.stash is not None:  # on its way to the host
                _add(at, resource_charges(event.stash, block_input_numel(shape, batch, seq), es, cfg.step.update_on))
            if event.phase == "forward" and in_groups:
                group, later = forward_moment(shape, cfg, batch, seq)
                _add(at, group)
                at["activations"] -= later
            if event.phase == "backward":
                previous = tuple(c for unit in _offloading(events, index, cfg.step.grad_accum)
                                 for c in last_gradient(shape, cfg, unit))
                if in_groups:
                    _add(at, backward_moment(shape, cfg, previous))
                elif not cfg.lora.enabled:  # a frozen base has no weight gradient
                    _add(at, gradient_charges(shape.params().device_parts(event.unit), es, cfg.devices, cfg.shards > 1))
                    _add(at, previous)
                at["workspace"] = backward_workspace_bytes(shape, event.unit, batch, seq, es, cfg.lora.enabled,
                                                           expert_group(shape, cfg) if in_groups else 0) + dequantized
                del held[event.unit]
        moments.append((event, tuple(at.values())))
    return moments


def made_as(cfg: PlanConfig, clips: bool) -> tuple[PlanConfig, ...]:
    """The steps a run of `cfg` makes: its own, and where it is fused and clips (`clips`: a --max-grad-norm), the
    after-backward step a fused step that clips is undone and made again as. A norm-first step is covered: its
    norm pass is the after-backward step's forward and backward (`norm_pass_peak`), its fused pass `cfg`'s."""
    return (cfg, cfg.replace(update_timing="after-backward")) if clips and cfg.fused else (cfg,)


def step_needs(shape: ModelConfig, cfg: PlanConfig, arch: str = "", clips: bool = False) -> int:
    """The bytes a run's step needs within a byte limit (a device's memory less its reserve; `streamer train`'s
    --budget): the highest of the steps it makes (`made_as`), its peak as the device's allocator counts it
    (`allocated_peak_bytes`: on a CUDA device, `arch`, its blocks rounded and cuBLAS's workspaces), and the margin
    the runtime's ledger was measured to need beyond the plan. The one measure `streamer plan` and `streamer
    train` hold a step against a limit with."""
    def need(step: PlanConfig) -> int:
        events = _events(shape, step)
        moments = _memory_walk(shape, step, events, resident_sets(events, step.step.prefetch), step.micro_batch,
                               step.seq)
        return allocated_peak_bytes(moments, arch)

    return max(map(need, made_as(cfg, clips))) + PLAN_MARGIN_BYTES


def fewest_groups_within(shape: ModelConfig, cfg: PlanConfig, limit: int, arch: str = "",
                         clips: bool = False) -> int | None:
    """The one search for the fewest groups of experts that fit: the most experts a block can load at once, at
    most what `cfg` loads (all of them where its `expert_group_size` is 0), for the step to need (`step_needs`) at
    most `limit` bytes (plan: its device's memory less its reserve; train: its --budget). 0 where whole blocks
    fit; None where nothing does."""
    experts = shape.params().experts()
    now = cfg.step.expert_group_size or experts
    for size in (g for g in group_sizes(shape, cfg) if g <= now):
        if step_needs(shape, cfg.replace(expert_group_size=size), arch, clips) <= limit:
            return 0 if size == experts else size
    return None


def fewest_expert_groups(shape: ModelConfig, device: DeviceSpec, cfg: PlanConfig, clips: bool = False) -> int:
    """The experts a block loads at once (`StepConfig.expert_group_size`): as `cfg` sets it, or where it is 0, in
    the fewest groups with which the step fits `device` (`fewest_groups_within` its memory less its reserve): all
    of them (0) where whole blocks fit, else the largest divisor of the experts that fits, else 0 (nothing fits:
    the plan says why). Groups are for full fine-tuning on one device (`expert_group`)."""
    if cfg.step.expert_group_size:
        return cfg.step.expert_group_size
    room = device.memory_bytes - device.reserve_bytes
    return fewest_groups_within(shape, cfg, room, device.cuda_arch, clips) or 0


def allocated_peak_bytes(moments: list[tuple[Event, tuple[int, ...]]], arch: str) -> int:
    """The walk's peak as torch's CUDA caching allocator would count it on a device of compute capability `arch`
    (`DeviceSpec.cuda_arch`): each category's bytes at each moment rounded as one block (the runtime's ledger
    rounds each allocation: more blocks, a few KiB more at most per block), and cuBLAS's workspaces; the peak
    itself on a device without that allocator (arch "")."""
    if not arch:
        return max(sum(b) for _, b in moments)
    rounded = max(sum(cuda_block_bytes(n) for n in b) for _, b in moments)
    return rounded + workspace_bytes(arch)


def _offloading(events: list[Event], index: int, micro_batches: int) -> tuple[str, ...]:
    """The unit whose weight gradient is still on its way to the host when backward event `index` makes its own:
    the unit of the backward just before, unless that backward waited for its offload at its end (the first
    unit's, and each one of a fused step's last micro-batch, whose update needs the gradient home)."""
    before = events[index - 1] if index else None
    if before is None or before.phase != "backward":
        return ()
    waited = is_fused(events) and before.micro == micro_batches - 1
    return () if waited else (before.unit,)


def planned_spec(shape: ModelConfig, cfg: PlanConfig, update: bool = True) -> StepSpec:
    """The step the runtime runs for this model and config (`schedule.step_spec` of its step settings, as
    `StreamingTrainer.step_spec` makes it); `update=False` leaves out the update chunks."""
    return step_spec(shape, cfg.step, cfg.compute_is_master, cfg.devices, cfg.lora.enabled,
                     update_units=None if update else ())


def _events(shape: ModelConfig, cfg: PlanConfig, update: bool = True) -> list[Event]:
    return step_events(planned_spec(shape, cfg, update))


def step_disk_bytes(shape: ModelConfig, cfg: PlanConfig) -> tuple[int, int]:
    """(read, written) bytes of the store's files in one step, each slab kind where the placement puts it (none
    in RAM, `store_bytes`)."""
    store = cfg.step.store
    if cfg.lora.enabled:  # a frozen base: each load reads a unit's compute weights, and nothing is written
        if not store.compute.crosses_link:
            return 0, 0
        events = _events(shape, cfg)
        return sum(weights_bytes(shape, cfg.lora, r.unit, cfg.dtype_bytes)
                   for r in load_order(events, cfg.step.prefetch)), 0
    return _disk_bytes_of(shape, cfg, _events(shape, cfg))


def _disk_bytes_of(shape: ModelConfig, cfg: PlanConfig, events: list[Event], norm_pass: bool = False
                   ) -> tuple[int, int]:
    """`step_disk_bytes` of these events (the step's own, or a norm-first step's norm pass)."""
    numels = {u: shard_numel(shape.params().own(u), cfg.shards) for u in shape.unit_names()}  # per rank
    borrowed = {u: [owner for owner, _ in shape.params().borrowed(u).values()] for u in shape.unit_names()}
    return disk_bytes(events, cfg.step.prefetch, numels, store_bytes(cfg), cfg.step.grad_accum, borrowed, norm_pass,
                      reloaded(shape, cfg))


def peak_device_bytes(shape: ModelConfig, cfg: PlanConfig) -> int:
    """The step's peak device bytes (what plan() reports), without the time model."""
    events = _events(shape, cfg)
    resident = resident_sets(events, cfg.step.prefetch)
    return max(sum(b) for _, b in _memory_walk(shape, cfg, events, resident, cfg.micro_batch, cfg.seq))


def shared_peak_bytes(shape: ModelConfig, cfg: PlanConfig) -> SharedPeak:
    """Where the device is the host (the cpu): the step's peak of the device bytes that are host memory of their
    own and the masters kept beside them (`memory_model.host`'s `device` and `master`)."""
    events = _events(shape, cfg)
    resident = resident_sets(events, cfg.step.prefetch)
    return shared_peak(shape, _memory_walk(shape, cfg, events, resident, cfg.micro_batch, cfg.seq), cfg,
                       kept_masters(events, resident))


def _train_peak(shape: ModelConfig, cfg: PlanConfig) -> int:
    """The peak of the forward and backward passes (and of a fused update, which runs inside them). No update
    state after the backward is fetched before the last backward (the lookahead stops at it), so these
    events' resident sets do not depend on that update."""
    events = _events(shape, cfg, update=cfg.fused)
    resident = resident_sets(events, cfg.step.prefetch)
    return max(sum(b) for _, b in _memory_walk(shape, cfg, events, resident, cfg.micro_batch, cfg.seq))


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n) (monotone), or low - 1 when none."""
    if not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _max_shapes(shape: ModelConfig, cfg: PlanConfig, capacity: int, update_peak: int) -> tuple[int, int]:
    """Largest batch at cfg.seq and largest seq at cfg.batch that fit; the update pass does not depend on
    either, so it is walked once (update_peak) and the search walks the forward and backward only."""
    if update_peak > capacity:
        return 0, 0
    group = cfg.step.grad_accum * cfg.devices

    def micro_fits(micro: int) -> bool:
        return _train_peak(shape, replace(cfg, batch=micro * group)) <= capacity

    bound = 1
    while bound < _MAX_BATCH_SEARCH and micro_fits(bound * 2):
        bound *= 2
    max_micro = _largest(micro_fits, 1, min(bound * 2, _MAX_BATCH_SEARCH))
    max_seq = _largest(lambda t: _train_peak(shape, replace(cfg, seq=t)) <= capacity, 1, shape.attention().context()[0])
    return max_micro * group, max_seq


def plan(shape: ModelConfig, device: DeviceSpec, cfg: PlanConfig, limits: bool = True,
         pin_memory: str = "all") -> Plan:
    """Bytes, peak, fit, time and baselines of one training step of `shape` on `device` under `cfg`;
    `limits` also searches the largest batch and seq that fit (most of the cost of a plan). `pin_memory`: the
    run's --pin-memory on a CUDA device (timing.simulate prices the staging copies it makes)."""
    if cfg.seq > shape.attention().context()[0]:
        raise ValueError(f"seq {cfg.seq} exceeds the model's context {shape.attention().context()[1]}")
    units = shape.unit_names()
    micro, seq, es = cfg.micro_batch, cfg.seq, cfg.dtype_bytes

    events = _events(shape, cfg)
    resident = resident_sets(events, cfg.step.prefetch)
    moments = _memory_walk(shape, cfg, events, resident, micro, seq)
    peak_event, peak_bytes = max(moments, key=lambda m: sum(m[1]))
    peak = sum(peak_bytes)
    allocated = allocated_peak_bytes(moments, device.cuda_arch)
    timeline = simulate(events, resident, shape, cfg, device, pin_memory=pin_memory)

    rows, frozen, group = [], cfg.lora.enabled, expert_group(shape, cfg)
    for u in units:
        params, on_device = shape.params().own(u), shape.params().device(u)  # (a tied head uses the embedding's)
        # A grouped block holds all but its experts and one group of them, and one of the two as a gradient.
        pieces = (grouped_block_numel(shape, group), group * shape.params().expert()) if grouped(shape, cfg, u) \
            else (on_device, 0)
        kept, recompute = _activations(shape, cfg, u, micro, seq)
        fwd = forward_flops(shape, u, micro, seq) * cfg.step.grad_accum
        recompute_flops = fwd if cfg.step.recomputes and u.startswith("block.") else 0
        t = timeline.per_unit[u]
        unit_peak, unit_phase = max((sum(b), e.phase) for e, b in moments if e.unit == u)
        rows.append(UnitRow(
            unit=u, params=params, gradient_bytes=0 if frozen else max(pieces) * es,
            weight_bytes=weights_bytes(shape, cfg.lora, u, es) if cfg.lora.quantized else sum(pieces) * es,
            optimizer_bytes=0 if frozen else params * cfg.master_bytes + cfg.moment_bytes(params),
            activation_bytes=kept, recompute_bytes=recompute,
            workspace_bytes=backward_workspace_bytes(shape, u, micro, seq, es, frozen,
                                                     group if grouped(shape, cfg, u) else 0)
            + dequantized_bytes(shape, cfg.lora, u, es), forward_flops=fwd,
            backward_flops=2 * fwd + recompute_flops, h2d_bytes=t.h2d, d2h_bytes=t.d2h,
            disk_read_bytes=t.disk_read, disk_write_bytes=t.disk_write, load_s=t.load_s, forward_s=t.forward_s,
            backward_s=t.backward_s, offload_s=t.offload_s, update_s=t.update_s,
            peak_bytes=unit_peak, peak_phase=unit_phase,
        ))

    params = shape.num_params()
    resident_cfg = cfg.replace(activations="resident")
    resident_acts = sum(_activations(shape, resident_cfg, u, micro, seq)[0] for u in units)
    model_flops = step_model_flops(shape, micro, seq) * cfg.step.grad_accum
    kinds = store_kinds(shape, cfg)
    host_store = sum(nbytes for _, nbytes in kinds.values())
    in_ram = sum(nbytes for tier, nbytes in kinds.values() if tier.zero_copy)
    # Ranks that share a host (and its RAM), each with its own store; with an in-network reduce (MemoryX and
    # SwarmX) one store serves every system.
    stores = 1 if device.reduce == "in-network" else min(cfg.devices, cfg.ranks_per_node)
    host_acts = offloaded_bytes(shape, cfg)
    update_peak = max((sum(b) for e, b in moments if e.phase == "update"), default=0)
    room = device.memory_bytes - device.reserve_bytes - workspace_bytes(device.cuda_arch)
    max_batch, max_seq = (_max_shapes(shape, cfg, room, update_peak)
                          if limits else (None, None))
    step_s = timeline.end_s
    return Plan(
        shape=shape, device=device, config=cfg, params=params,
        baseline_bytes=BASELINE_BYTES_PER_PARAM * params,
        resident_baseline_bytes=BASELINE_BYTES_PER_PARAM * params + resident_acts,
        peak_device_bytes=peak, peak_breakdown=dict(zip(CATEGORIES, peak_bytes, strict=True)),
        peak_at=(peak_event.unit, peak_event.phase), allocated_peak_bytes=allocated,
        fits=allocated + device.reserve_bytes <= device.memory_bytes,
        host_store_bytes=host_store, host_activation_bytes=host_acts, host_stores=stores,
        host_fits=(in_ram + host_acts) * stores <= device.host_ram_bytes,
        host_peak=host_bytes(shape, cfg, shared_peak(shape, moments, cfg, kept_masters(events, resident))
                             if device.same_memory else None),
        step_time_s=step_s, tokens_per_s=cfg.batch * seq / step_s,
        utilisation=model_flops / step_s / device.flops_for(cfg.precision.compute),
        model_flops=model_flops, bottleneck=timeline.bottleneck(),
        resource_s={r: timeline.busy[r] for r in RESOURCES},
        link_bytes={"h2d": sum(r.h2d_bytes for r in rows), "d2h": sum(r.d2h_bytes for r in rows),
                    "disk_read": sum(r.disk_read_bytes for r in rows),
                    "disk_write": sum(r.disk_write_bytes for r in rows),
                    "host_copy": sum(t.host_copy for t in timeline.per_unit.values())},
        max_batch_seq=None if max_batch is None else (max_batch, seq), max_seq=max_seq, rows=tuple(rows),
    )


@dataclass(frozen=True)
class ClippedStep:
    """A step that clips, made on one schedule, as planned: its seconds, the bytes its store's files read and
    write (the disk tier's), and its device peak."""

    schedule: str  # "after-backward" or "norm-first" (memory_model.step.CLIPPED_STEPS)
    step_s: float
    disk_read_bytes: int
    disk_write_bytes: int
    peak_bytes: int

    @classmethod
    def of(cls, schedule: str, planned: Plan) -> "ClippedStep":
        """A whole step's plan, as a schedule a step that clips takes."""
        return cls(schedule, planned.step_time_s, planned.link_bytes["disk_read"], planned.link_bytes["disk_write"],
                   planned.peak_device_bytes)


def norm_pass_events(shape: ModelConfig, cfg: PlanConfig) -> list[Event]:
    """A norm-first step's first pass: the step's forward and backward, nothing updated or stored."""
    return step_events(norm_pass_spec(planned_spec(shape, cfg)))


def norm_pass_peak(shape: ModelConfig, cfg: PlanConfig) -> int:
    """The device peak of a norm-first step's norm pass. Its events are the forward and backward of the update
    after the backward, so it is at most that step's peak."""
    events = norm_pass_events(shape, cfg)
    resident = resident_sets(events, cfg.step.prefetch)
    return max(sum(b) for _, b in _memory_walk(shape, cfg, events, resident, cfg.micro_batch, cfg.seq))


def clipped_steps(shape: ModelConfig, device: DeviceSpec, cfg: PlanConfig) -> dict[str, ClippedStep]:
    """Each schedule a step that clips can take under `cfg`, as planned. Where the update is not fused the
    step is after the backward already. A fused step that clips is made again after the backward, or, where
    `norm_first_allowed`, as a norm pass and the fused step clipped (`norm_pass_events`, then `cfg`'s own)."""
    after = cfg if not cfg.fused else cfg.replace(update_timing="after-backward")
    out = {"after-backward": ClippedStep.of("after-backward", plan(shape, device, after, limits=False))}
    if norm_first_allowed(cfg.fused, cfg.step.grad_accum):
        fused = plan(shape, device, cfg, limits=False)
        events = norm_pass_events(shape, cfg)
        resident = resident_sets(events, cfg.step.prefetch)
        norm_s = simulate(events, resident, shape, cfg, device, commits=False).end_s
        read, written = _disk_bytes_of(shape, cfg, events, norm_pass=True)
        out["norm-first"] = ClippedStep("norm-first", norm_s + fused.step_time_s,
                                        read + fused.link_bytes["disk_read"], written + fused.link_bytes["disk_write"],
                                        max(norm_pass_peak(shape, cfg), fused.peak_device_bytes))
    return out


def clipped_schedule(plans: dict[str, ClippedStep], setting: str) -> ClippedStep:
    """The schedule a step that clips takes, of `clipped_steps`' `plans`: the one --clipped-steps names where it
    applies, or, for `auto`, the faster planned."""
    return plans.get(setting) or min(plans.values(), key=lambda p: p.step_s)

