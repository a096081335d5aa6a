"""The `local` device: this machine measured (matmul rates, copy and disk bandwidth, an AdamW sweep).

The cpu device and the host are the same RAM, so the spec says `same_memory=True`: host<->device copies
cost no time for the RAM tier. The result is cached as JSON in the run directory and reused while the
machine's fingerprint (cpu, thread count, RAM, torch version) is unchanged.
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from memory_model.devices import DeviceSpec, Link
from memory_model.kernels import KernelCosts, attention_flops, elementwise_width
from memory_model.shapes import UPDATE_TOUCHED_BYTES_PER_PARAM, ModelShape, forward_flops

CACHE_NAME = "device-local.json"
CACHE_VERSION = 4


@dataclass(frozen=True)
class CalibrationSizes:
    """How big each measurement is; the defaults finish in a few seconds on a 2-core machine."""

    matmul_n: int = 2048
    copy_bytes: int = 256 * 2**20
    disk_bytes: int = 256 * 2**20
    update_params: int = 64 * 2**20
    allreduce_bytes: int = 32 * 2**20
    repeats: int = 3

    def __post_init__(self) -> None:
        for f in ("matmul_n", "copy_bytes", "disk_bytes", "update_params", "allreduce_bytes", "repeats"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f} must be a positive integer, got {value!r}")


DEFAULT_SIZES = CalibrationSizes()


def _best_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and kernel selection are not the steady state
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_matmul_flops(dtype: torch.dtype, n: int, repeats: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b, out=out), repeats)


def measure_copy(nbytes: int, repeats: int) -> tuple[float, float]:
    """Bandwidth of a copy into an existing buffer (the runtime reuses buffers), and a small copy's latency."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    bandwidth = nbytes / _best_time(lambda: dst.copy_(src), repeats)
    tiny_src, tiny_dst = torch.ones(4096, dtype=torch.uint8), torch.empty(4096, dtype=torch.uint8)
    latency = _best_time(lambda: tiny_dst.copy_(tiny_src), 20) - 4096 / bandwidth
    return bandwidth, max(latency, 0.0)


def measure_disk(directory: Path, nbytes: int) -> tuple[float, float]:
    """Sequential write (with fsync) then read of a temp file in `directory`, in 8 MiB pieces."""
    piece = min(nbytes, 8 * 2**20)
    buf = bytearray(os.urandom(1024) * (piece // 1024) + os.urandom(piece % 1024))
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="disk-calibration-", dir=directory)
    try:
        start = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, memoryview(buf)[: min(piece, nbytes - written)])
        os.fsync(fd)
        write_bw = nbytes / max(time.perf_counter() - start, 1e-9)
        # Drop the file from the page cache (its pages are clean after fsync) so the read hits the disk.
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        read = 0
        while read < nbytes:
            got = os.readv(fd, [memoryview(buf)[: min(piece, nbytes - read)]])
            if got == 0:
                break
            read += got
        read_bw = read / max(time.perf_counter() - start, 1e-9)
    finally:
        os.close(fd)
        os.unlink(name)
    return read_bw, write_bw


def measure_update(params: int, repeats: int) -> float:
    """Bytes of AdamW state touched per second by torch's fused AdamW kernel (the runtime's) on one flat tensor."""
    from torch.optim.adamw import adamw

    p, g = torch.zeros(params), torch.full((params,), 1e-3)
    m, v = torch.zeros(params), torch.zeros(params)
    step = torch.tensor(0.0)

    def run() -> None:
        adamw([p], [g], [m], [v], [], [step], fused=True, amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-4,
              weight_decay=0.1, eps=1e-8, maximize=False)

    return UPDATE_TOUCHED_BYTES_PER_PARAM * params / _best_time(run, repeats)


def _forward_backward(run: Callable[[], torch.Tensor], params: list[torch.Tensor],
                      repeats: int) -> tuple[float, float]:
    """Best forward and best backward seconds of `run` (a scalar-valued graph), fresh graph each time."""
    run().backward()  # warm-up
    forward = backward = float("inf")
    for _ in range(repeats):
        for p in params:
            p.grad = None
        start = time.perf_counter()
        out = run()
        middle = time.perf_counter()
        out.backward()
        forward, backward = min(forward, middle - start), min(backward, time.perf_counter() - middle)
    return forward, backward


def measure_kernel_costs(dtype_name: str, matmul_flops: float, fold_params: int, repeats: int) -> KernelCosts:
    """The costs besides the matmuls (kernels.py), on a real GPT-J block, head and embedding of a reference
    shape: each one's time less its matmuls at `matmul_flops`, per counted element. The vocabulary is GPT-J's:
    a smaller one fits the logits in cache and times the loss too fast. `fold_params`: size of the timed
    gradient fold (the runtime's offload on the host)."""
    from layers import GPTJConfig
    from layers.block import GPTJBlock, GPTJEmbedding, GPTJHead
    from layers.loss import causal_lm_loss

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    cfg = GPTJConfig(vocab_size=50400, n_positions=512, n_embd=512, n_layer=1, n_head=8, rotary_dim=32)
    shape, batch, seq = ModelShape.from_config(cfg), 1, 512
    n, torch_state = batch * seq, torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        q, k, v = (torch.randn(batch, cfg.n_head, seq, cfg.head_dim, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum()
        attn_fwd, attn_bwd = _forward_backward(sdpa, [q, k, v], repeats)
        attn = attention_flops(shape, batch, seq)

        block = GPTJBlock(cfg).to(dtype)
        x = torch.randn(batch, seq, cfg.n_embd, dtype=dtype, requires_grad=True)
        fwd, bwd = _forward_backward(lambda: block(x).float().sum(), [x, *block.parameters()], repeats)
        matmul_s = (forward_flops(shape, "block.0", batch, seq) - attn) / matmul_flops
        width = n * elementwise_width(shape)

        head = GPTJHead(cfg).to(dtype)
        labels = torch.randint(0, cfg.vocab_size, (batch, seq))
        head_fwd, head_bwd = _forward_backward(lambda: causal_lm_loss(head(x), labels), [x, *head.parameters()],
                                               repeats)
        head_matmul_s, logits = forward_flops(shape, "head", batch, seq) / matmul_flops, n * cfg.vocab_size

        embed = GPTJEmbedding(cfg).to(dtype)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        _, embed_bwd = _forward_backward(lambda: embed(ids).float().sum(), list(embed.parameters()), repeats)

        grad, accumulator = torch.full((fold_params,), 1e-3, dtype=dtype), torch.empty(fold_params)
        fold_s = _best_time(lambda: torch.linalg.vector_norm(accumulator.copy_(grad)), repeats)
    finally:
        torch.random.set_rng_state(torch_state)
    # A residual below zero is timing noise around a kernel that costs ~nothing.
    return KernelCosts(
        attention_forward_flops=attn / attn_fwd, attention_backward_flops=2 * attn / attn_bwd,
        elementwise_forward_s=max(0.0, fwd - matmul_s - attn_fwd) / width,
        elementwise_backward_s=max(0.0, bwd - 2 * matmul_s - attn_bwd) / width,
        logits_forward_s=max(0.0, head_fwd - head_matmul_s) / logits,
        logits_backward_s=max(0.0, head_bwd - 2 * head_matmul_s) / logits,
        embedding_backward_s=embed_bwd / (cfg.vocab_size * cfg.n_embd),
        # the bytes timing.py counts for a one-micro-batch fold: read es, write 4, read 4 for the norm
        gradient_fold_bytes_per_s=fold_params * (grad.element_size() + 8) / fold_s)


def _allreduce_worker(rank: int, port: int, nbytes: int, repeats: int, results: Any) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(nbytes // 4)
    seconds = _best_time(lambda: dist.all_reduce(t), repeats)
    if rank == 0:
        results.put(seconds)
    dist.destroy_process_group()


def measure_allreduce(nbytes: int, repeats: int) -> float:
    """Bus bandwidth of a 2-process gloo all-reduce on this host: the data-parallel link of the cpu device.

    With two ranks a ring all-reduce moves 2 (n-1)/n = 1 times the data, so bus and algorithm bandwidth agree.
    """
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, nbytes, repeats, results)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode != 0 for proc in procs) or results.empty():
        raise RuntimeError("the 2-process gloo all-reduce measurement failed")
    return nbytes / results.get()


def fingerprint() -> dict[str, Any]:
    """What must not change for a cached calibration to stay valid."""
    return {
        "machine": platform.machine(), "processor": cpu_model(), "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(), "ram_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
    }


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def calibrate(directory: Path, sizes: CalibrationSizes | None = None) -> DeviceSpec:
    """Measure this machine now; the disk test writes its temp file in `directory`."""
    sizes = DEFAULT_SIZES if sizes is None else sizes
    flops = {name: measure_matmul_flops(dtype, sizes.matmul_n, sizes.repeats)
             for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    kernels = {name: measure_kernel_costs(name, rate, sizes.update_params, sizes.repeats)
               for name, rate in flops.items()}
    copy_bw, latency = measure_copy(sizes.copy_bytes, sizes.repeats)
    read_bw, write_bw = measure_disk(directory, sizes.disk_bytes)
    update_bw = measure_update(sizes.update_params, sizes.repeats)
    allreduce_bw = measure_allreduce(sizes.allreduce_bytes, sizes.repeats)
    ram = psutil.virtual_memory().total
    link = Link(copy_bw, latency)
    fp = fingerprint()
    return DeviceSpec(
        name="local", memory_bytes=ram, h2d=link, d2h=link, flops=flops, device_mem_bandwidth=update_bw,
        host_ram_bytes=ram, disk_read_bw=read_bw, disk_write_bw=write_bw, host_update_bw=update_bw,
        same_memory=True, interconnect=Link(allreduce_bw), kernels=kernels,
        source=(f"calibrated {time.strftime('%Y-%m-%d %H:%M:%S')} on {fp['processor']}, "
                f"{fp['threads']} threads, torch {fp['torch']}"),
        notes=(f"matmul {sizes.matmul_n}^3; copy {sizes.copy_bytes} B into an existing buffer; "
               f"disk {sizes.disk_bytes} B with fsync, page cache dropped before the read; "
               f"AdamW on {sizes.update_params} fp32 params, {UPDATE_TOUCHED_BYTES_PER_PARAM} B/param touched; "
               f"2-process gloo all-reduce of {sizes.allreduce_bytes} B; kernel costs on a d=512, 8-head, "
               "vocab 50400 GPT-J block, head and embedding at 1 x 512 tokens",
               "device memory is the whole RAM: the cpu device and the host share it"),
    )


def local_spec(cache_dir: Path | None, refresh: bool = False, sizes: CalibrationSizes | None = None) -> DeviceSpec:
    """The cached calibration in cache_dir when it matches this machine, else a fresh one (then cached)."""
    if cache_dir is None:
        with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
            return calibrate(Path(tmp), sizes)
    path = cache_dir / CACHE_NAME
    if not refresh and path.is_file():
        cached = _read_cache(path)
        if cached is not None:
            return cached
    spec = calibrate(cache_dir, sizes)
    payload = {"version": CACHE_VERSION, "fingerprint": fingerprint(), "spec": spec.to_dict(),
               "sizes": asdict(DEFAULT_SIZES if sizes is None else sizes)}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)  # atomic: a concurrent reader sees the old cache or the new one, never half
    return spec


def _read_cache(path: Path) -> DeviceSpec | None:
    """A cache from another machine, an older format or a damaged file is ignored (and then rewritten)."""
    try:
        payload = json.loads(path.read_text())
        if payload.get("version") != CACHE_VERSION or payload.get("fingerprint") != fingerprint():
            return None
        return DeviceSpec.from_dict(payload["spec"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
