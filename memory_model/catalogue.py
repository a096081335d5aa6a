"""The device presets' figures: every number with its basis and, where published, its source.

A figure is `sourced` (a vendor document, paper or public measurement says it), `derived` (arithmetic on
sourced figures, stated), `measured` (timed on this machine: the `local` device) or `assumed` (nothing
published; the reason is given). The collected quotes are in docs/MEMORY_MODEL.md ("Device catalogue").
Link and memory-bandwidth figures are one direction's peak; `bandwidth_efficiency` is the achievable share of
it, and `matmul_efficiency` / `attention_efficiency` the achievable share of the dense peak FLOP/s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from layers import PRESETS, GPTJConfig, ModelConfig, Qwen3Config

BASES = ("sourced", "derived", "measured", "assumed")
GB, MiB, GiB, TB = 10**9, 2**20, 2**30, 10**12


@dataclass(frozen=True)
class Figure:
    """One number of a device: its value, how it is known, and where from."""

    value: float
    basis: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.basis not in BASES:
            raise ValueError(f"a figure's basis is one of {', '.join(BASES)}, got {self.basis!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not math.isfinite(self.value):
            raise ValueError(f"a figure's value must be a finite number, got {self.value!r}")
        if self.basis in ("sourced", "derived", "assumed") and not self.source:
            raise ValueError(f"a {self.basis} figure needs its source (or, when assumed, its reason)")

    def to_dict(self) -> dict[str, object]:
        return {"value": self.value, "basis": self.basis, "source": self.source}


def _s(value: float, source: str) -> Figure:
    return Figure(value, "sourced", source)


def _d(value: float, source: str) -> Figure:
    return Figure(value, "derived", source)


def _a(value: float, reason: str) -> Figure:
    return Figure(value, "assumed", reason)


# --- sources quoted more than once ------------------------------------------------------------------------------
_MAMF = "stas00/ml-engineering compute/accelerator/README.md, MAMF table (best measured bf16 GEMM / dense peak)"
_FA3 = "Shah et al., FlashAttention-3 (arXiv 2407.08608): 'FP16 reaching up to 740 TFLOPs/s (75% utilization)'"
_FA_AMPERE = ("assumed: Ampere/Ada attention kernels reach at most the GEMM ceiling; FlashAttention-3 "
              "(arXiv 2407.08608) reports 75% on Hopper")
_CONTEXT = ("assumed: no published figure per GPU (the reference notes have none); one user report, "
            "discuss.pytorch.org 'What is the reason for pytorch's GPU memory floor': the first CUDA call takes "
            "723 MiB (the CUDA context; it varies with the driver, CUDA version and loaded kernels); the caching "
            "allocator's fragmentation is not included")
_NVME = "one PCIe Gen4 NVMe drive (7 GB/s read, 5 GB/s write, drive datasheets' class)"
_LATENCY = "per-transfer DMA setup cost, order of magnitude; no published figure"
_GEN5 = "derived: PCIe Gen5 x16 32 GT/s x 16 x 128/130 / 8 = 63.0 GB/s per direction"
_GEN4 = "derived: PCIe Gen4 x16 16 GT/s x 16 x 128/130 / 8 = 31.5 GB/s per direction"
_GEN5_EFF = "derived: nvbandwidth issue #24, H100 device_to_host_memcpy 52.77 GB/s / 63.0 raw"
_GEN4_EFF = "derived: ZaidQureshi/bam issue #54, A100 PCIe Gen4 measured peak 25 GB/s / 31.5 raw"
_NVLINK4 = "sourced: NVLink 4 900 GB/s total = 450 GB/s per direction (NVIDIA datasheet; nccl issue #1264)"
_DGX = "a DGX-class server's RAM (DGX A100 1 TB, DGX H100/H200 2 TB per NVIDIA's DGX pages)"
_BASEPOD = ("NVIDIA DGX BasePOD reference architecture, core components (docs.nvidia.com/dgx-basepod): DGX H100 and "
            "H200 have 'Four OSFP ports serving eight single-port NVIDIA ConnectX-7 VPI ... up to 400 Gb/s "
            "InfiniBand/Ethernet'")
# The network from one machine to the others (inter_node_*): per machine and direction, a ring all-reduce's
# share between machines crosses it (memory_model/devices.py, allreduce_time).
_DGX_H_NETWORK = _d(8 * 400e9 / 8, f"derived: 8 ports x 400 Gb/s / 8 bits = 400 GB/s per machine; {_BASEPOD}")
_ONE_NDR = _a(400e9 / 8, "assumed: one 400 Gb/s InfiniBand NDR port per machine (not a DGX H100's eight) / 8 bits "
                         f"= 50 GB/s; the port's rate: {_BASEPOD}")
# The best published end-to-end training MFU: an end-to-end step's share of the peak, below any one kernel's.
_BEST_MFU = _s(0.552, "Jiang et al., MegaScale (arXiv 2402.15627), abstract: 'MegaScale achieves 55.2% Model FLOPs "
                      "Utilization (MFU) when training a 175B LLM model on 12,288 GPUs' (the best published GPU "
                      "training MFU found; taken for every GPU class)")
_NETWORK_LATENCY = _a(5e-6, "assumed: an InfiniBand hop and the NIC's setup, order of magnitude; no published figure")


@dataclass(frozen=True)
class Host:
    """The CPU side of a GPU system: its processors, cores and memory bandwidth. The host's AdamW and gradient
    fold are memory-bound, so their rate (host_update_bw) is its memory bandwidth times one AdamW share."""

    cpu: str
    cores: Figure
    memory_bandwidth: Figure  # bytes/s, all sockets

    def note(self) -> str:
        bw = self.memory_bandwidth
        why = bw.source if bw.source.startswith(bw.basis) else f"{bw.basis}: {bw.source}"
        return f"host: {self.cpu}, {self.cores.value:.0f} cores, {bw.value / GB:.0f} GB/s memory ({why})"


# DeepSpeed's CPU-Adam rate over the memory bandwidth of the host it was timed on: the share of a host's memory
# bandwidth its AdamW reaches, the same for every host (an Arm or x86 AdamW is memory-bound alike). Two hosts
# are published; their mean is taken, and each lies within 16% of it. The rate is the AdamW kernel's alone: the
# links and the gradient's copy are priced apart.
_ADAMW_TOUCHED = 28  # bytes per parameter: fp32 master, m and v read and written, the fp32 gradient read
_DGX2_BW = 2 * 6 * 21.33 * GB
_DGX2 = ("Ren et al., ZeRO-Offload (arXiv 2101.06840), Table 2: '2 Intel Xeon Platinum 8168 Processors', "
         "'1.5TB 2666MHz DDR4'")
_SIX_CHANNELS = ("Azure HC-series documentation: two 24-core Xeon Platinum 8168, each CPU one NUMA domain with six "
                 "DRAM channels")
_ADAM_DGX2 = 10e9 / 2.57 * _ADAMW_TOUCHED / _DGX2_BW
_ADAM_GRACE = 8e9 / 0.769 * _ADAMW_TOUCHED / (500 * GB)
_ADAMW_SHARE = (_ADAM_DGX2 + _ADAM_GRACE) / 2
_ADAMW_SHARE_SOURCE = (
    f"derived: the mean of two CPU-Adam timings x {_ADAMW_TOUCHED} B touched per parameter over the host's memory "
    f"bandwidth: ZeRO-Offload (arXiv 2101.06840) Table 4, 'Adam latency (s)', CPU-Adam 2.57 s for 10 billion "
    f"parameters on its DGX-2 (256 GB/s; Table 2), {_ADAM_DGX2:.3f}; SuperOffload (arXiv 2509.21271; DeepSpeed "
    f"blogs/deepspeed-superoffload, Figure 5), CPU-Adam 0.769 s for 8 billion on a GH200's Grace (500 GB/s), "
    f"{_ADAM_GRACE:.3f}; mean {_ADAMW_SHARE:.3f}")
_MLPERF_H200 = ("MLCommons inference v4.1, closed/NVIDIA/systems/H200-SXM-141GBx8_TRT_MaxQ.json: 'Intel(R) Xeon(R) "
                "Platinum 8480C', 'host_processors_per_node': 2, 'host_processor_core_count': 56, '32x 64GB "
                "MTC40F2046S1RC48BA1'")
_LOHAN_BOX = ("RC4ML/LoHan evaluation_data.md, the testbed: 'Dual Intel Xeon Gold 5320 CPU', '768 GB 3200 MHz DDR4 (16 "
              "channels in total)', 'NVIDIA GeForce RTX 4090', '12x D7-P5510 3.84 TB SSD'")
HOSTS: dict[str, Host] = {
    "dgx-a100": Host("2 x AMD EPYC 7742 (DGX A100)",
                     _a(128, "assumed: DGX A100's two 64-core EPYC 7742; no source at hand"),
                     _a(2 * 8 * 25.6 * GB, "assumed: 2 sockets x 8 channels of DDR4-3200 (25.6 GB/s each)")),
    "dgx-h100": Host("2 x Intel Xeon Platinum 8480C (DGX H100/H200)", _s(112, _MLPERF_H200),
                     _d(2 * 8 * 38.4 * GB, f"derived: 2 sockets x 8 channels of DDR5-4800 (38.4 GB/s each); "
                                           f"{_MLPERF_H200}")),
    "grace": Host("NVIDIA Grace (Arm Neoverse V2, LPDDR5X), not an x86 server",
                  _s(72, "AshokBhat/notes wiki, Grace (NVIDIA's announcement): 'Grace CPU (72 Armv9 CPU core)'"),
                  _s(500 * GB, "AshokBhat/notes wiki, Grace: '500 GB/sec of bandwidth' (LPDDR5X); NVIDIA's Grace "
                               "tuning guide (health checks) measures STREAM triad from 410 GB/s on the 120 GB part")),
    "dgx-2": Host("2 x Intel Xeon Platinum 8168 (DGX-2)",
                  _d(48, f"derived: 2 x 24 cores; {_DGX2}; {_SIX_CHANNELS}"),
                  _d(_DGX2_BW, f"derived: 2 sockets x 6 channels of DDR4-2666 (21.33 GB/s each); {_DGX2}; "
                               f"{_SIX_CHANNELS}")),
    "workstation": Host("a desktop CPU (assumed)", _a(16, "assumed: a 16-core desktop CPU"),
                        _a(2 * 44.8 * GB, "assumed: 2 channels of DDR5-5600 (44.8 GB/s each)")),
    "lohan": Host("2 x Intel Xeon Gold 5320 (LoHan's testbed)",
                  _a(52, f"assumed: 2 x 26 cores, Intel's count for a Xeon Gold 5320 (not quoted here); {_LOHAN_BOX}"),
                  _d(16 * 25.6 * GB, f"derived: 16 channels of DDR4-3200 (25.6 GB/s each; the DIMMs' rating, which "
                                     f"the CPUs may clock lower); {_LOHAN_BOX}")),
}


@dataclass(frozen=True)
class Preset:
    """One device preset, whole: its figures (`devices.FIGURES` names), the host that feeds it, its CUDA compute
    capability, its notes, and where its system updates and how it sums gradients. `devices.DEVICE_PRESETS` makes
    each a `DeviceSpec`; adding a device is one record in `CATALOGUE`."""

    figures: dict[str, Figure]
    host: Host | None = None  # a GPU's host (processors, cores, memory bandwidth), named among its notes
    # The CUDA compute capability (NVIDIA's CUDA GPUs list): torch sizes cuBLAS's workspace by it. "": no CUDA.
    cuda_arch: str = ""
    own_notes: tuple[str, ...] = ()
    update_on: str = "device"
    reduce: str = "ring"

    @property
    def notes(self) -> tuple[str, ...]:
        """Its assumptions shown to users: its own, then its host's."""
        return self.own_notes + ((self.host.note(),) if self.host is not None else ())


def _host(ram: Figure, host: Host, disk: tuple[Figure, Figure] = (_a(7 * GB, _NVME), _a(5 * GB, _NVME))
          ) -> dict[str, Figure]:
    """The host side of a GPU system: RAM, its disks' read and write rates (one NVMe drive unless given) and the
    AdamW rate its memory bandwidth gives."""
    update = host.memory_bandwidth.value * _ADAMW_SHARE
    copy = host.memory_bandwidth.value * _ADAMW_SHARE / 2
    return {"host_ram_bytes": ram, "disk_read_bw": disk[0], "disk_write_bw": disk[1],
            "host_update_bw": _d(update, f"derived: {host.cpu}'s {host.memory_bandwidth.value / GB:.0f} GB/s x "
                                         f"the AdamW share {_ADAMW_SHARE:.3f} ({_ADAMW_SHARE_SOURCE})"),
            "host_copy_bw": _d(copy, f"derived: {host.cpu}'s {host.memory_bandwidth.value / GB:.0f} GB/s x the "
                                     f"AdamW share {_ADAMW_SHARE:.3f} (a memory-bound pass alike) / 2: a copy reads "
                                     "and writes each byte it moves"),
            "link_latency_s": _a(10e-6, _LATENCY)}


def _wafer(bf16: Figure, sram: Figure, sram_bw: Figure, notes: tuple[str, ...]) -> Preset:
    """A Cerebras system with MemoryX (parameter store and update) and SwarmX (broadcast/reduce tree). MemoryX
    performs the weight update ("Weight updates are performed by the MemoryX service", cerebras.net/glossary/memoryx)
    and SwarmX sums the gradients in the network at line rate (glossary/swarmx)."""
    io = _d(150 * GB, "derived: 1.2 Tb/s system I/O (12 x 100 GbE, full duplex; cerebras.net/glossary/swarmx) "
                      "/ 8 = 150 GB/s each way")
    return Preset({
        "memory_bytes": sram, "reserve_bytes": _a(0, "assumed: no runtime context is carved out of the SRAM"),
        "h2d_bytes_per_s": io, "d2h_bytes_per_s": io, "link_latency_s": _a(10e-6, _LATENCY),
        "bf16_flops": bf16,
        "fp32_flops": _a(bf16.value / 4, "assumed: 1 FP32 FMA per core per cycle, 1/4 of the FP16 SIMD rate; "
                                         "no figure published"),
        "matmul_efficiency": _a(0.8, "assumed: Cerebras publishes no achievable rate; the GPU GEMM ceiling "
                                     "(MAMF 80-86%) is taken"),
        "attention_efficiency": _a(0.8, "assumed: as matmul_efficiency"),
        "training_mfu": _a(0.8, "assumed: Cerebras publishes no training MFU; the matmul ceiling is taken"),
        "bandwidth_efficiency": _a(0.95, "assumed: 100 GbE payload after Ethernet/IP framing, 93-97%"),
        "device_mem_bandwidth": sram_bw,
        "host_ram_bytes": _s(4 * TB, "cerebras.net/glossary/memoryx: MemoryX 'can scale from 4TB to 2.4PB' "
                                     "(smallest taken)"),
        "disk_read_bw": _a(150 * GB, "assumed: MemoryX 'can match or exceed the I/O bandwidth of a CS-2' "
                                     "(glossary/memoryx), so its flash tier is taken at the wafer's 150 GB/s"),
        "disk_write_bw": _a(150 * GB, "assumed: as disk_read_bw"),
        "host_update_bw": _a(3e9 * 28, "assumed: MemoryX AdamW at 3 B params/s (28 B touched each), the "
                                       "middle of 1-10 B params/s for 12-24 DDR5 nodes; Cerebras publishes none"),
        # SwarmX broadcasts and reduces at each system's line rate: its nodes grow with the systems it joins.
        "interconnect_bytes_per_s": _d(io.value, "derived: SwarmX's broadcast and reduce per system at the "
                                                 f"system's line rate, {io.value / GB:.0f} GB/s each way: 'Each node "
                                                 "provides enough compute to perform the floating-point gradient "
                                                 "reductions at line-rate' and 'the number of nodes composing the "
                                                 "SwarmX fabric scales linearly with N' "
                                                 "(cerebras.net/glossary/swarmx)"),
        "interconnect_latency_s": _a(50e-6, "assumed: SwarmX per tree level, upper end of 5-50 us for 100 GbE "
                                            "and a CPU reduce; no figure published"),
        # MemoryX serves every system of the cluster: its I/O is shared among them (DeviceSpec.host_streams).
        "host_io_bytes_per_s": _d(io.value, "derived: MemoryX's I/O, shared among the systems it serves, at one "
                                            "system's 1.2 Tb/s (the lower bound of 'Both the storage and I/O "
                                            "interface of the MemoryX service can match or exceed the I/O bandwidth "
                                            "of a CS-2 system', cerebras.net/glossary/memoryx); through SwarmX it "
                                            "carries one stream for them all: 'MemoryX can broadcast weights in "
                                            "parallel to multiple CS-2s ... SwarmX collects and reduces the "
                                            "gradients' (Linley Newsletter 2021-09-21)"),
    }, own_notes=notes, update_on="host", reduce="in-network")


def _gpu(memory: Figure, bf16: float, fp32: float, hbm: float, link: Figure, link_eff: Figure,
         matmul_eff: Figure, attention_eff: Figure, datasheet: str, nvlink: Figure | None,
         ram: Figure, host: Host, arch: str, network: Figure = _ONE_NDR, mfu: Figure = _BEST_MFU,
         notes: tuple[str, ...] = ()) -> Preset:
    """A GPU and its host; it updates on the device and all-reduces in a ring."""
    figures = {"training_mfu": mfu,
        "memory_bytes": memory, "reserve_bytes": _a(723 * MiB, _CONTEXT),
        "h2d_bytes_per_s": link, "d2h_bytes_per_s": link,
        "bf16_flops": _s(bf16, f"{datasheet}: bf16 tensor, dense (half the sparse figure)"),
        "fp32_flops": _s(fp32, f"{datasheet}: FP32 non-tensor (torch leaves TF32 matmul off by default)"),
        "matmul_efficiency": matmul_eff, "attention_efficiency": attention_eff, "bandwidth_efficiency": link_eff,
        "device_mem_bandwidth": _s(hbm, f"{datasheet}: memory bandwidth"),
        **_host(ram, host),
        "inter_node_bytes_per_s": network, "inter_node_latency_s": _NETWORK_LATENCY,
    }
    if nvlink is not None:
        figures["interconnect_bytes_per_s"] = nvlink
        figures["interconnect_latency_s"] = _a(10e-6, _LATENCY)
    return Preset(figures, host, arch, notes)


_H100_SHEET = "NVIDIA H100 datasheet (hpctech.co.jp reproduction)"
_H100_MEM = _s(81559 * MiB, "nvidia-smi on H100 80GB (public logs): '0MiB / 81559MiB' (NVIDIA's 80 GB)")
_H100_MATMUL = _s(0.801, f"{_MAMF}: 'NVIDIA H100 SXM 792.1 989 80.1%'")
_GEN5_LINK, _GEN5_E = _d(63.0 * GB, _GEN5), _d(0.84, _GEN5_EFF)
_GEN4_LINK, _GEN4_E = _d(31.5 * GB, _GEN4), _d(0.79, _GEN4_EFF)
_A100_SHEET = "NVIDIA A100 datasheet (glennklockwood.com/garden/processors/A100)"
_A100_MATMUL = _s(0.859, f"{_MAMF}: A100 SXM 267.9 of 312 TFLOPS (85.9%)")

CATALOGUE: dict[str, Preset] = {
    "cs2": _wafer(
        _d(7.5e15, "derived: Andromeda '120 Petaflops of dense compute at 16-bit half precision' / 16 CS-2"),
        _s(40 * GB, "AnandTech WSE-2 (anandtech.com/Show/Index/16626): 'On-board SRAM 18 GB 40 GB'"),
        _s(20e15, "AnandTech WSE-2: 'Memory Bandwidth 9 PB/s 20 PB/s'"),
        ("host = MemoryX (weights, optimizer state, the update); data parallel = SwarmX broadcast/reduce tree",)),
    "cs3": _wafer(
        _d(15e15, "derived: 125 PF 'AI compute' x (120 dense / 1000 AI, Andromeda's ratio) = 15 PF; "
                  "Cerebras publishes no dense figure (uncertain, 14-17 PF)"),
        _s(44 * GB, "ALCF CS-3 user guide: '900K processing cores, each providing 48KB ... total of 44GB'"),
        _s(21e15, "Argonne SC24 tutorial (Cerebras): 'extremely high bandwidth - 21 PB/s'"),
        ("host = MemoryX; data parallel = SwarmX. CS-3 I/O taken as CS-2's 1.2 Tb/s (Cerebras docs claim "
         "+30%: uncertain)",)),
    "a100-40g": _gpu(_a(40960 * MiB, "assumed: 40 GiB nominal (binary-sized like the H100's 80 GB); the "
                                     "CUDA-visible total is a little lower"),
                     312e12, 19.5e12, 1555 * GB, _GEN4_LINK, _GEN4_E, _A100_MATMUL,
                     _a(0.859, _FA_AMPERE), _A100_SHEET,
                     _s(300 * GB, "glennklockwood A100: '300+300 GB/s NVLink' (per direction)"), _a(1 * TB, _DGX),
                     HOSTS["dgx-a100"], "sm80"),
    "a100-80g": _gpu(_a(81920 * MiB, "assumed: 80 GiB nominal; the CUDA-visible total is a little lower"),
                     312e12, 19.5e12, 2039 * GB, _GEN4_LINK, _GEN4_E, _A100_MATMUL,
                     _a(0.859, _FA_AMPERE),
                     "NVIDIA A100 80GB datasheet (thundercompute.com A100 guide: 2,039 GB/s SXM)",
                     _s(300 * GB, "glennklockwood A100: '300+300 GB/s NVLink' (per direction)"), _a(1 * TB, _DGX),
                     HOSTS["dgx-a100"], "sm80"),
    "h100-sxm": _gpu(_H100_MEM, 989e12, 67e12, 3350 * GB, _GEN5_LINK, _GEN5_E, _H100_MATMUL, _s(0.75, _FA3),
                     _H100_SHEET, _s(450 * GB, _NVLINK4), _a(2 * TB, _DGX), HOSTS["dgx-h100"], "sm90",
                     _DGX_H_NETWORK),
    "h100-pcie": _gpu(_a(81559 * MiB, "assumed: the SXM part's CUDA-visible 81559 MiB (both are '80 GB')"),
                      756e12, 51e12, 2000 * GB, _GEN5_LINK, _GEN5_E,
                      _a(0.801, "assumed: the H100 SXM's MAMF share (same GH100 die, lower clocks)"),
                      _a(0.75, "assumed: FlashAttention-3's H100 share (arXiv 2407.08608)"),
                      "NVIDIA H100 PCIe datasheet / product brief",
                      _s(300 * GB, "H100 PCIe datasheet: 'NVLINK: 600GB/s' (bridge, 2 cards; per direction 300)"),
                      _a(2 * TB, _DGX), HOSTS["dgx-h100"], "sm90"),
    "h200": _gpu(_s(143771 * MiB, "nvidia-smi on H200 (cuda-samples issue #311): '0MiB / 143771MiB'"),
                 989e12, 67e12, 4800 * GB, _GEN5_LINK,
                 _d(0.84, f"{_GEN5_EFF} (the H100's Gen5 host link measurement)"),
                 _a(0.801, "assumed: the H100 SXM's MAMF share (same GH100 die)"),
                 _a(0.75, "assumed: FlashAttention-3's H100 share (same GH100 die)"),
                 "AnandTech SC23 H200 (anandtech.com/Show/Index/21136)", _s(450 * GB, _NVLINK4), _a(2 * TB, _DGX),
                 HOSTS["dgx-h100"], "sm90", _DGX_H_NETWORK),
    "gh200": _gpu(_s(96 * GB, "NVIDIA GH200 whitepaper (datacrunch.io): 'Up to 96 GB of HBM3 memory'"),
                  989e12, 67e12, 4000 * GB,
                  _s(450 * GB, "NVIDIA GH200 whitepaper (datacrunch.io): NVLink-C2C '900 GB/s total bandwidth, "
                               "450 GB/s per direction'"),
                  _d(0.77, "derived: nvbandwidth issue #23, GH200 host-to-device CE 346 GB/s / 450"),
                  _s(0.830, f"{_MAMF}: 'NVIDIA GH200 SXM 821.0 989 83.0%'"), _s(0.75, _FA3),
                  "NVIDIA GH200 whitepaper (datacrunch.io), same Hopper GPU as H100 SXM", None,
                  _s(480 * GB, "the Grace CPU's LPDDR5X, 'Up to 480 GB' (GH200 whitepaper via datacrunch.io)"),
                  HOSTS["grace"], "sm90",
                  notes=("host link = NVLink-C2C to the Grace CPU's LPDDR5X (the store's RAM tier)",)),
    "v100": _gpu(_a(32510 * MiB, "assumed: nvidia-smi's usual 32510 MiB for the '32GB' V100"),
                 125e12, 15.7e12, 900 * GB,
                 _d(15.75 * GB, "derived: PCIe Gen3 x16 8 GT/s x 16 x 128/130 / 8 = 15.75 GB/s per direction"),
                 _a(0.79, f"assumed: the Gen4 share measured on an A100 ({_GEN4_EFF})"),
                 _d(0.76, "derived: fanghostt/transformers-benchmarks README, V100 'Matrix Multiplication FP32 / "
                          "FP16 | 14 / 95' of 125 TFLOPS"),
                 _a(0.76, "assumed: attention at the GEMM ceiling, as for Ampere and Ada"),
                 "NVIDIA V100 datasheet (SXM2): 125 TFLOPS tensor (fp16; V100 has no bf16, so its 16-bit tensor "
                 "rate stands for the 16-bit compute dtype), 15.7 TFLOPS FP32, 900 GB/s HBM2", None,
                 _s(1500 * GB, "DeepSpeed ZeRO-3 Offload post (docs/_posts/2021-03-08-zero3-offload.md): "
                               "'32GB V100 GPU + 1.5TB CPU memory'"), HOSTS["dgx-2"], "sm70",
                 mfu=_d(0.40, "derived: DeepSpeed ZeRO-3 Offload post, 'a sustained throughput of up to 50 Tflops "
                              "per GPU' on 512 V100 / 125 TFLOPS (the best published V100 training MFU found)"),
                 notes=("V100 has no bf16: its bf16 figures are its fp16 tensor rate, the 16-bit compute of "
                        "ZeRO-Offload's runs",)),
    "rtx4090": _gpu(_a(24564 * MiB, "assumed: nvidia-smi's usual 24564 MiB for the '24 GB' card"),
                    165.2e12, 82.6e12, 1008 * GB, _GEN4_LINK, _GEN4_E,
                    _a(0.80, "assumed: no MAMF figure for Ada; the Hopper/Ampere GEMM ceiling (80-86%)"),
                    _a(0.80, _FA_AMPERE), "NVIDIA Ada whitepaper, Table 2 (RTX 4090)", None,
                    _a(128 * GiB, "assumed: a workstation with 128 GiB RAM"), HOSTS["workstation"], "sm89"),
}

# Each GPU preset's host, by preset name (a view of CATALOGUE).
PRESET_HOSTS: dict[str, Host] = {name: p.host for name, p in CATALOGUE.items() if p.host is not None}


# --- published runs of offloaded and streamed training -----------------------------------------------------------
@dataclass(frozen=True)
class FlopCount:
    """How a source's own code counts a step's FLOPs, so that the plan's step is priced in the source's unit. Per
    sequence: `per_param` x N x seq + `per_attention` x layers x width x seq^2, N every parameter of the model
    (embeddings included). `source` quotes the code."""

    per_param: int  # 6: forward and backward; 8: the recompute of checkpointed blocks counted too
    per_attention: int  # 0: attention's T x T matmuls not counted
    source: str

    def flops(self, shape: ModelConfig, batch: int, seq: int) -> int:
        """The FLOPs the source counts for `batch` sequences of `seq` tokens."""
        return batch * seq * (self.per_param * shape.num_params()
                              + self.per_attention * shape.num_hidden_layers * shape.hidden_size * seq)


@dataclass(frozen=True)
class PublishedRun:
    """A published measurement of offloaded or streamed training and the step the planner prices for it.

    `shape` is the model in its own family, or a GPT-J shape that stands in for it where the family is not one of
    the planner's (same width and depth); `step` the PlanConfig fields besides batch and seq. `metric` is
    "TFLOPS per device" (the plan's FLOP/s, counted as `flops` says), "TFLOPS, all devices" or "speedup" (tokens/s
    on `step["devices"]` over one device, each with the same micro-batches) or "MFU". `flops` is how the source's
    code counts its FLOPs; None where it does not say: then the plan's model FLOPs are compared. `caveat` says what
    the source leaves unstated and what the plan assumed instead; `reproducible` is False where the planner cannot
    model the run at all (then it is listed, not priced). `testbed` holds the published machine's figures where
    they differ from the preset's (its host, RAM and disks): they replace the preset's, as `--set` would."""

    system: str
    measured: Figure
    metric: str
    model: str
    shape: ModelConfig
    batch: int
    seq: int
    device: str
    host: str
    step: tuple[tuple[str, object], ...]
    caveat: str
    reproducible: bool = True
    flops: FlopCount | None = None
    testbed: tuple[tuple[str, Figure], ...] = ()

    def __post_init__(self) -> None:
        if self.metric not in ("TFLOPS per device", "TFLOPS, all devices", "speedup", "MFU"):
            raise ValueError(f"unknown metric {self.metric!r}")
        if self.measured.basis != "sourced":
            raise ValueError(f"{self.system}: a published run's figure is sourced, got {self.measured.basis}")


_ZERO_OFFLOAD = ("Ren et al., ZeRO-Offload (arXiv 2101.06840), abstract: 'ZeRO-Offload can achieve 40 TFlops/GPU "
                 "on a single NVIDIA V100 GPU for 10B parameter model'; Figure 8: 'The training throughput with "
                 "PyTorch, L2L, SwapAdvisor and ZeRO-Offload on a single GPU with a batch size of 512' (10B: about "
                 "41); Table 3: '10,11 billion', batch size per GPU '10,8', '# layer' '50,55', hidden size '4096'")
_SUPEROFFLOAD = ("DeepSpeed blogs/deepspeed-superoffload/README.md (Lian et al., SuperOffload, arXiv 2509.21271): "
                 "'Full fine-tuning of GPT-OSS-20B, Qwen3-14B, achieving ~600 TFLOPS (seq len 4K, batch size 4)'")
_MEGATRAIN = ("DLYuanGod/MegaTrain README, News (Yuan et al., MegaTrain, arXiv 2604.05091): '4x H100 achieves 4.7x "
              "super-linear speedup over single GPU (1290 vs 272 TFLOPS on Qwen2.5-7B)'; the commit that says it "
              "(5cf47ac) adds examples/sft/configs/qwen_7b_1gpu.yaml ('batch_size: 158', 'max_seq_len: 1024', "
              "'num_steps: 5') and qwen_7b_4gpu.yaml ('batch_size: 632', 'num_steps: 10')")
_CEREBRAS = ("Cerebras and Sandia at NeurIPS 2024 (aiwire.net 2024/12/11; 4nownews.com): a 1-trillion-parameter "
             "model 'scaled up seamlessly to 16 CS-3 systems'; '16 CS-3 systems showed a 15.3-fold increase'")
_ZERO3_OFFLOAD = ("DeepSpeed ZeRO-3 Offload post (docs/_posts/2021-03-08-zero3-offload.md): 'With 1 Trillion "
                  "parameters, ZeRO-3 Offload sustains 25 PetaFlops ... on 512 NVIDIA V100 GPUs, achieving 49 "
                  "TFlops/GPU'")
_SUPEROFFLOAD_SP = ("Lian et al., SuperOffload (arXiv 2509.21271), abstract: 'enabling training of 13B model with "
                    "sequence lengths up to 1 million tokens on 8 GH200 while achieving 55% MFU'")
_NO_FLOPS = "the FLOP convention is not stated (Megatron's counts the recompute, the plan's does not)"
_LOHAN = ("RC4ML/LoHan evaluation_data.md (Liao et al., LoHan, arXiv 2403.06504, ICDE 2025; its first version, 'Adding "
          "NVMe SSDs to Enable and Accelerate 100B Model Fine-tuning on a Single GPU', named it Fuyou): 'All the "
          "throughput data are measured in TFLOPS'; ")
_LOHAN_13B = (f"{_LOHAN}'Figure 5(a)/7(a): End-to-end performance, single 4090 GPU', its table: 1.3 x 10^10 "
              "parameters, 40 layers, 40 heads, hidden 5120; batch size 8, 16, 32, 64, 128: 42.8, 84.3, 143.1, 155.8, "
              "153.8 TFLOPS")
_LOHAN_175B = (f"{_LOHAN}'Figure 7(b): End-to-end performance, single 4090 GPU', its table: 1.75 x 10^11 "
               "parameters, 96 layers, 96 heads, hidden 12288; batch size 8, 16, 32: 52.6, 86.9 TFLOPS, OOM")
_LOHAN_SSDS = (f"{_LOHAN}'Figure 10(b): Throughput w.r.t. number of SSDs, single 4090 GPU', its table: the 13B "
               "model at bsz=32 on 1, 2, 3, 6, 12 SSDs: 37.5, 64.3, 81.1, 121.7, 142.0 TFLOPS")
_FUYOU_A100 = ("Fuyou (arXiv 2403.06504v1) as onlyaistuff.com summarizes it: 'It achieves 87 TFLOPS on 4090 and 172 "
               "TFLOPS on A100-80GB when fine-tuning a GPT-3 175B model'")
_D7 = ("the D7-P5500 series' datasheet rates ('Hanno la stessa velocità di lettura/scrittura sequenziale (7000/4300 "
       "MB/s)', ilsoftware.it on Intel's D7-P5500 and D7-P5600; no D7-P5510 sheet at hand)")


def _lohan_testbed(ssds: int) -> tuple[tuple[str, Figure], ...]:
    """LoHan's server: its CPUs, RAM and `ssds` NVMe drives in one RAID 0 array (its make_raid.sh: 'mdadm --create
    ... --level=0'), the array at its drives' summed rate."""
    why = f"assumed: {ssds} x Intel D7-P5510 in RAID 0, each at {_D7}; {_LOHAN_BOX}"
    figures = _host(_s(768 * GB, _LOHAN_BOX), HOSTS["lohan"],
                    (_a(ssds * 7.0 * GB, f"{why} (read)"), _a(ssds * 4.3 * GB, f"{why} (write)")))
    return tuple((name, figure) for name, figure in figures.items() if name != "link_latency_s")


# LoHan's GPT (RC4ML/LoHan gpt_model.py): GPT-2 blocks, learned positions, no LM head ('# self.fc' is commented out).
_LOHAN_13B_SHAPE = GPTJConfig(vocab_size=50257, n_positions=1024, n_embd=5120, n_layer=40, n_head=40, rotary_dim=64)
_LOHAN_175B_SHAPE = GPTJConfig(vocab_size=50257, n_positions=1024, n_embd=12288, n_layer=96, n_head=96, rotary_dim=64)
_LOHAN_MODELS = {"13B": ("GPT-3 13B (40 x 5120, 40 heads)", _LOHAN_13B_SHAPE),
                 "175B": ("GPT-3 175B (96 x 12288, 96 heads)", _LOHAN_175B_SHAPE)}
_LOHAN_DRIVES = {1: "one NVMe SSD", 12: "12 NVMe SSDs in RAID 0"}


def _lohan_compute(rate: float) -> str:
    """What a LoHan row whose planned step is its compute leaves open: its published rate over the 4090's peak, as
    model FLOPs and with the recompute counted (8 FLOPs per parameter and token, not 6)."""
    figures = CATALOGUE["rtx4090"].figures
    peak, cap = figures["bf16_flops"].value / 1e12, figures["training_mfu"].value
    said = (f"the plan's step is its compute, at the 4090's training_mfu ({cap:.1%} of its {peak:.1f} TFLOPS dense "
            "FP16/BF16 peak with FP32 accumulate, which PyTorch's fp16 matmuls use, the recompute included); the "
            f"published {rate} TFLOPS is {rate / peak:.0%} of that peak as model FLOPs")
    if rate / peak <= cap:
        return said
    return (f"{said} and {rate / peak * 6 / 8:.0%} with the recompute counted, above every published training MFU: "
            "its count is not the plan's, and the sources do not say what it is")


_LOHAN_STEP = (("activations", "offload"), ("store", "disk"), ("update_on", "host"), ("update_timing", "overlapped"))
_LOHAN_PLAN = (
    "GPT-2 blocks without an LM head, on an MSE loss (gpt_model.py, main.py), planned as GPT-J blocks with one; seq "
    "1024, main.py's default; fp16, planned as bf16 (one rate on a 4090); half-blocks checkpointed, their inputs in "
    "RAM or on the SSDs, some activations swapped instead of recomputed: planned as --activations offload; weights "
    "and Adam state on the SSDs, as --store disk; the CPU Adam overlaps the backward, as --update-timing "
    "overlapped; its TFLOPS are 'directly output by the script', which prints only times: the FLOP convention is "
    "not stated"
)


def _lohan_run(system: str, rate: Figure, model: str, batch: int, ssds: int, caveat: str | None = None
               ) -> PublishedRun:
    """One of LoHan's published RTX 4090 runs of its `model` GPT at seq 1024, planned on its own server with `ssds`
    drives. `caveat`: what else the row leaves open; None for a row whose planned step is its compute."""
    name, shape = _LOHAN_MODELS[model]
    said = _lohan_compute(rate.value) if caveat is None else caveat
    return PublishedRun(system, rate, "TFLOPS per device", name, shape, batch, 1024, "rtx4090",
                        f"2 x Xeon Gold 5320, 768 GB DDR4, {_LOHAN_DRIVES[ssds]}", _LOHAN_STEP,
                        f"{_LOHAN_PLAN}; {said}", testbed=_lohan_testbed(ssds))
# Qwen3-14B's config.json (Qwen/Qwen3-14B: 14.8B parameters, 13.2B besides the embeddings, as this counts them).
_QWEN3_14B = Qwen3Config(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                         num_attention_heads=40, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                         rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})
_QWEN25_7B = PRESETS["qwen2.5-7b"]
# GPT-2 is not a family of the planner: GPT-J blocks of its width and depth stand in (GELU MLP, 4x wide).
_GPT2_10B = GPTJConfig(vocab_size=50257, n_positions=1024, n_embd=4096, n_layer=50, n_head=32, rotary_dim=64)
_GPTJ_6B = PRESETS["gptj-6b"]
_HOST_AFTER = (("activations", "checkpoint"), ("store", "ram"), ("update_on", "host"),
               ("update_timing", "after-backward"))

_MEGATRAIN_RATES = {1: 272, 4: 1290}  # TFLOPS on 1 and 4 H100s, as its README's News says


def _megatrain_warm_up(one_gpu: float, four_gpus: float) -> str:
    """What MegaTrain's averaging leaves open: its 'Avg Throughput' is the mean of each step's rate (train.py:
    'sum(throughputs)/len(throughputs)'), over 5 steps on one GPU and 10 on four, the first included. A first
    step of any length lowers such a mean by at most its one share, so the warm-up bounds the gap between the
    two runs' rates per GPU."""
    gap = 1 - one_gpu / (four_gpus / 4)
    most = 1 - (1 - 1 / 5) / (1 - 1 / 10)
    return ("its 'Avg Throughput' is the mean of each step's rate, the warm-up included: even a first step that "
            f"does nothing would put the 1-GPU rate only {most:.0%} below the 4-GPU run's per GPU, not the {gap:.0%} "
            "published")


_MEGATRAIN_WARM_UP = _megatrain_warm_up(_MEGATRAIN_RATES[1], _MEGATRAIN_RATES[4])

# How the sources' code counts their FLOP rates (None in a run: not stated).
_MEGATRAIN_FLOPS = FlopCount(6, 0, "DLYuanGod/MegaTrain examples/sft/train.py: 'total_seq_tokens = config.batch_size "
                                   "* config.max_seq_len', 'flops = 6 * num_params * total_seq_tokens'; its 'Avg "
                                   "Throughput' is the mean over every step, the first included")
_SUPEROFFLOAD_FLOPS = FlopCount(8, 16, "deepspeedai/DeepSpeedExamples training/DeepSpeed-SuperOffload/"
                                       "finetune_zero3.py, "
                                       "estimate_transformer_tflops: 'coefficient = 4 if use_activation_checkpointing "
                                       "else 3', '2 * coefficient * model_size * seq_len + 2 * 2 * coefficient * "
                                       "num_layers * hidden_size * seq_len**2' per sequence")
PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "ZeRO-Offload", _s(40, _ZERO_OFFLOAD), "TFLOPS per device", "GPT-2 10B (50 x 4096, 32 heads)", _GPT2_10B,
        510, 1024, "v100", "DGX-2: 2 x Xeon Platinum 8168, 1.5 TB DDR4-2666 (paper, Table 2)",
        (*_HOST_AFTER, ("grad_accum", 51)),
        "batch 512 (Figure 8) in micro-batches of 10 (Table 3) with gradient accumulation and the delayed update off "
        "(section 6.2.2); 512 is no multiple of 10, so 51 micro-batches are planned; activation checkpointing "
        "from the DeepSpeed tutorial's 10B config; seq 1024 is Megatron GPT-2's default, not stated; the V100's "
        f"training_mfu (40%) is ZeRO-3 Offload's 50 TFLOPS, in the same unstated convention; {_NO_FLOPS}"),
    PublishedRun(
        "SuperOffload", _s(600, _SUPEROFFLOAD), "TFLOPS per device", "Qwen3-14B (40 x 5120)", _QWEN3_14B, 4, 4096,
        "gh200", "Grace CPU, 72 Arm cores, LPDDR5X", (("activations", "checkpoint"), ("store", "ram"),
                                                   ("update_on", "host"), ("update_timing", "overlapped")),
        "one figure for three models (DeepSpeedExamples' README says 'up to ~500 TFLOPS'); batch 4, seq 4096 and "
        "activation checkpointing as its finetune_qwen3-14b_1gpu.sh runs them; its TFLOPS count the recompute "
        "and every parameter; the CPU update overlaps the backward as its speculation does; it updates a tenth "
        "of the parameters on the GPU ('ratio': 0.90), the plan all of them on Grace",
        flops=_SUPEROFFLOAD_FLOPS),
    PublishedRun(
        "MegaTrain", _s(_MEGATRAIN_RATES[1], _MEGATRAIN), "TFLOPS per device", "Qwen2.5-7B (28 x 3584)", _QWEN25_7B,
        158, 1024, "h100-sxm", "not stated", (*_HOST_AFTER, ("grad_accum", 2)),
        "batch and seq from qwen_7b_1gpu.yaml, committed with the figure; checkpointing as its README describes; "
        "the plan takes the batch in two micro-batches: in one, a block's backward holds 12.2 GiB of autograd's "
        "buffers and the plan is 2.8 GiB over the H100; "
        f"its TFLOPS count 6 FLOPs per parameter and padded token; {_MEGATRAIN_WARM_UP}; after the "
        "backward it clips the gradients on the CPU, runs DeepSpeedCPUAdam and copies every master into its pinned "
        "buffers, one after the other (train.py, and cpu_master.py's _sync_params_to_gpu), where the plan runs "
        "one AdamW pass; its GPU's MFU is below what the plan's kernels reach, and the sources do not say where its "
        "time goes",
        flops=_MEGATRAIN_FLOPS),
    PublishedRun(
        "MegaTrain, 4 GPUs", _s(_MEGATRAIN_RATES[4], _MEGATRAIN), "TFLOPS, all devices", "Qwen2.5-7B (28 x 3584)",
        _QWEN25_7B, 632, 1024, "h100-sxm", "one host's shared memory, read by every GPU's worker",
        (*_HOST_AFTER, ("devices", 4), ("grad_accum", 2)),
        "batch from qwen_7b_4gpu.yaml, 158 sequences per GPU (two micro-batches in the plan, as on one GPU), "
        "averaged over 10 steps, the first included; "
        "MegaTrain's workers share one host copy and need no gradient all-reduce, where the plan all-reduces; "
        "its GPUs reach 'MFU ~32.5%' (the commit's message, 6 FLOPs per parameter), below what the plan's "
        "kernels reach, and the sources do not say where their time goes",
        flops=_MEGATRAIN_FLOPS),
    PublishedRun(
        "Cerebras weight streaming", _s(15.3, _CEREBRAS), "speedup", "1T-parameter model (shape not published)",
        _GPTJ_6B, 1024, 2048, "cs3", "MemoryX (55 TB of DDR5) and SwarmX",
        (("activations", "checkpoint"), ("store", "ram"), ("grad_accum", 2), ("devices", 16)),
        "the model's shape and batch are not published: GPT-J-6B at 64 x 2048 per system, in two micro-batches "
        "of 32 (64 at once do not fit a CS-3), stands in; weak scaling, each system with its own micro-batches; "
        "the update in MemoryX; MemoryX's I/O and SwarmX's reduce at line rate (their sources in the catalogue) "
        "carry one stream for all systems, so the plan loses only SwarmX's tree latency, and what else costs the "
        "published run its 4% is not stated"),
    _lohan_run("LoHan", _s(143.1, _LOHAN_13B), "13B", 32, 12),
    _lohan_run("LoHan, batch 8", _s(42.8, _LOHAN_13B), "13B", 8, 12,
               "at batch 8 the plan's compute (9.5 s) and its SSD traffic (313 GB read, 210 GB written: 7.8 s at the "
               "12 drives' summed datasheet rates) overlap in an 11.7 s step; the published rate doubles from batch 8 "
               "to 16 (1.97 times), so its step at batch 8 is the SSDs' and longer: its RAID 0 array does not reach "
               "its drives' sum, and the sources neither measure nor state its rate"),
    _lohan_run("LoHan, batch 64", _s(155.8, _LOHAN_13B), "13B", 64, 12),
    _lohan_run("LoHan, 1 SSD", _s(37.5, _LOHAN_SSDS), "13B", 32, 1,
               "one drive bounds the plan's step (313 GB read at 7.0 GB/s, 210 GB written at 4.3 GB/s, the D7-P5500 "
               "series' datasheet rates); with the recompute counted the ratio is 0.94, and on 2 and 3 SSDs (Figure "
               "10(b): 64.3 and 81.1 TFLOPS) 0.98 and 1.03"),
    _lohan_run("LoHan, 175B", _s(86.9, _LOHAN_175B), "175B", 16, 12),
    PublishedRun(
        "Fuyou, A100", _s(172, _FUYOU_A100), "TFLOPS per device", *_LOHAN_MODELS["175B"], 16, 1024, "a100-80g",
        "not stated in the sources at hand", (),
        "not priced: the batch and the A100's server are not in the sources at hand (the paper's text was not; "
        "LoHan's artifact lists RTX 4090 runs only); 16 x 1024 is the 4090's 175B step, shown as a stand-in",
        reproducible=False),
    PublishedRun(
        "ZeRO-3 Offload", _s(49, _ZERO3_OFFLOAD), "TFLOPS per device", "1T-parameter model (shape not published)",
        _GPTJ_6B, 512, 2048, "v100", "32 DGX-2 nodes", (), "not priced: the model's shape and batch are not "
        "published, and ZeRO-3's parameter all-gather across 512 GPUs is not this planner's data parallelism",
        reproducible=False),
    PublishedRun(
        "SuperOffload, MoE", _s(600, _SUPEROFFLOAD), "TFLOPS per device", "GPT-OSS-20B (a mixture of experts)",
        _QWEN3_14B, 4, 4096, "gh200", "Grace CPU, 72 Arm cores, LPDDR5X", (), "not priced: the planner models dense "
        "blocks only, and a mixture of experts computes a fraction of its parameters per token",
        reproducible=False),
    PublishedRun(
        "SuperOffload, 8 GPUs", _s(0.55, _SUPEROFFLOAD_SP), "MFU", "13B model at 1M tokens",
        _GPTJ_6B, 8, 2048, "gh200", "8 GH200 superchips", (), "not priced: DeepSpeed-Ulysses sequence "
        "parallelism splits each sequence over the 8 GPUs, which the planner does not model; the figure is an MFU",
        reproducible=False),
)
