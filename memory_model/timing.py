"""Time of a step: the seconds of every load, compute and write-back, on the resources that do them.

Each resource is a queue that does one thing at a time: the device's compute, the host-to-device and the
device-to-host link (separate queues: PCIe, NVLink-C2C and Ethernet are full duplex), the peer interconnect,
the host's cores (the gradient fold and a host update), the host's copies (a pageable RAM slab into a pinned
staging buffer before it crosses, under --pin-memory staging or none; an update's new state from its pinned
buffer into its RAM slabs) at the host's copy rate, and the disk. Event k issues the loads of its
resident set that are not in flight (disk read, then h2d), waits for its own, computes; a backward's
gradient goes d2h (after its all-reduce under data parallel), is folded on the host and written to disk,
overlapping the next unit's backward, and is waited for when that one's gradient appears. An offloaded block
input goes d2h while its block's forward computes (the forward ends when both are done) and comes back h2d
as a load of the lookahead, before its backward. A host update runs
on the host's cores once the unit's gradient is folded: after the backward (update_timing "after-backward"),
or, "fused" into the backward or "overlapped" with it, while the device computes the backward of the units
before it. Rates are the catalogue's achievable shares of the peaks. docs/MEMORY_MODEL.md ("Time model").
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from layers.config import ModelConfig
from memory_model.lora import weights_bytes
from memory_model.devices import DeviceSpec
from memory_model.expert_groups import expert_group, grouped, grouped_block_numel
from memory_model.host import narrows_write_backs
from memory_model.shapes import PlanConfig, block_input_numel, forward_flops
from memory_model.kernels import KernelCosts, attention_flops, gpu_elementwise_bytes
from memory_model.tiers import RAM
from memory_model.schedule import (
    BlockInput, Event, ExpertGroup, Resource, StateChunk, fetched_input, folded_by_chunk, load_disk_bytes,
    load_gradient_bytes, releases, resource_charges, store_bytes, updated_from_backward, Weights,
)

RESOURCES = ("device compute", "h2d", "d2h", "interconnect", "host compute", "host copy", "disk")
# --pin-memory modes whose RAM slabs are copied on the host before they cross (streamer/runtime/transport.py,
# crosses_directly): into a staging buffer ("staging"), or by the CUDA driver ("none").
STAGED_PIN_MODES = ("staging", "none")
# A unit's new state file is sealed with three flushes (streamer/store/files.py, GenerationWriter.finish): its
# data, then its trailer and size, then its folder once it is renamed into place.
SEAL_FLUSHES = 3
# Every commit flushes its manifest and the manifest's folder: a fused step's only flushes besides the seals.
MANIFEST_FLUSHES = 2


@dataclass
class UnitTimes:
    """One unit's share of a step: seconds per stage (before overlap) and bytes over each link."""

    load_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    offload_s: float = 0.0
    update_s: float = 0.0
    h2d: int = 0
    d2h: int = 0
    host_copy: int = 0
    disk_read: int = 0
    disk_write: int = 0
    # Disk-tier bytes read through the page cache: the gradient files, just written through it. The state files
    # are read past it (streamer.store.direct), straight into their buffers.
    cached_read: int = 0


@dataclass
class Timeline:
    end_s: float
    per_unit: dict[str, UnitTimes]
    busy: dict[str, float] = field(default_factory=lambda: dict.fromkeys(RESOURCES, 0.0))  # seconds per resource

    def bottleneck(self) -> str:
        """The resource busy longest in the step: the one that bounds it."""
        return max(self.busy, key=self.busy.__getitem__)


class _Queues:
    """Each resource's busy intervals; `run` books `seconds` in its first idle gap from `after` on. A job booked
    ahead (a host update waiting for its gradient) leaves the time before it to jobs booked later."""

    def __init__(self, timeline: Timeline) -> None:
        self.intervals: dict[str, list[list[float]]] = {r: [] for r in RESOURCES}  # sorted, disjoint [start, end]
        self.busy = timeline.busy

    def run(self, resource: str, after: float, seconds: float) -> float:
        if seconds == 0.0:
            return after
        booked = self.intervals[resource]
        i = bisect.bisect_right(booked, [after, math.inf]) - 1
        start = max(after, booked[i][1]) if i >= 0 else after
        i += 1
        while i < len(booked) and booked[i][0] < start + seconds:
            start, i = max(start, booked[i][1]), i + 1
        end = start + seconds
        # Insert, merging with the neighbours it touches, so a queue that never idles stays one interval.
        if i > 0 and booked[i - 1][1] == start:
            booked[i - 1][1] = end
            if i < len(booked) and booked[i][0] == end:
                booked[i - 1][1] = booked.pop(i)[1]
        elif i < len(booked) and booked[i][0] == end:
            booked[i][0] = start
        else:
            booked.insert(i, [start, end])
        self.busy[resource] += seconds
        return end

    def last_end(self) -> float:
        return max((b[-1][1] for b in self.intervals.values() if b), default=0.0)


def _link(nbytes: int, device: DeviceSpec, direction: str, cfg: PlanConfig) -> float:
    # The cpu device is the host's RAM: a RAM-tier slab is handed over as it is, nothing crosses a link.
    if device.same_memory:
        return 0.0
    return device.host_link_time(direction, nbytes, cfg.devices, cfg.ranks_per_node)


def _host_copy_s(nbytes: int, device: DeviceSpec) -> float:
    """A copy of nbytes from one host buffer into another at the host's copy rate; none where host and device
    share memory (a RAM slab is handed over as it is) or where the device has no host copy rate."""
    if device.same_memory or device.host_copy_bw is None:
        return 0.0
    return nbytes / device.host_copy_bw


def _load(resource: Resource, shape: ModelConfig, cfg: PlanConfig, device: DeviceSpec, times: UnitTimes,
          queues: _Queues, issued: float, staged: bool) -> float:
    """Book a load (disk read, or the copy of its RAM slab into a staging buffer where `staged`; then the h2d
    copy); returns when it is on the device."""
    # What a load moves is what the resource holds on a device that runs the update (the schedule's charges);
    # with the update on the host a chunk is read from disk but does not cross the link. A block input comes
    # from host memory, not from the store.
    numel = _numel(resource, shape, cfg)
    nbytes = sum(c.nbytes for c in resource_charges(resource, numel, cfg.dtype_bytes, "device"))
    if isinstance(resource, Weights) and cfg.lora.quantized:  # a quantized base's units: their packed bytes
        numel = nbytes = weights_bytes(shape, cfg.lora, resource.unit, cfg.dtype_bytes)
    store, sizes = cfg.step.store, store_bytes(cfg)
    disk = load_disk_bytes(resource, numel, sizes)
    if isinstance(resource, Weights) and cfg.lora.enabled:  # a frozen base: read as stored, where stored on disk
        disk = nbytes if store.compute.crosses_link else 0
    # Weights come from the state files only where the loads read the master; else from the RAM copy.
    in_ram = store.state.zero_copy or (isinstance(resource, (Weights, ExpertGroup))
                                      and not store.loads_read_master(cfg.compute_is_master))
    h2d = nbytes if not isinstance(resource, StateChunk) or cfg.step.update_on == "device" else 0
    read_s, copy_s = disk / device.disk_read_bw, _link(h2d, device, "h2d", cfg)
    read_s += _moments_s(resource, cfg, device, "dequantize_s")  # the I/O worker decodes what it read
    # A RAM slab staged on the host: the buffer it fills is what crosses (a bf16 moment widened on the way).
    host_copy = h2d if staged and in_ram and not isinstance(resource, BlockInput) else 0
    stage_s = _host_copy_s(host_copy, device)
    times.load_s += read_s + stage_s + copy_s
    times.h2d += h2d
    times.host_copy += host_copy
    times.disk_read += disk
    times.cached_read += load_gradient_bytes(resource, sizes)
    return queues.run("h2d", queues.run("host copy", queues.run("disk", issued, read_s), stage_s), copy_s)


def _moments_s(resource: Resource, cfg: PlanConfig, device: DeviceSpec, cost: str) -> float:
    """A state chunk's int8 moments (de)quantized on the host, where that is measured (`local`); else none."""
    costs = device.kernels.get(cfg.precision.compute)
    if costs is None or cfg.precision.moments != "int8" or not isinstance(resource, StateChunk):
        return 0.0
    return 2 * resource.count * getattr(costs, cost)


def _numel(resource: Resource, shape: ModelConfig, cfg: PlanConfig) -> int:
    """A resource's elements: its unit's parameters on the device (a tied head's include the embedding's; a block
    whose experts load in groups: all but its experts), a group of experts', or a block input's (B, T, d)."""
    if isinstance(resource, BlockInput):
        return block_input_numel(shape, cfg.micro_batch, cfg.seq)
    if isinstance(resource, ExpertGroup):
        return expert_group(shape, cfg) * shape.params().expert()
    if grouped(shape, cfg, resource.unit):
        return grouped_block_numel(shape, expert_group(shape, cfg))
    return shape.params().device(resource.unit)


def _group_loads(event: Event, shape: ModelConfig, cfg: PlanConfig, device: DeviceSpec, times: UnitTimes,
                 queues: _Queues, start: float, staged: bool) -> float:
    """A grouped block's experts loaded inside its event, one group at a time, the compute waiting for each (its
    forward's, and its backward's: once more for a checkpointed block's recompute); returns when the last is on
    the device."""
    if event.phase not in ("forward", "backward") or not grouped(shape, cfg, event.unit):
        return start
    passes = 2 if event.phase == "backward" and cfg.step.recomputes else 1
    groups = shape.params().experts() // expert_group(shape, cfg)
    for g in [*range(groups)] * passes:
        start = _load(ExpertGroup(event.unit, g), shape, cfg, device, times, queues, start, staged)
    return start


def _input_out(event: Event, shape: ModelConfig, cfg: PlanConfig, device: DeviceSpec, times: UnitTimes,
               queues: _Queues, start: float) -> float:
    """Book an offloaded block input's copy to the host, issued as its forward starts; returns when it is done."""
    stash = event.stash
    assert stash is not None  # booked only for a forward that offloads its input
    nbytes = sum(c.nbytes for c in resource_charges(stash, _numel(stash, shape, cfg), cfg.dtype_bytes, "device"))
    d2h_s = _link(nbytes, device, "d2h", cfg)
    times.d2h += nbytes
    times.offload_s += d2h_s
    return queues.run("d2h", start, d2h_s)


def _compute(event: Event, shape: ModelConfig, cfg: PlanConfig, device: DeviceSpec) -> float:
    costs = device.kernels.get(cfg.precision.compute)
    fixed = 0.0 if costs is None else costs.fixed_s(cfg.step.store.state)[0]
    return fixed + _kernels(event, shape, cfg, device, costs)


def _kernels(event: Event, shape: ModelConfig, cfg: PlanConfig, device: DeviceSpec,
             costs: KernelCosts | None) -> float:
    if event.phase == "update":
        if cfg.step.update_on == "device":
            bandwidth = device.device_mem_bandwidth * device.bandwidth_efficiency
        else:
            bandwidth = device.host_update_bw  # a measured or published update rate: already achievable
        # The new compute weights (the master cast down) where the kernels beside the matmuls are measured;
        # the matmul-only model leaves this elementwise kernel out with the others.
        cast = 0.0
        if costs is not None and cfg.new_compute_bytes:
            cast = event.chunk.count * (4 + cfg.new_compute_bytes) / costs.compute_cast_bytes_per_s
        if costs is not None and cfg.precision.master == "bf16":
            cast += event.chunk.count * costs.round_s  # the stochastic rounding of the bf16 master
        if narrows_write_backs(cfg.step, cfg.lora.enabled, device.same_memory):  # for its write-back, here
            cast += _moments_s(event.resource, cfg, device, "quantize_s")
        return cfg.update_touched_bytes(event.chunk.count) / bandwidth + cast
    unit = event.unit
    rate = device.flops_for(cfg.precision.compute) * device.matmul_efficiency
    matmuls = forward_flops(shape, unit, cfg.micro_batch, cfg.seq)
    # A backward's matmuls: the gradient w.r.t. the input and w.r.t. the weights; a frozen (LoRA) base makes
    # only the first (its adapters' matmuls are rank-sized, left out).
    passes = 1 if cfg.lora.enabled else 2
    attention = attention_flops(shape, cfg.micro_batch, cfg.seq) if unit.startswith("block.") else 0
    if costs is None:  # a preset: matmuls and attention at their achievable rates, the rest over HBM
        attention_rate = device.flops_for(cfg.precision.compute) * device.attention_efficiency
        forward = (matmuls - attention) / rate + attention / attention_rate
        backward = passes * forward + _beside_matmuls_s(event, shape, cfg, device, "backward")
        forward = max(forward + _beside_matmuls_s(event, shape, cfg, device, "forward"),
                      _mfu_floor_s(matmuls, device, cfg))
        backward = max(backward, _mfu_floor_s(passes * matmuls, device, cfg))
    else:
        forward = (matmuls - attention) / rate + costs.forward_s(shape, unit, cfg.micro_batch, cfg.seq)
        backward = passes * (matmuls - attention) / rate + costs.backward_s(shape, unit, cfg.micro_batch, cfg.seq)
    if event.phase == "forward":  # (DPO with LoRA: the reference's forward too, on the same weights)
        return forward * (2 if cfg.reference_in_step and unit != "embed" else 1)
    recompute = forward if cfg.step.recomputes and unit.startswith("block.") else 0.0
    return backward + recompute


def _beside_matmuls_s(event: Event, shape: ModelConfig, cfg: PlanConfig, device: DeviceSpec, phase: str) -> float:
    """A preset's kernels beside the matmuls and attention (kernels.gpu_elementwise_bytes): memory-bound, at
    the HBM bandwidth's achievable share."""
    nbytes = gpu_elementwise_bytes(shape, event.unit, phase, cfg.micro_batch, cfg.seq, cfg.dtype_bytes)
    return nbytes / (device.device_mem_bandwidth * device.bandwidth_efficiency)


def _mfu_floor_s(flops: float, device: DeviceSpec, cfg: PlanConfig) -> float:
    """The least time `flops` of model FLOPs take: no step runs above the best published training MFU of its
    device class (DeviceSpec.training_mfu), whatever the shares of its single kernels."""
    return flops / (device.flops_for(cfg.precision.compute) * device.training_mfu)


def folds_inline(cfg: PlanConfig, device: DeviceSpec) -> bool:
    """The runtime folds a gradient on the compute thread when the device is the host's own cores and the
    accumulator is in RAM (streamer/runtime/executor.py): the fold then adds to the compute time."""
    return device.same_memory and cfg.step.store.grad.zero_copy and cfg.devices == 1


def _gradient_out(event: Event, shape: ModelConfig, cfg: PlanConfig, device: DeviceSpec, times: UnitTimes,
                  queues: _Queues, clock: float) -> tuple[float, float]:
    """Book a backward's gradient offload: (seconds on the compute thread, when the offload is done)."""
    es, disk = cfg.dtype_bytes, cfg.step.store.grad.crosses_link
    params = shape.params().device(event.unit)  # a tied head's gradient holds the embedding's part too
    grad = params * es
    first, last = event.micro == 0, event.micro == cfg.step.grad_accum - 1
    # The host folds the gradient into its fp32 accumulator (the first micro-batch writes it, later ones
    # read and write it); after the last one it reads it once more for the global norm. Under data
    # parallel the offload first waits for the fp32 all-reduce of this gradient.
    touched = params * (es + (4 if first else 8)) + (4 * params if last else 0)
    # A tied head folds the embedding's part into the embedding's accumulator, which keeps it for the
    # embedding's own backward, which then always reads it (schedule.disk_bytes).
    own = shape.params().own(event.unit)
    borrowed = params - own
    lent = event.unit in shape.params().lenders()
    read = 0 if not disk else 4 * (own * (not first or lent) + borrowed * (not first))
    # A fused update keeps its last, but for a unit folded by chunk, whose update reads it back chunk by chunk
    # unless it takes it from the backward.
    reread = folded_by_chunk(shape, cfg.step, cfg.shards) - updated_from_backward(shape, cfg.step, cfg.devices)
    kept = cfg.fused and last and event.unit not in reread
    write = 0 if not disk else 4 * (own * (not kept) + borrowed)
    costs = device.kernels.get(cfg.precision.compute)
    fold_s = touched / (device.host_update_bw if costs is None else costs.gradient_fold_bytes_per_s)
    disk_s = read / device.disk_read_bw + write / device.disk_write_bw
    reduce_s = device.allreduce_time(4 * params, cfg.devices, cfg.ranks_per_node)
    d2h_s = _link(grad, device, "d2h", cfg)
    times.d2h += grad
    times.disk_read += read
    times.cached_read += read
    times.disk_write += write
    times.offload_s += reduce_s + d2h_s + fold_s + disk_s
    if folds_inline(cfg, device):
        queues.busy["host compute"] += fold_s
        return fold_s, clock + fold_s
    done = queues.run("d2h", queues.run("interconnect", clock, reduce_s), d2h_s)
    return 0.0, queues.run("disk", queues.run("host compute", done, fold_s), disk_s)


def _disk_s(cfg: PlanConfig, device: DeviceSpec, cost: str) -> float:
    """A disk-tier file's fixed cost, where it is measured (`local`); else none: `flush_s`, one flush of a commit
    (a file made durable), or `state_file_s`, a state file's cost beyond its bytes (opened, sealed, renamed)."""
    costs = device.kernels.get(cfg.precision.compute)
    return getattr(costs, cost) if costs is not None and cfg.step.store.state.crosses_link else 0.0


def unmeasured_flushes(shape: ModelConfig, cfg: PlanConfig) -> int:
    """The flushes of a disk-tier step that its measured fixed costs (`KernelCosts.disk_event_s` and
    `disk_step_s`, timed on a fused step) do not hold: those its commit makes beyond a fused step's."""
    return max(0, commit_flushes(shape, cfg) - MANIFEST_FLUSHES)


def commit_flushes(shape: ModelConfig, cfg: PlanConfig) -> int:
    """The flushes a disk-tier step's commit makes on the trainer's thread (streamer/store/host.py), besides the
    SEAL_FLUSHES of each unit's state file on the I/O thread: the manifest and its folder; a journaled step (the
    update after the backward) first each unit's gradient file, and the journal and its folder; LoRA's
    adapters file before the manifest."""
    if not cfg.step.store.state.durable:
        return 0
    if cfg.lora.enabled:
        return 1 + MANIFEST_FLUSHES
    return MANIFEST_FLUSHES if cfg.fused else len(shape.unit_names()) + 2 + MANIFEST_FLUSHES


def _state_out(event: Event, cfg: PlanConfig, device: DeviceSpec, times: UnitTimes, queues: _Queues,
               after: float) -> float:
    """Book an update chunk's write-back (new master, moments and compute weights to the store). After a unit's
    last chunk its new state file is sealed (SEAL_FLUSHES) and renamed: the state file's own cost."""
    out = cfg.store_bytes(event.chunk.count)
    d2h = out if cfg.step.update_on == "device" else 0
    # Back from the device into a pinned buffer, then copied into the RAM slabs; state files take the buffer's
    # master and moments, and new compute weights (none with them on disk) go to their RAM slab.
    to_ram = out if cfg.step.store.state.zero_copy else event.chunk.count * cfg.new_compute_bytes
    write = out - to_ram
    host_copy = to_ram if d2h else 0
    d2h_s, copy_s = _link(d2h, device, "d2h", cfg), _host_copy_s(host_copy, device)
    write_s = write / device.disk_write_bw
    if not narrows_write_backs(cfg.step, cfg.lora.enabled, device.same_memory):  # the update narrowed them
        write_s += _moments_s(event.resource, cfg, device, "quantize_s")
    if event.chunk.last:
        write_s += _disk_s(cfg, device, "state_file_s")
    times.d2h += d2h
    times.host_copy += host_copy
    times.disk_write += write
    times.offload_s += d2h_s + copy_s + write_s
    return queues.run("disk", queues.run("host copy", queues.run("d2h", after, d2h_s), copy_s), write_s)


def simulate(events: list[Event], resident: list[list[Resource]], shape: ModelConfig, cfg: PlanConfig,
             device: DeviceSpec, commits: bool = True, pin_memory: str = "all") -> Timeline:
    """The timeline of `events`; `commits=False`: a norm-first step's norm pass, which commits nothing, so its
    fixed cost is a step's without a commit (the RAM tier's). `pin_memory`: the run's --pin-memory, whose
    staging copies (STAGED_PIN_MODES) are priced; "all", the pinned store of the published runs, by default."""
    staged = pin_memory in STAGED_PIN_MODES
    timeline = Timeline(0.0, {u: UnitTimes() for u in shape.unit_names()})
    per_unit, queues = timeline.per_unit, _Queues(timeline)
    clock = 0.0  # the compute thread
    offload_done = 0.0  # when the last gradient offload finishes
    first_unit = shape.unit_names()[0]
    in_flight: set[Resource] = set()
    ready: dict[Resource, float] = {}
    # The host's cores run a host update; on a cpu device those are the compute thread's own cores. Overlapped,
    # a unit's chunks are booked on the host as soon as its last gradient is folded, between later folds.
    host_update = cfg.step.update_on == "host" and not device.same_memory
    early = host_update and cfg.step.update_timing == "overlapped"
    chunks = {u: [e for e in events if e.phase == "update" and e.unit == u] for u in shape.unit_names()}
    booked: set[Event] = set()
    ends = [0.0]

    def host_chunk(event: Event, after: float) -> None:
        times = per_unit[event.unit]
        if event.resource not in in_flight:  # overlapped: the host reads the state when it starts
            ready[event.resource] = _load(event.resource, shape, cfg, device, times, queues, after, staged)
            in_flight.add(event.resource)
        compute = _compute(event, shape, cfg, device)
        times.update_s += compute
        done = queues.run("host compute", max(after, ready[event.resource]), compute)
        ends.append(_state_out(event, cfg, device, times, queues, done))
        booked.add(event)

    for k, event in enumerate(events):
        if event in booked:
            continue
        for r in resident[k]:
            if r not in in_flight:
                ready[r] = _load(r, shape, cfg, device, per_unit[r.unit], queues, clock, staged)
                in_flight.add(r)
        if event.phase == "update" and host_update:  # fused: once the unit's gradient is folded
            host_chunk(event, max(clock, offload_done))
            continue
        compute = _compute(event, shape, cfg, device)
        times = per_unit[event.unit]
        fetched = fetched_input(event) or event.resource
        start = max(clock, ready[event.resource], ready[fetched])  # a backward waits for its input too
        clock = _group_loads(event, shape, cfg, device, times, queues, start, staged) + compute
        if event.phase == "forward" and event.stash is not None:  # the forward waits for its input's copy out
            clock = max(clock, _input_out(event, shape, cfg, device, times, queues, start))
        if event.phase == "update":
            times.update_s += compute
            queues.busy["host compute" if cfg.step.update_on == "host" else "device compute"] += compute
            ends.append(_state_out(event, cfg, device, times, queues, clock))
        else:
            queues.busy["device compute"] += compute
            if event.phase == "forward":
                times.forward_s += compute
            else:
                times.backward_s += compute
        if event.phase == "backward" and not cfg.lora.enabled:  # a frozen base has no gradient to offload
            # The previous unit's offload overlapped this backward; it is waited for when this gradient
            # appears, and the first unit's own offload before the update or the next micro-batch.
            clock = max(clock, offload_done)
            inline_s, offload_done = _gradient_out(event, shape, cfg, device, times, queues, clock)
            clock += inline_s
            if early and event.micro == cfg.step.grad_accum - 1:
                for chunk in chunks[event.unit]:
                    host_chunk(chunk, offload_done)
            if event.unit == first_unit:
                clock = max(clock, offload_done)
        in_flight.difference_update(releases(events, k))
    costs = device.kernels.get(cfg.precision.compute)
    # The step's own fixed cost (the loss, the commit).
    step_s = 0.0 if costs is None else costs.fixed_s(cfg.step.store.state if commits else RAM)[1]
    if commits:  # the trainer's thread waits for each flush
        step_s += unmeasured_flushes(shape, cfg) * _disk_s(cfg, device, "flush_s")
    if costs is not None and device.same_memory and cfg.step.store.state.crosses_link:
        # The host's cores copy what a disk-tier step writes (into the page cache, or a direct write's staging
        # buffer) and what it reads through the page cache; on a cpu device they are the cores that compute, so
        # the copies take their time from the step.
        moved = sum(t.cached_read + t.disk_write for t in per_unit.values())
        step_s += moved / costs.page_cache_bytes_per_s
    queues.busy["device compute"] += step_s
    timeline.end_s = max(clock, offload_done, *ends, queues.last_end()) + step_s
    return timeline
