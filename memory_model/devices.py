"""What a device is to the cost model: a memory capacity, links to the host, compute rates, and the host side.

Every preset figure carries its source; figures no vendor publishes are marked ASSUMED here and in
docs/MEMORY_MODEL.md. `local` is measured on the machine it runs on (see calibrate.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from memory_model.kernels import KernelCosts
from memory_model.settings import SettingError, shown
from memory_model.units import COMPUTE_DTYPES, SizeError, parse_size


# Bytes per element of each compute dtype the planner and the runtime support.

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
    # Measured costs besides the matmuls, by compute dtype (see kernels.py); empty: the matmul-only model.
    kernels: dict[str, KernelCosts] = field(default_factory=dict)
    source: str = ""
    notes: tuple[str, ...] = field(default=())  # assumptions behind the figures, shown to users

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a DeviceSpec needs a non-empty name")
        for name in ("memory_bytes", "host_ram_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer number of bytes, got {value!r}")
        for name in ("device_mem_bandwidth", "disk_read_bw", "disk_write_bw", "host_update_bw"):
            _positive(name, getattr(self, name))
        if not isinstance(self.h2d, Link) or not isinstance(self.d2h, Link):
            raise ValueError("h2d and d2h must be Link objects")
        if self.interconnect is not None and not isinstance(self.interconnect, Link):
            raise ValueError("interconnect must be a Link or None")
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
        # Private copies: the dataclass is frozen, the caller's dicts are not.
        object.__setattr__(self, "flops", dict(self.flops))
        object.__setattr__(self, "kernels", dict(self.kernels))
        object.__setattr__(self, "notes", tuple(self.notes))

    def allreduce_time(self, nbytes: int, devices: int) -> float:
        """Ring all-reduce of nbytes over `devices`: each device sends and receives 2 (n-1)/n of the data."""
        if devices <= 1 or nbytes == 0:
            return 0.0
        moved = int(2 * (devices - 1) / devices * nbytes)
        if self.interconnect is not None:
            return self.interconnect.time(moved)
        return self.d2h.time(moved) + self.h2d.time(moved)

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
        if self.interconnect is not None:
            out["interconnect"] = {"bandwidth_bytes_per_s": self.interconnect.bandwidth_bytes_per_s,
                                   "latency_s": self.interconnect.latency_s}
        out["kernels"] = {dtype: costs.to_dict() for dtype, costs in self.kernels.items()}
        out["notes"] = list(self.notes)
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
        if raw.get("interconnect") is not None:
            values["interconnect"] = Link(**raw["interconnect"])
        values["kernels"] = {dtype: KernelCosts.from_dict(c) for dtype, c in raw.get("kernels", {}).items()}
        values["notes"] = tuple(raw.get("notes", ()))
        return cls(**values)


# Host side of a GPU server when the vendor sheet says nothing about it (ASSUMED): one PCIe Gen4 NVMe
# drive for the store, and a CPU that sweeps AdamW state at ~100 GB/s (a fraction of a dual-socket
# server's ~300-400 GB/s DRAM bandwidth, since AdamW reads 16 and writes 12 bytes per parameter).
_NVME_READ, _NVME_WRITE = 7 * GB, 5 * GB
_SERVER_UPDATE_BW = 100 * GB
# Per-transfer setup cost of a DMA over PCIe or of one streamed message (ASSUMED, order of magnitude).
_LINK_LATENCY = 10e-6
_HOST_ASSUMED = ("host: NVMe 7 GB/s read, 5 GB/s write and a 100 GB/s host AdamW sweep are ASSUMED",
                 "link latency 10 us per transfer is ASSUMED")


def _gpu(name: str, memory_mib: int, link_gbps: float, bf16_tflops: float, fp32_tflops: float,
         hbm_gbps: float, host_ram: int, source: str, notes: tuple[str, ...] = (),
         nvlink_gbps: float | None = None) -> DeviceSpec:
    link = Link(link_gbps * GB, _LINK_LATENCY)
    return DeviceSpec(
        interconnect=None if nvlink_gbps is None else Link(nvlink_gbps * GB, _LINK_LATENCY),
        name=name, memory_bytes=memory_mib * MiB, h2d=link, d2h=link,
        flops={"bf16": bf16_tflops * TB, "fp32": fp32_tflops * TB}, device_mem_bandwidth=hbm_gbps * GB,
        host_ram_bytes=host_ram, disk_read_bw=_NVME_READ, disk_write_bw=_NVME_WRITE,
        host_update_bw=_SERVER_UPDATE_BW, source=source, notes=_HOST_ASSUMED + notes,
    )


_FP32_NOTE = "fp32 rate is the non-tensor-core FP32 peak: torch leaves TF32 matmul off by default"

DEVICE_PRESETS: dict[str, DeviceSpec] = {
    # Cerebras CS-2 / WSE-2 (Cerebras product brief; AnandTech, "Cerebras Unveils Wafer Scale Engine Two",
    # 2021): 40 GB on-wafer SRAM at 20 PB/s; 12 x 100 GbE = 1.2 Tb/s = 150 GB/s of external I/O.
    # Cerebras publishes no dense FLOP/s figure: 7.5 PFLOP/s half precision is an estimate (850,000 cores x
    # 8 FLOP/cycle x ~1.1 GHz). MemoryX (the host that holds weights and runs the update) is sized from
    # 4 TB up; the smallest configuration is taken.
    "cs2": DeviceSpec(
        name="cs2", memory_bytes=40 * GB,
        h2d=Link(150 * GB, _LINK_LATENCY), d2h=Link(150 * GB, _LINK_LATENCY),
        flops={"bf16": 7.5e15, "fp32": 1.875e15}, device_mem_bandwidth=20e15,
        host_ram_bytes=4 * TB, disk_read_bw=_NVME_READ, disk_write_bw=_NVME_WRITE,
        host_update_bw=_SERVER_UPDATE_BW, interconnect=Link(150 * GB, _LINK_LATENCY),
        source="Cerebras CS-2 product brief; AnandTech WSE-2 (2021): 40 GB SRAM, 20 PB/s, 1.2 Tb/s I/O",
        notes=("150 GB/s is taken in EACH direction (12 x 100 GbE, full duplex): ASSUMED",
               "7.5 PFLOP/s bf16 and 1/4 of it for fp32 are ASSUMED (no published dense figure)",
               "MemoryX host: 4 TB RAM (smallest configuration), NVMe 7/5 GB/s, 100 GB/s update: ASSUMED",
               "several CS-2s reduce gradients through SwarmX at the 150 GB/s I/O rate: ASSUMED",
               "link latency 10 us per transfer is ASSUMED"),
    ),
    # Data-parallel peers: NVLink 3 (A100) 600 GB/s and NVLink 4 (H100, H200) 900 GB/s in both directions
# together, so 300 and 450 GB/s each way (NVIDIA datasheets); the RTX 4090 has no NVLink (through the host).
# NVIDIA A100 datasheet (2021): 312 TFLOP/s bf16 dense, 19.5 TFLOP/s fp32, 1555 GB/s HBM2 (40 GB),
    # 2039 GB/s HBM2e (80 GB SXM); PCIe Gen4 x16 gives ~25 GB/s per direction in practice (32 GB/s raw).
    # Memory is the total nvidia-smi reports. DGX A100 ships 1 TB of host RAM.
    "a100-40g": _gpu("a100-40g", 40960, 25, 312, 19.5, 1555, 1 * TB,
                     "NVIDIA A100 datasheet; PCIe Gen4 x16 ~25 GB/s effective; DGX A100 host", (_FP32_NOTE,),
                     nvlink_gbps=300),
    "a100-80g": _gpu("a100-80g", 81920, 25, 312, 19.5, 2039, 1 * TB,
                     "NVIDIA A100 80GB datasheet; PCIe Gen4 x16 ~25 GB/s effective; DGX A100 host", (_FP32_NOTE,),
                     nvlink_gbps=300),
    # NVIDIA H100 SXM5 datasheet: 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32;
    # PCIe Gen5 x16 host link, ~55 GB/s per direction measured in practice (64 GB/s raw). DGX H100: 2 TB.
    "h100-80g": _gpu("h100-80g", 81559, 55, 989, 67, 3350, 2 * TB,
                     "NVIDIA H100 SXM5 datasheet; PCIe Gen5 x16 ~55 GB/s effective; DGX H100 host", (_FP32_NOTE,),
                     nvlink_gbps=450),
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s, same compute as H100 SXM, PCIe Gen5. DGX H200: 2 TB.
    "h200": _gpu("h200", 143771, 55, 989, 67, 4800, 2 * TB,
                 "NVIDIA H200 datasheet; PCIe Gen5 x16 ~55 GB/s effective; DGX H200 host", (_FP32_NOTE,),
                 nvlink_gbps=450),
    # NVIDIA Ada (RTX 4090) whitepaper: 24 GB GDDR6X at 1008 GB/s, 165.2 TFLOP/s bf16 dense with fp32
    # accumulate, 82.6 TFLOP/s fp32; PCIe Gen4 x16. Host: a 128 GiB workstation (ASSUMED).
    "rtx4090": _gpu("rtx4090", 24564, 25, 165.2, 82.6, 1008, 128 * GiB,
                    "NVIDIA Ada Lovelace whitepaper (RTX 4090); PCIe Gen4 x16 ~25 GB/s effective",
                    ("workstation host with 128 GiB RAM is ASSUMED",)),
}


def device_spec(name: str) -> DeviceSpec:
    """A preset by name. "local" (this machine) is measured, not described: the runtime calibrates it
    (streamer.runtime.calibrate.local_spec), which keeps this package free of torch."""
    try:
        return DEVICE_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; choose one of: {', '.join([*DEVICE_PRESETS, 'local'])}") from None


def budget_bytes(budget: None | int | str | DeviceSpec, error: Callable[[str, str], Exception] = SettingError
                 ) -> int | None:
    """A device budget in bytes: None (no limit), a device preset or spec (its memory), or a size ("64MiB",
    3000000000). The one reading of --budget, for the run's settings, the trainer and `generate`."""
    if budget is None:
        return None
    if isinstance(budget, DeviceSpec):
        return budget.memory_bytes
    if isinstance(budget, str) and budget in DEVICE_PRESETS:
        return DEVICE_PRESETS[budget].memory_bytes
    try:
        size = parse_size(budget)
    except SizeError as exc:
        raise error("budget", f"{shown(budget)}: {exc}, or a device preset ({', '.join(DEVICE_PRESETS)})") from None
    if size <= 0:
        raise error("budget", "must be more than 0 bytes; leave it out for no limit")
    return size
