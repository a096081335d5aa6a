"""What a device is to the cost model: a memory capacity, links to the host, compute rates, and the host side.

Every number of a spec has a `Figure` behind it (value, basis, source): the presets' are in catalogue.py,
`local`'s are measured on the machine it runs on (streamer/calibration/calibrate.py). `FIGURES` names the
numeric fields, so that `streamer devices` lists them and `--set field=value` overrides any of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Sequence

from memory_model.catalogue import CATALOGUE, Figure
from memory_model.kernels import KernelCosts
from memory_model.settings import Assignments, Number, SettingError, shown
from memory_model.units import COMPUTE_DTYPES, SizeError, parse_size


GB = 10**9
GiB = 2**30
MiB = 2**20
TB = 10**12


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class Link:
    """One direction of a host<->device link: a transfer of n bytes takes latency + n / bandwidth."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        _positive("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        if not isinstance(self.latency_s, (int, float)) or not math.isfinite(self.latency_s) or self.latency_s < 0:
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s!r}")

    def time(self, nbytes: int) -> float:
        """Seconds to move nbytes; nothing to move costs nothing (no latency either)."""
        if nbytes < 0:
            raise ValueError(f"cannot transfer a negative number of bytes ({nbytes})")
        return 0.0 if nbytes == 0 else self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class DeviceSpec:
    """A device and the host that feeds it. Rates are bytes/s and FLOP/s; `flops` is keyed by dtype name."""

    name: str
    memory_bytes: int
    h2d: Link
    d2h: Link
    flops: dict[str, float]
    device_mem_bandwidth: float  # elementwise work on the device (the AdamW update), bytes touched per second
    host_ram_bytes: int
    disk_read_bw: float
    disk_write_bw: float
    host_update_bw: float  # elementwise work on the host (update_on="host"), bytes touched per second
    same_memory: bool = False  # host and device share one memory (the cpu device): copies are free
    # Device-to-device link for data-parallel all-reduce (ring bus bandwidth per direction); None: the
    # devices have no peer link and exchange through the host (d2h then h2d).
    interconnect: Link | None = None
    # One machine's network link to the others (per machine and direction): the part of a ring all-reduce
    # between machines crosses it. None: not known (a plan over several machines asks for it).
    inter_node: Link | None = None
    # The host's I/O to all its devices together, bytes/s each way, shared among the device streams it carries
    # (host_streams): MemoryX's, which serves every system. None: each device's own link is the only bound.
    host_io_bytes_per_s: float | None = None
    # Bytes/s one host copy moves between two host buffers (a pageable RAM slab into a pinned staging buffer), with
    # the threads the runtime spreads it over. None: not known, and host copies are not priced.
    host_copy_bw: float | None = None
    # Measured costs besides the matmuls, by compute dtype (see kernels.py); empty: the presets' HBM-byte model.
    kernels: dict[str, KernelCosts] = field(default_factory=dict)
    source: str = ""
    notes: tuple[str, ...] = field(default=())  # assumptions behind the figures, shown to users
    # Achievable shares of the peaks (catalogue.py): matmul and attention FLOP/s, and every bandwidth.
    matmul_efficiency: float = 1.0
    attention_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    # The best published end-to-end training MFU of the device's class: no plan's model FLOP/s exceeds this share
    # of the peak, whatever its kernels' shares (timing.py).
    training_mfu: float = 1.0
    reserve_bytes: int = 0  # device memory the runtime takes before any tensor (the CUDA context)
    # The CUDA compute capability ("sm90") of a device whose memory torch's CUDA caching allocator hands out:
    # its blocks are rounded and cuBLAS keeps workspaces (memory_model.allocator). "": none of that.
    cuda_arch: str = ""
    update_on: str = "device"  # where the update runs unless the plan says otherwise
    # How data-parallel gradients are summed: "ring" (over `interconnect`, or through the host when None) or
    # "in-network" (a broadcast/reduce tree such as SwarmX: each device sends its gradient once, at line rate).
    reduce: str = "ring"
    figures: dict[str, Figure] = field(default_factory=dict)  # FIGURES name -> value, basis, source

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a DeviceSpec needs a non-empty name")
        for name in ("memory_bytes", "host_ram_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer number of bytes, got {value!r}")
        for name in ("device_mem_bandwidth", "disk_read_bw", "disk_write_bw", "host_update_bw"):
            _positive(name, getattr(self, name))
        for name in ("host_io_bytes_per_s", "host_copy_bw"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not isinstance(self.h2d, Link) or not isinstance(self.d2h, Link):
            raise ValueError("h2d and d2h must be Link objects")
        for name in ("interconnect", "inter_node"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), Link):
                raise ValueError(f"{name} must be a Link or None")
        # The presets rate every dtype; `local` only the one it was calibrated for (flops_for names the gap).
        if not self.flops or set(self.flops) - set(COMPUTE_DTYPES):
            raise ValueError(f"flops must rate one or more of the compute dtypes {sorted(COMPUTE_DTYPES)}, "
                             f"got {sorted(self.flops)}")
        for dtype, rate in self.flops.items():
            _positive(f"flops[{dtype!r}]", rate)
        for dtype, costs in self.kernels.items():
            if dtype not in COMPUTE_DTYPES or not isinstance(costs, KernelCosts):
                raise ValueError(f"kernels maps a compute dtype {sorted(COMPUTE_DTYPES)} to KernelCosts; "
                                 f"got {dtype!r}: {type(costs).__name__}")
        for name in ("matmul_efficiency", "attention_efficiency", "bandwidth_efficiency", "training_mfu"):
            value = getattr(self, name)
            _positive(name, value)
            if value > 1:
                raise ValueError(f"{name} is a share of the peak, at most 1, got {value!r}")
        if isinstance(self.reserve_bytes, bool) or not isinstance(self.reserve_bytes, int) or self.reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be an integer >= 0, got {self.reserve_bytes!r}")
        if self.update_on not in ("device", "host") or self.reduce not in ("ring", "in-network"):
            raise ValueError(f"update_on is device or host and reduce is ring or in-network, got "
                             f"{self.update_on!r}, {self.reduce!r}")
        # Private copies: the dataclass is frozen, the caller's dicts are not.
        object.__setattr__(self, "figures", dict(self.figures))
        object.__setattr__(self, "flops", dict(self.flops))
        object.__setattr__(self, "kernels", dict(self.kernels))
        object.__setattr__(self, "notes", tuple(self.notes))

    def link_time(self, link: Link, nbytes: int) -> float:
        """Seconds to move nbytes over one of this device's links at its achievable share of the peak."""
        if nbytes == 0:
            return 0.0
        return link.latency_s + nbytes / (link.bandwidth_bytes_per_s * self.bandwidth_efficiency)

    def host_streams(self, devices: int, per_node: int | None = None) -> int:
        """The device streams the host's I/O carries at once. An in-network tree carries one: it broadcasts one
        weight stream to every device and sums their gradients into one (SwarmX, for MemoryX). Otherwise each
        device on the host (`per_node` of them; None: all) streams its own store."""
        if self.reduce == "in-network":
            return 1
        return devices if per_node is None else min(devices, per_node)

    def host_link_time(self, direction: str, nbytes: int, devices: int = 1, per_node: int | None = None) -> float:
        """Seconds to move nbytes between the host and one of `devices` devices ("h2d" or "d2h"). The device's own
        link bounds it, and so does its share of the host's I/O (`host_io_bytes_per_s` over `host_streams`).
        Through an in-network tree the bytes also pass the tree at its rate (`interconnect`), and a weight load
        waits one hop latency per tree level; the reduce's hops are `allreduce_time`'s."""
        if nbytes == 0:
            return 0.0
        link = self.h2d if direction == "h2d" else self.d2h
        rate, latency = link.bandwidth_bytes_per_s, link.latency_s
        if self.host_io_bytes_per_s is not None:
            rate = min(rate, self.host_io_bytes_per_s / self.host_streams(devices, per_node))
        if self.reduce == "in-network" and devices > 1:
            assert self.interconnect is not None
            rate = min(rate, self.interconnect.bandwidth_bytes_per_s)
            if direction == "h2d":
                latency += tree_levels(devices) * self.interconnect.latency_s
        return latency + nbytes / (rate * self.bandwidth_efficiency)

    def allreduce_time(self, nbytes: int, devices: int, per_node: int | None = None) -> float:
        """Summing nbytes of gradient over `devices`, `per_node` of them on each machine (None: all on one),
        beyond each device's own offload of it. A ring sends and receives 2 (n-1)/n of the data; over several
        machines it is hierarchical (as NCCL's and Horovod's): a ring inside each machine over its peer link,
        and between the m machines 2 (m-1)/m of the data through each machine's network link (`inter_node`).
        An in-network tree sums in flight as the offload passes through it (SwarmX, which joins the systems):
        one hop latency per tree level here, its bytes at the tree's rate in `host_link_time`."""
        if devices <= 1 or nbytes == 0:
            return 0.0
        if self.reduce == "in-network":
            assert self.interconnect is not None
            return tree_levels(devices) * self.interconnect.latency_s
        local = devices if per_node is None else min(devices, per_node)
        nodes = math.ceil(devices / local)
        moved = int(2 * (local - 1) / local * nbytes)
        if self.interconnect is not None:
            inside = self.link_time(self.interconnect, moved)
        else:
            inside = self.link_time(self.d2h, moved) + self.link_time(self.h2d, moved)
        if nodes == 1:
            return inside
        if self.inter_node is None:
            raise ValueError(f"{devices} devices at {local} per machine span {nodes} machines and {self.name} has no "
                             "figure for the network between them: --set inter_node_bytes_per_s=... (bytes/s per "
                             f"machine and direction), or --ranks-per-node {devices} to keep them on one")
        return inside + self.link_time(self.inter_node, int(2 * (nodes - 1) / nodes * nbytes))

    def flops_for(self, dtype: str) -> float:
        try:
            return self.flops[dtype]
        except KeyError:
            raise ValueError(f"{self.name} has no compute rate for dtype {dtype!r}, only for {sorted(self.flops)}"
                             + ("; calibrate it for that dtype" if self.name == "local" else "")) from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["h2d"] = {"bandwidth_bytes_per_s": self.h2d.bandwidth_bytes_per_s, "latency_s": self.h2d.latency_s}
        out["d2h"] = {"bandwidth_bytes_per_s": self.d2h.bandwidth_bytes_per_s, "latency_s": self.d2h.latency_s}
        for name in ("interconnect", "inter_node"):
            link = getattr(self, name)
            if link is not None:
                out[name] = {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s}
        out["kernels"] = {dtype: costs.to_dict() for dtype, costs in self.kernels.items()}
        out["notes"] = list(self.notes)
        out["figures"] = {name: f.to_dict() for name, f in self.figures.items()}
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DeviceSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown DeviceSpec field(s) {unknown}; valid: {sorted(known)}")
        values = dict(raw)
        values["h2d"] = Link(**raw["h2d"])
        values["d2h"] = Link(**raw["d2h"])
        for name in ("interconnect", "inter_node"):
            if raw.get(name) is not None:
                values[name] = Link(**raw[name])
        values["kernels"] = {dtype: KernelCosts.from_dict(c) for dtype, c in raw.get("kernels", {}).items()}
        values["notes"] = tuple(raw.get("notes", ()))
        values["figures"] = {name: Figure(**f) for name, f in raw.get("figures", {}).items()}
        return cls(**values)


def tree_levels(devices: int) -> int:
    """The levels of a 4-ary broadcast-reduce tree from the host to `devices` devices (SwarmX's 1:4 nodes,
    cerebras.net/glossary/swarmx), the host's own link counted."""
    return math.ceil(math.log(devices, 4)) + 1


# The numeric fields of a spec under the names the catalogue, `streamer devices` and `--set` use.
FIGURES = ("memory_bytes", "reserve_bytes", "h2d_bytes_per_s", "d2h_bytes_per_s", "link_latency_s", "bf16_flops",
           "fp32_flops", "matmul_efficiency", "attention_efficiency", "bandwidth_efficiency", "training_mfu",
           "device_mem_bandwidth", "host_ram_bytes", "disk_read_bw", "disk_write_bw", "host_update_bw",
           "interconnect_bytes_per_s", "interconnect_latency_s", "inter_node_bytes_per_s", "inter_node_latency_s",
           "host_io_bytes_per_s", "host_copy_bw")
_DIRECT = ("memory_bytes", "reserve_bytes", "matmul_efficiency", "attention_efficiency", "bandwidth_efficiency",
           "training_mfu", "device_mem_bandwidth", "host_ram_bytes", "disk_read_bw", "disk_write_bw", "host_update_bw")
_INTEGERS = ("memory_bytes", "reserve_bytes", "host_ram_bytes")


def figure_values(spec: DeviceSpec) -> dict[str, float]:
    """The spec's numbers by FIGURES name (a dtype it has no rate for, or a missing peer link, left out)."""
    out: dict[str, float] = {name: getattr(spec, name) for name in _DIRECT}
    out.update(h2d_bytes_per_s=spec.h2d.bandwidth_bytes_per_s, d2h_bytes_per_s=spec.d2h.bandwidth_bytes_per_s,
               link_latency_s=spec.h2d.latency_s)
    out.update({f"{dtype}_flops": rate for dtype, rate in spec.flops.items()})
    for name in ("interconnect", "inter_node"):
        link = getattr(spec, name)
        if link is not None:
            out.update({f"{name}_bytes_per_s": link.bandwidth_bytes_per_s, f"{name}_latency_s": link.latency_s})
    for name in ("host_io_bytes_per_s", "host_copy_bw"):
        if getattr(spec, name) is not None:
            out[name] = getattr(spec, name)
    return {name: out[name] for name in FIGURES if name in out}


def with_figures(spec: DeviceSpec, figures: dict[str, Figure]) -> DeviceSpec:
    """`spec` with the given figures replacing its own (values and provenance): `--set` and the presets."""
    unknown = sorted(set(figures) - set(FIGURES))
    if unknown:
        raise ValueError(f"unknown device field(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
    values = {**figure_values(spec), **{name: f.value for name, f in figures.items()}}
    direct: dict[str, Any] = {name: int(values[name]) if name in _INTEGERS else values[name] for name in _DIRECT}
    links: dict[str, Any] = {name: Link(values[f"{name}_bytes_per_s"], values.get(f"{name}_latency_s", 0.0))
             if f"{name}_bytes_per_s" in values else None for name in ("interconnect", "inter_node")}
    return replace(spec, **direct, h2d=Link(values["h2d_bytes_per_s"], values["link_latency_s"]),
                   d2h=Link(values["d2h_bytes_per_s"], values["link_latency_s"]),
                   flops={d: values[f"{d}_flops"] for d in COMPUTE_DTYPES if f"{d}_flops" in values},
                   **links, host_io_bytes_per_s=values.get("host_io_bytes_per_s"),
                   host_copy_bw=values.get("host_copy_bw"), figures={**spec.figures, **figures})


# `--set FIELD=NUMBER`: one figure replaced, for `streamer plan` and `streamer train` (RunConfig's `set`, recorded
# in a run's config.toml so that --resume and `plan --compare` replay it).
FIGURE_SETS = Assignments(FIGURES)
SET_SOURCE = "set on the command line (--set)"


def _figure_check(name: str) -> Number:
    """What a figure may be: a share of a peak is in (0, 1]; a reserve or a latency may be nothing."""
    if name.endswith("_efficiency") or name == "training_mfu":
        return Number(0.0, 1.0, low_open=True)
    return Number(0.0, low_open=not name.endswith("latency_s") and name != "reserve_bytes")


def parse_sets(sets: Sequence[str], error: Callable[[str, str], Exception] = SettingError) -> dict[str, Figure]:
    """--set's FIELD=NUMBER items as figures (basis assumed, source: the command line); a later one wins."""
    figures: dict[str, Figure] = {}
    for item in sets:
        if FIGURE_SETS((item,)) is None:
            raise error("set", f"must be {FIGURE_SETS.wanted()} (`streamer devices` lists them), got {shown(item)}")
        name, _, text = item.partition("=")
        check = _figure_check(name)
        if check(float(text)) is None:
            raise error("set", f"{name} must be {check.wanted()}, got {text}")
        figures[name] = Figure(float(text), "assumed", SET_SOURCE)
    return figures


def with_sets(spec: DeviceSpec, sets: Sequence[str], error: Callable[[str, str], Exception] = SettingError
              ) -> DeviceSpec:
    """`spec` with each --set figure in place of its own."""
    figures = parse_sets(sets, error)
    try:
        return with_figures(spec, figures) if figures else spec
    except ValueError as exc:
        raise error("set", f"{' '.join(sets)} on {spec.name}: {exc}") from None


def _preset(name: str) -> DeviceSpec:
    preset = CATALOGUE[name]
    figures = preset.figures
    v = {key: f.value for key, f in figures.items()}
    base = DeviceSpec(name=name, memory_bytes=1, h2d=Link(1.0), d2h=Link(1.0), flops={"bf16": 1.0},
                      device_mem_bandwidth=1.0, host_ram_bytes=1, disk_read_bw=1.0, disk_write_bw=1.0,
                      host_update_bw=1.0, update_on=preset.update_on, reduce=preset.reduce, notes=preset.notes,
                      cuda_arch=preset.cuda_arch,
                      interconnect=Link(1.0) if "interconnect_bytes_per_s" in v else None,
                      inter_node=Link(1.0) if "inter_node_bytes_per_s" in v else None,
                      source="docs/MEMORY_MODEL.md, Device catalogue (`streamer devices` lists every figure)")
    return with_figures(base, figures)


DEVICE_PRESETS: dict[str, DeviceSpec] = {name: _preset(name) for name in CATALOGUE}


def device_spec(name: str) -> DeviceSpec:
    """A preset by name. "local" (this machine) is measured, not described: the runtime calibrates it
    (streamer.calibration.calibrate.local_spec), which keeps this package free of torch."""
    try:
        return DEVICE_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; choose one of: {', '.join([*DEVICE_PRESETS, 'local'])}") from None


class Budget:
    """The check of a budget's type: a size ("64MiB", or bytes as an int), a device preset's name or a DeviceSpec;
    `budget_bytes` reads it (and says what is wrong with a size)."""

    def wanted(self) -> str:
        return f"a size such as 64MiB or a device preset ({', '.join(DEVICE_PRESETS)})"

    def __call__(self, value: Any) -> Any:
        if isinstance(value, (str, DeviceSpec)) or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        return None


def budget_bytes(budget: None | int | str | DeviceSpec, error: Callable[[str, str], Exception] = SettingError,
                 sets: Sequence[str] = ()) -> int | None:
    """A device budget in bytes: None (no limit), a device preset or spec (its memory less its reserve, after
    the --set figures), or a size ("64MiB", 3000000000). The one reading of --budget, for the run's settings,
    the trainer and `generate`."""
    parse_sets(sets, error)  # a wrong --set fails here whatever the budget
    if budget is None:
        return None
    if isinstance(budget, str) and budget in DEVICE_PRESETS:
        budget = DEVICE_PRESETS[budget]
    if isinstance(budget, DeviceSpec):  # what tensors may take: the memory less the runtime's own reserve
        budget = with_sets(budget, sets, error)
        if budget.reserve_bytes >= budget.memory_bytes:
            raise error("set", f"leaves {budget.name} no memory: reserve_bytes {budget.reserve_bytes} >= memory_bytes "
                               f"{budget.memory_bytes}; lower reserve_bytes")
        return budget.memory_bytes - budget.reserve_bytes
    try:
        size = parse_size(budget)
    except SizeError as exc:
        raise error("budget", f"{shown(budget)}: {exc}, or a device preset ({', '.join(DEVICE_PRESETS)})") from None
    if size <= 0:
        raise error("budget", "must be more than 0 bytes; leave it out for no limit")
    return size
