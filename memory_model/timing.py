"""Time of a step: the seconds of every load, compute and write-back, overlapped the way the runtime does.

The runtime has one compute thread and one I/O worker that runs jobs in submission order (loads, gradient
offloads, update write-backs). Event k issues the loads of its resident set that are not in flight when it
starts, waits for its own, computes; a backward's gradient offload (with its all-reduce under data parallel)
overlaps the next unit's backward and is waited for when that one's gradient appears; an update chunk's
write-back is left queued. Assumptions are listed in
docs/MEMORY_MODEL.md ("Time model").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from layers.config import GPTJConfig
from memory_model.devices import DeviceSpec
from memory_model.shapes import (
    GRAD_ACCUM_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM, UPDATE_TOUCHED_BYTES_PER_PARAM, PlanConfig, forward_flops,
)
from memory_model.kernels import attention_flops
from memory_model.schedule import Event, Resource, Weights, released_after, resource_charges


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
    disk_read: int = 0
    disk_write: int = 0


@dataclass
class Timeline:
    end_s: float
    per_unit: dict[str, UnitTimes]
    busy: dict[str, float] = field(default_factory=dict)  # "compute" and "io" seconds, before overlap

    def bottleneck(self) -> str:
        return max(self.busy, key=self.busy.__getitem__)


def _link(nbytes: int, device: DeviceSpec, direction: str) -> float:
    # The cpu device is the host's RAM: a RAM-tier slab is handed over as it is, nothing crosses a link.
    if device.same_memory or nbytes == 0:
        return 0.0
    return (device.h2d if direction == "h2d" else device.d2h).time(nbytes)


def _load(resource: Resource, shape: GPTJConfig, cfg: PlanConfig, device: DeviceSpec, times: UnitTimes) -> float:
    weights = isinstance(resource, Weights)
    # What a load moves is what the resource holds on a device that runs the update (the schedule's charges);
    # with the update on the host a chunk is read from disk but does not cross the link.
    nbytes = sum(c.nbytes for c in resource_charges(resource, shape.unit_params(resource.unit), cfg.dtype_bytes,
                                                      "device"))
    disk = nbytes if cfg.store == "disk" else 0
    if cfg.fused and not weights:  # a fused update's gradient comes from the backward, not from the disk
        disk -= resource.count * GRAD_ACCUM_BYTES_PER_PARAM
    h2d = nbytes if weights or cfg.update_on == "device" else 0
    seconds = _link(h2d, device, "h2d") + disk / device.disk_read_bw
    times.load_s += seconds
    times.h2d += h2d
    times.disk_read += disk
    return seconds


def _compute(event: Event, shape: GPTJConfig, cfg: PlanConfig, device: DeviceSpec) -> float:
    if event.phase == "update":
        bandwidth = device.device_mem_bandwidth if cfg.update_on == "device" else device.host_update_bw
        return event.resource.count * UPDATE_TOUCHED_BYTES_PER_PARAM / bandwidth
    unit, rate = event.unit, device.flops_for(cfg.compute_dtype)
    costs = device.kernels.get(cfg.compute_dtype)
    matmuls = forward_flops(shape, unit, cfg.micro_batch, cfg.seq)
    if costs is None:  # the matmul-only model: attention at the matmul rate, nothing else costs time
        forward = matmuls / rate
        backward = 2 * forward
    else:
        if unit.startswith("block."):
            matmuls -= attention_flops(shape, cfg.micro_batch, cfg.seq)
        forward = matmuls / rate + costs.forward_s(shape, unit, cfg.micro_batch, cfg.seq)
        backward = 2 * matmuls / rate + costs.backward_s(shape, unit, cfg.micro_batch, cfg.seq)
    if event.phase == "forward":
        return forward
    recompute = forward if cfg.activations == "checkpoint" and unit.startswith("block.") else 0.0
    return backward + recompute


def folds_inline(cfg: PlanConfig, device: DeviceSpec) -> bool:
    """The runtime folds a gradient on the compute thread when the device is the host's own cores and the
    accumulator is in RAM (streamer/runtime/executor.py): the fold then adds to the compute time."""
    return device.same_memory and cfg.store == "ram" and cfg.devices == 1


def _write_back(event: Event, shape: GPTJConfig, cfg: PlanConfig, device: DeviceSpec, times: UnitTimes) -> float:
    es, disk = cfg.dtype_bytes, cfg.store == "disk"
    if event.phase == "backward":
        params = shape.unit_params(event.unit)
        grad = params * es
        first, last = event.micro == 0, event.micro == cfg.grad_accum - 1
        # The host folds the gradient into its fp32 accumulator (the first micro-batch writes it, later ones
        # read and write it); after the last one it reads it once more for the global norm. Under data
        # parallel the offload first waits for the fp32 all-reduce of this gradient.
        touched = params * (es + (4 if first else 8)) + (4 * params if last else 0)
        read = 0 if first or not disk else 4 * params
        write = 4 * params if disk and not (cfg.fused and last) else 0  # a fused update keeps the last one
        costs = device.kernels.get(cfg.compute_dtype)
        fold_bw = device.host_update_bw if costs is None else costs.gradient_fold_bytes_per_s
        seconds = (device.allreduce_time(4 * params, cfg.devices) + _link(grad, device, "d2h")
                   + touched / fold_bw + read / device.disk_read_bw + write / device.disk_write_bw)
        times.d2h += grad
    else:  # an update chunk: new master, moments and compute weights go back to the store
        out = event.resource.count * (OPTIMIZER_BYTES_PER_PARAM + cfg.new_compute_bytes)
        d2h = out if cfg.update_on == "device" else 0
        read, write = 0, out if disk else 0
        seconds = _link(d2h, device, "d2h") + write / device.disk_write_bw
        times.d2h += d2h
    times.offload_s += seconds
    times.disk_read += read
    times.disk_write += write
    return seconds


def simulate(events: list[Event], resident: list[list[Resource]], shape: GPTJConfig, cfg: PlanConfig,
             device: DeviceSpec) -> Timeline:
    per_unit = {u: UnitTimes() for u in shape.unit_names()}
    busy = {"compute": 0.0, "io": 0.0}
    clock = io_free = 0.0
    offload_done = 0.0  # when the last gradient offload (queued on the I/O worker) finishes
    first_unit = shape.unit_names()[0]
    in_flight: set[Resource] = set()
    inline = folds_inline(cfg, device)
    ready: dict[Resource, float] = {}
    for k, event in enumerate(events):
        for r in resident[k]:
            if r not in in_flight:
                seconds = _load(r, shape, cfg, device, per_unit[r.unit])
                io_free = max(io_free, clock) + seconds
                ready[r] = io_free
                in_flight.add(r)
                busy["io"] += seconds
        compute = _compute(event, shape, cfg, device)
        times = per_unit[event.unit]
        if event.phase == "update":
            times.update_s += compute
        elif event.phase == "forward":
            times.forward_s += compute
        else:
            times.backward_s += compute
        clock = max(clock, ready[event.resource]) + compute
        busy["compute"] += compute
        if event.phase == "backward":
            # The previous unit's offload overlapped this backward; it is waited for when this gradient
            # appears, and the first unit's own offload before the update or the next micro-batch.
            clock = max(clock, offload_done)
        if event.phase != "forward":
            seconds = _write_back(event, shape, cfg, device, times)
            if event.phase == "backward" and inline:
                clock += seconds
                busy["compute"] += seconds
            else:
                io_free = max(io_free, clock) + seconds
                busy["io"] += seconds
                if event.phase == "backward":
                    offload_done = io_free
                    if event.unit == first_unit:
                        clock = io_free
        if released_after(events, k):
            in_flight.discard(event.resource)
    return Timeline(max(clock, io_free), per_unit, busy)
