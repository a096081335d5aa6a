"""What `streamer bench` measures about the machine itself: description, matmul peak, raw disk bandwidth, and
the largest model of one family whose disk-tier store fits the free disk."""
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from layers import PRESETS, ModelConfig
from memory_model import format_size
from benchmarks.report import params
from streamer.calibration.calibrate import cpu_model, measure_disk, measure_matmul_flops
from streamer.store.direct import AlignedBuffers, SequentialFile
from memory_model.step import Placement
from memory_model.units import Precision
from streamer.store.spec import StoreSpec



@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int
    ram_bytes: int
    torch: str
    python: str
    kernel: str
    commit: str
    date: str
    gpu: str  # "" when torch sees none
    libraries: tuple[str, ...]  # "name version" of the contenders' libraries, or "name: not installed"

    def lines(self) -> list[str]:
        return [f"CPU: {self.cpu}, {self.cores} cores; RAM {format_size(self.ram_bytes)}",
                f"GPU: {self.gpu or 'none (torch sees no CUDA device)'}",
                f"torch {self.torch}, Python {self.python}, Linux {self.kernel}; " + ", ".join(self.libraries),
                f"commit {self.commit}; date {self.date}"]


def _version(name: str) -> str:
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{name}: not installed"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def describe() -> Machine:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return Machine(cpu=cpu_model(), cores=os.cpu_count() or 1, ram_bytes=psutil.virtual_memory().total,
                   torch=torch.__version__, python=platform.python_version(), kernel=platform.release(),
                   commit=_commit(), date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
                   gpu=gpu, libraries=tuple(_version(n) for n in ("transformers", "deepspeed")))


@dataclass(frozen=True)
class Peaks:
    """Best of `repeats` timed square matmuls with torch's default threads, measured in this run."""

    bf16_flops: float
    fp32_flops: float
    n: int


# Each dtype's repeats stop here: where bf16 is emulated (an AVX2-only CPU), one 2048^3 matmul takes half a minute.
PEAK_SECONDS = 10.0


def matmul_peaks(n: int, repeats: int = 5, seconds: float = PEAK_SECONDS) -> Peaks:
    return Peaks(measure_matmul_flops(torch.bfloat16, n, repeats, seconds),
                 measure_matmul_flops(torch.float32, n, repeats, seconds), n)


@dataclass(frozen=True)
class UpdateRates:
    """AdamW over the same fp32 state of `numel` parameters, one step after another: the runtime's update
    (streamer.runtime.optim.adamw_chunk, `chunk` parameters at a time) and torch.optim.AdamW(fused=True) over the
    whole tensor; each the best of `repeats` steps, taken in turn."""

    numel: int
    chunk: int
    ours_s: float
    torch_s: float
    same: bool  # the two left the weights bit for bit equal


def update_rates(numel: int, chunk: int, repeats: int = 7) -> UpdateRates:
    from streamer.runtime.optim import OptimizerConfig, adamw_chunk

    tc, generator = OptimizerConfig(), torch.Generator().manual_seed(0)
    master, grad = (torch.randn(numel, generator=generator) for _ in range(2))
    ours = {"master": master.clone(), "grad": grad, "exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel)}
    weight = torch.nn.Parameter(master)
    weight.grad = grad.clone()
    reference = torch.optim.AdamW([weight], lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay,
                                  fused=True)
    ours_s, torch_s = [], []
    for step in range(1, repeats + 2):  # the first step of each is a warm-up
        start = time.perf_counter()
        for lo in range(0, numel, chunk):
            adamw_chunk({k: v[lo:lo + chunk] for k, v in ours.items()}, lo, numel, tc, step, tc.lr, 1.0)
        ours_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        reference.step()
        torch_s.append(time.perf_counter() - start)
    return UpdateRates(numel, chunk, min(ours_s[1:]), min(torch_s[1:]), torch.equal(ours["master"], weight.data))


@dataclass(frozen=True)
class DiskBandwidth:
    """Sequential buffered write + fsync, then read with the file dropped from the page cache, and the two at
    once; the best of `repeats` (the disk is shared: a single try measures whoever else was writing as much as
    the disk)."""

    read_bytes_per_s: float
    write_bytes_per_s: float
    nbytes: int
    repeats: int
    where: str
    shared_bytes_per_s: float  # bytes read plus bytes written per second, reading and writing at once


def raw_disk(directory: Path, nbytes: int, repeats: int) -> DiskBandwidth:
    tries = [measure_disk(directory, nbytes) for _ in range(repeats)]
    shared = max(read_while_writing(directory, nbytes) for _ in range(repeats))
    return DiskBandwidth(max(r for r, _ in tries), max(w for _, w in tries), nbytes, repeats, str(directory), shared)


def read_while_writing(directory: Path, nbytes: int) -> float:
    """Bytes per second the disk moves reading one file (dropped from the page cache) while the store's own
    writer (O_DIRECT where the filesystem allows it) writes and flushes another, `nbytes` each: the rate a
    disk-tier step's reads and writes share, as they reach one device."""
    piece = min(nbytes, 8 * 2**20)
    data = memoryview(os.urandom(piece))
    paths = []
    for _ in range(2):
        fd, name = tempfile.mkstemp(prefix="disk-shared-", dir=directory)
        os.close(fd)  # opened again by name below; a descriptor left open keeps the file's blocks after the unlink
        paths.append(Path(name))
    buffers = AlignedBuffers()

    def write(path: Path) -> None:
        out = SequentialFile(path, buffers)
        try:
            for offset in range(0, nbytes, piece):
                out.write(data[:min(piece, nbytes - offset)])
            out.finish()
        finally:
            out.close()

    try:
        write(paths[0])
        source = os.open(paths[0], os.O_RDONLY)
        os.posix_fadvise(source, 0, 0, os.POSIX_FADV_DONTNEED)  # in case it went through the page cache
        into = bytearray(piece)
        start = time.perf_counter()
        with ThreadPoolExecutor(1) as writer:
            written = writer.submit(write, paths[1])  # its writes and flushes release the GIL
            for offset in range(0, nbytes, piece):
                os.preadv(source, [memoryview(into)[:min(piece, nbytes - offset)]], offset)
            written.result()
        os.close(source)
        return 2 * nbytes / (time.perf_counter() - start)
    finally:
        buffers.close()
        for path in paths:
            path.unlink()


# --- the scale run -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelChoice:
    """A scale-run candidate. The disk tier stores the master and the Adam moments only (loads cast the master
    to the compute dtype): 12 B/param with fp32 ones; 8 with bf16 moments, or 4.03 with a bf16 master and int8
    moments (both acceptable only for the model the run is asked for, or its width). The update is fused into the
    backward where the disk holds a second generation of every unit, else it runs after the backward."""

    name: str
    config: ModelConfig
    precision: Precision = Precision("bf16")
    update_timing: str = "fused"
    # Two units ahead: a fused step's backward then loads the next backward's weights before its own state chunks.
    prefetch: int = 2
    qlora_rank: int = 0  # QLoRA: adapters of this rank on the frozen base, stored 4-bit (nf4, double quant)

    @property
    def params(self) -> int:
        return self.config.num_params()

    def _spec(self) -> StoreSpec:
        return StoreSpec(self.config, self.precision, Placement.of("disk"), frozen=bool(self.qlora_rank),
                         quant_type="nf4" if self.qlora_rank else "", double_quant=bool(self.qlora_rank))

    @property
    def store_bytes(self) -> int:
        """Data bytes of a disk-tier store of this model between steps (its state files), from the store's
        own layout."""
        return sum(self._spec().state_bytes(self.config.params().own(u)) for u in self.config.unit_names())

    @property
    def disk_bytes(self) -> int:
        """What the run needs on disk at its largest. Fused: every unit's next generation beside the previous
        one (its rollback, should clipping trigger) until the step commits; the scale run does not clip, so no
        step writes gradient files. After the backward: the gradient files and one unit's second generation
        (`StoreSpec.host_bytes`). A frozen base is only read."""
        if self.qlora_rank:
            return self.store_bytes
        if self.update_timing == "fused":
            return 2 * self.store_bytes
        return self._spec().host_bytes(every_unit_twice=False)[1]

    def describe(self) -> str:
        c = self.config
        shape = (f"{self.name} ({params(self.params)} params: d_model {c.hidden_size}, {c.num_hidden_layers} layers, "
                 f"{c.num_attention_heads} heads; {self.precision.compute} compute, ")
        if self.qlora_rank:
            return shape + f"QLoRA r={self.qlora_rank}: nf4 base, double quant, prefetch {self.prefetch})"
        return shape + (f"{self.precision.master} master, {self.precision.moments} Adam moments, update "
                        f"{self.update_timing}, prefetch {self.prefetch})")


def family_presets(cfg: ModelConfig) -> list[str]:
    """The presets of `cfg`'s family, largest first."""
    return sorted((name for name, p in PRESETS.items() if p.model_type == cfg.model_type),
                  key=lambda name: -PRESETS[name].num_params())


def fitted_width(full: ModelChoice, budget_bytes: int) -> ModelChoice | None:
    """`full`'s width, precisions and update with as many of its layers as a disk budget holds (None when not
    even one block fits)."""
    base = full.config
    one, two = (dataclasses.replace(full, config=base.resized(num_hidden_layers=n)) for n in (1, 2))
    per_block = two.disk_bytes - one.disk_bytes
    layers = int(min(base.num_hidden_layers, (budget_bytes - (one.disk_bytes - per_block)) // per_block))
    if layers < 1:
        return None
    return dataclasses.replace(full, name=f"{full.name} width, {layers} layers",
                               config=base.resized(num_hidden_layers=layers))


@dataclass(frozen=True)
class ScalePick:
    model: str  # the model the run was asked for
    chosen: ModelChoice | None
    free_bytes: int
    budget_bytes: int
    considered: tuple[tuple[ModelChoice, bool], ...]  # (candidate, fits), largest first


def disk_budget(directory: Path, reserve_fraction: float, reserve_min_bytes: int) -> tuple[int, int]:
    """(free bytes, what the scale run may use): other users of the disk keep the reserve."""
    free = shutil.disk_usage(directory).free
    return free, max(0, free - max(int(free * reserve_fraction), reserve_min_bytes))


def pick_scale_model(model: str, candidates: list[ModelChoice], free: int, budget: int) -> ScalePick:
    """The first (largest) candidate for `model` whose disk footprint fits the budget."""
    considered = tuple((c, c.disk_bytes <= budget) for c in candidates)
    chosen = next((c for c, fits in considered if fits), None)
    return ScalePick(model, chosen, free, budget, considered)
