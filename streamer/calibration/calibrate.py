"""The `local` device: this machine measured (matmul rate, kernel costs, copy and disk bandwidth, an AdamW sweep).

The cpu device and the host are the same RAM, so the spec says `same_memory=True`: host<->device copies
cost no time for the RAM tier. The compute probes measure one compute dtype (the one being planned) on the
planned model's own block and head, narrowed and shortened to fit a time budget, so that a calibration
takes seconds even where that dtype is emulated. The result is cached as JSON in the run directory and
reused while the machine's fingerprint (cpu, thread count, RAM, torch version), the dtype and the probed
shape are unchanged.

Each calibration records the load other processes put on the cores while it ran. One taken while they kept
the machine busy (more than BUSY_SHARE of its cores) says so in a note of the spec, which `streamer plan`
prints, and is measured again the first time it is asked for on a quiet machine.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import platform
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from layers.config import ModelConfig
from memory_model.catalogue import Figure
from memory_model.devices import DeviceSpec, Link, figure_values
from memory_model.kernels import KernelCosts, attention_flops, elementwise_width
from memory_model.shapes import UPDATE_TOUCHED_BYTES_PER_PARAM, forward_flops, loss_vocab_chunk
from memory_model.units import format_size, stored_bytes
from streamer.calibration.host_costs import HostCosts, measure_host_costs
from streamer.store.direct import AlignedBuffers, SequentialFile, open_for_direct_reads, pread_direct
from streamer.store.slabfile import pread_into

CACHE_NAME = "device-local.json"
CACHE_VERSION = 17  # each entry: the spec and the load other processes put on the cores while it was measured
# Other processes' average use of the cores over a calibration above which its timings count as disturbed: a
# tenth of the machine (0.2 cores of 2) slows a probe that runs on every core by about as much.
BUSY_SHARE = 0.1
QUIET_SAMPLE_S = 0.5  # how long the load is sampled before a busy calibration is measured again
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# A CPU's LayerNorm, GELU, rotary, casts and attention take ~2x a block's matmuls (kernels.py): probe for 3x.
_PROBE_OVERHEAD = 3


@dataclass(frozen=True)
class CalibrationSizes:
    """Upper bounds of each measurement. The planned model sizes the compute probes below them (its width
    and vocabulary), and `compute_seconds` bounds those in time: a calibration takes under 10 s on 2 cores."""

    matmul_n: int = 2048  # largest side of the timed square matmul (the peak rate of the dtype)
    probe_width: int = 1024  # widest d_model of the kernel-cost block and head (whole heads of the model's size)
    probe_tokens: int = 512  # most tokens the kernel-cost probe runs
    compute_seconds: float = 4.0  # the matmul and kernel-cost probes together (a quarter for the matmul)
    copy_bytes: int = 64 * 2**20
    disk_bytes: int = 64 * 2**20
    update_params: int = 8 * 2**20
    allreduce_bytes: int = 32 * 2**20
    repeats: int = 3

    def __post_init__(self) -> None:
        for f in ("matmul_n", "probe_width", "probe_tokens", "copy_bytes", "disk_bytes", "update_params",
                  "allreduce_bytes", "repeats"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f} must be a positive integer, got {value!r}")
        if isinstance(self.compute_seconds, bool) or not isinstance(self.compute_seconds, (int, float)) \
                or not math.isfinite(self.compute_seconds) or self.compute_seconds <= 0:
            raise ValueError(f"compute_seconds must be a positive number, got {self.compute_seconds!r}")


DEFAULT_SIZES = CalibrationSizes()


def _best_time(fn: Callable[[], object], repeats: int, seconds: float = math.inf) -> float:
    """Best of a warm-up and `repeats` timed calls; the repeats stop once `seconds` have passed.

    The warm-up (first-touch page faults, kernel selection) is timed too and can only lose the min, unless it
    took the whole budget: then the call is slow enough that those costs are a small part of it."""
    deadline = time.perf_counter() + seconds
    best = float("inf")
    for _ in range(1 + repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return max(best, 1e-9)


def measure_matmul_flops(dtype: torch.dtype, n: int, repeats: int, seconds: float = math.inf) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b, out=out), repeats, seconds)


def matmul_side(dtype: torch.dtype, largest: int, repeats: int, seconds: float) -> int:
    """The square matmul side, 256 doubled up to `largest`, whose warm-up and repeats fit in what is left of
    `seconds`: twice the side is 8x the FLOPs at no lower rate, so each doubling is judged by the last one."""
    n, deadline = min(256, largest), time.perf_counter() + seconds
    while n * 2 <= largest:
        took = 2 * n**3 / measure_matmul_flops(dtype, n, 0)
        if (1 + repeats) * 8 * took > deadline - time.perf_counter():
            break
        n *= 2
    return n


def probe_shape(shape: ModelConfig, sizes: CalibrationSizes) -> ModelConfig:
    """The block and head the kernel costs are measured on: the planned model's family, vocabulary, head size,
    rotary, query heads per key/value head and MLP ratio, at most `probe_width` wide (whole groups of heads), one
    layer, up to `probe_tokens` positions."""
    head_dim, group = shape.head_dim, shape.num_attention_heads // shape.num_key_value_heads
    heads = max(group, min(shape.num_attention_heads, sizes.probe_width // head_dim) // group * group)
    width = heads * head_dim
    inner = max(1, shape.intermediate_size * width // shape.hidden_size)
    return shape.resized(max_position_embeddings=sizes.probe_tokens, hidden_size=width, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=heads // group, intermediate_size=inner)


def probe_tokens(probe: ModelConfig, matmul_flops: float, repeats: int, seconds: float) -> int:
    """The most tokens (a power of two from 8 up to the probe's positions) whose kernel-cost runs fit
    `seconds`: a warm-up and `repeats` forward and backward passes (3x the forward's matmuls) of the block
    and the head, at _PROBE_OVERHEAD times their matmul time."""
    def cost(tokens: int) -> float:
        flops = sum(forward_flops(probe, unit, 1, tokens) for unit in ("block.0", "head"))
        return (1 + repeats) * 3 * flops * _PROBE_OVERHEAD / matmul_flops
    tokens = 8
    while tokens * 2 <= probe.max_position_embeddings and cost(tokens * 2) <= seconds:
        tokens *= 2
    return min(tokens, probe.max_position_embeddings)


def measure_copy(nbytes: int, repeats: int) -> tuple[float, float]:
    """Bandwidth of a copy into an existing buffer (the runtime reuses buffers), and a small copy's latency."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    bandwidth = nbytes / _best_time(lambda: dst.copy_(src), repeats)
    tiny_src, tiny_dst = torch.ones(4096, dtype=torch.uint8), torch.empty(4096, dtype=torch.uint8)
    latency = _best_time(lambda: tiny_dst.copy_(tiny_src), 20) - 4096 / bandwidth
    return bandwidth, max(latency, 0.0)


def measure_disk(directory: Path, nbytes: int, as_store: bool = False) -> tuple[float, float]:
    """Sequential write then read of a new file of `nbytes` in `directory`, in 8 MiB pieces; the read with the
    page cache dropped. Both are the disk's raw rates (buffered; the write with one fsync) or, `as_store`, the
    store's own for a state file, which the planner prices: written by `SequentialFile` (past the page cache
    where the filesystem allows, checksummed as it goes, one flush) and read past the page cache where the
    filesystem allows (`store.direct.pread_direct`). The raw write ran 1.3-1.5x the store's on this project's box."""
    piece = min(nbytes, 8 * 2**20)
    buf = bytearray(os.urandom(1024) * (piece // 1024) + os.urandom(piece % 1024))
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="disk-calibration-", dir=directory)
    try:
        start = time.perf_counter()
        _write_file(fd, Path(name), buf, nbytes, as_store)
        write_bw = nbytes / max(time.perf_counter() - start, 1e-9)
        # Drop the file from the page cache (its pages are clean after the flush) so the read hits the disk.
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        _read_file(fd, Path(name), nbytes, piece, as_store)
        read_bw = nbytes / max(time.perf_counter() - start, 1e-9)
    finally:
        os.close(fd)
        os.unlink(name)
    return read_bw, write_bw


def _read_file(fd: int, path: Path, nbytes: int, piece: int, as_store: bool) -> None:
    """The file `fd` at `path`, front to back, in `piece`-byte reads into one page-aligned buffer: through the
    page cache, or, `as_store`, past it where the filesystem allows, as the store reads a state file."""
    buf = torch.frombuffer(mmap.mmap(-1, piece), dtype=torch.uint8)
    direct = open_for_direct_reads(path) if as_store else None
    try:
        for offset in range(0, nbytes, piece):
            out = buf[: min(piece, nbytes - offset)]
            if direct is None:
                pread_into(fd, out, offset, path)
            elif not pread_direct(direct, fd, out, offset, path):
                os.close(direct)
                direct = None
    finally:
        if direct is not None:
            os.close(direct)


def _write_file(fd: int, path: Path, buf: bytearray, nbytes: int, as_store: bool) -> None:
    """`nbytes` of `buf`, repeated, into the new file `fd` at `path`, flushed: measure_disk's write."""
    pieces = [memoryview(buf)[: min(len(buf), nbytes - offset)] for offset in range(0, nbytes, len(buf))]
    if not as_store:
        for piece in pieces:
            done = 0
            while done < len(piece):  # a write may take fewer bytes than it was given
                done += os.write(fd, piece[done:])
        os.fsync(fd)
        return
    staging = AlignedBuffers()
    out = SequentialFile(path, staging)
    try:
        for piece in pieces:
            out.write(piece)
        out.finish()
    finally:
        out.close()
        staging.close()


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
                      repeats: int, deadline: float) -> tuple[float, float]:
    """Best forward and best backward seconds of a warm-up and `repeats` runs of `run` (a scalar-valued graph),
    fresh graph each time; the repeats stop at `deadline` (time.perf_counter()), as in _best_time."""
    forward = backward = float("inf")
    for i in range(1 + repeats):
        if i and time.perf_counter() > deadline:
            break
        for p in params:
            p.grad = None
        start = time.perf_counter()
        out = run()
        middle = time.perf_counter()
        out.backward()
        forward, backward = min(forward, middle - start), min(backward, time.perf_counter() - middle)
    return forward, backward


# The short sequence attention is also timed at: below a CPU flash attention's block of queries and keys.
_SHORT_SEQ = 32


def _attention_costs(shape: ModelConfig, dtype: torch.dtype, tokens: int, matmul_flops: float, repeats: int,
                     deadline: float) -> tuple[dict[str, float], float, float]:
    """Causal scaled_dot_product_attention of `shape`'s heads timed on `tokens` tokens twice: as one sequence and
    as sequences of _SHORT_SEQ, whose FLOPs are a fraction of the first's. The two times fit a rate on the FLOPs
    and a cost per token and query head (KernelCosts' attention fields). Where the long sequence is no slower,
    its FLOPs take no measurable time: they are priced at the matmul rate, the fastest attention could go, and
    the rest is per token. Returns the fields, and the forward's and the backward's seconds they price at 1 x
    `tokens`."""
    def timed(batch: int, seq: int) -> tuple[float, float]:
        q, k, v = (torch.randn(batch, shape.num_attention_heads, seq, shape.head_dim, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        def sdpa() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum()

        return _forward_backward(sdpa, [q, k, v], repeats, deadline)

    short = min(_SHORT_SEQ, tokens)
    shapes = ((1, tokens), (tokens // short, short))
    (long_f, long_b), (short_f, short_b) = (timed(*s) for s in shapes)
    (flops_long, flops_short), (token_heads_long, token_heads_short) = zip(
        *((attention_flops(shape, b, t), b * t * shape.num_attention_heads) for b, t in shapes), strict=True)

    def fit(long_s: float, short_s: float, passes: int) -> tuple[float, float, float]:
        """(FLOP rate, seconds per token and head, seconds at the long shape) of `passes` x the FLOPs."""
        # Each time is its FLOPs x seconds a FLOP plus its tokens x heads x seconds each: solved for the first.
        det = flops_long * token_heads_short - flops_short * token_heads_long
        x = 0.0 if det == 0 else (long_s * token_heads_short - short_s * token_heads_long) / det
        flop_s = max(passes * flops_long / matmul_flops, flops_long * x)
        token_s = max(0.0, long_s - flop_s) / token_heads_long
        return passes * flops_long / flop_s, token_s, flop_s + token_s * token_heads_long

    (forward_rate, forward_token_s, forward_s), (backward_rate, backward_token_s, backward_s) = (
        fit(long_f, short_f, 1), fit(long_b, short_b, 2))
    fields = {"attention_forward_flops": forward_rate, "attention_backward_flops": backward_rate,
              "attention_forward_token_s": forward_token_s, "attention_backward_token_s": backward_token_s}
    return fields, forward_s, backward_s


def measure_kernel_costs(dtype_name: str, matmul_flops: float, fold_params: int, repeats: int, probe: ModelConfig,
                         tokens: int, host: HostCosts, seconds: float = math.inf) -> KernelCosts:
    """The costs besides the matmuls (kernels.py), on a real block, head and embedding of shape `probe` (its family's)
    (probe_shape: the planned model's vocabulary, so that the logits are as large against the caches as in
    the run) at 1 x `tokens`: each one's time less its matmuls at `matmul_flops`, per counted element.
    `fold_params`: size of the timed gradient fold (the runtime's offload on the host). The repeats of all
    the measurements together stop after `seconds`; `host`: the costs of the runtime itself (host_costs.py)."""
    from layers.model import build_unit

    dtype = DTYPES[dtype_name]
    cfg = probe.resized(max_position_embeddings=max(tokens, probe.max_position_embeddings), num_hidden_layers=1)
    shape, batch, seq = cfg, 1, tokens
    n, torch_state = batch * seq, torch.random.get_rng_state()
    deadline = time.perf_counter() + seconds
    torch.manual_seed(0)
    try:
        attention, attn_fwd, attn_bwd = _attention_costs(shape, dtype, seq, matmul_flops, repeats, deadline)

        block = build_unit(cfg, "block.0", "cpu").to(dtype)
        x = torch.randn(batch, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
        fwd, bwd = _forward_backward(lambda: block(x).float().sum(), [x, *block.parameters()], repeats, deadline)
        attn = attention_flops(shape, batch, seq)
        matmul_s = (forward_flops(shape, "block.0", batch, seq) - attn) / matmul_flops
        width = n * elementwise_width(shape)

        head = build_unit(cfg, "head", "cpu").to(dtype)
        labels = torch.randint(0, cfg.vocab_size, (batch, seq))
        chunk = loss_vocab_chunk(cfg, n)
        head_fwd, head_bwd = _forward_backward(lambda: head(x, labels, chunk), [x, *head.parameters()], repeats,
                                               deadline)
        head_matmul_s, logits = forward_flops(shape, "head", batch, seq) / matmul_flops, n * cfg.vocab_size

        embed = build_unit(cfg, "embed", "cpu").to(dtype)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        _, embed_bwd = _forward_backward(lambda: embed(ids).float().sum(), list(embed.parameters()), repeats,
                                         deadline)

        grad, accumulator = torch.full((fold_params,), 1e-3, dtype=dtype), torch.empty(fold_params)
        fold_s = _best_time(lambda: torch.linalg.vector_norm(accumulator.copy_(grad)), repeats,
                            max(0.0, deadline - time.perf_counter()))
        cast_s = _best_time(lambda: grad.copy_(accumulator), repeats, max(0.0, deadline - time.perf_counter()))
        precision_work = _precision_work(fold_params)
        for run in precision_work:
            run()  # builds or compiles its kernel (streamer.native, streamer.compiled), once per machine or process
        quantize_s, dequantize_s, round_s = (
            _best_time(run, repeats, max(0.0, deadline - time.perf_counter())) / fold_params
            for run in precision_work)
    finally:
        torch.random.set_rng_state(torch_state)
    # A residual below zero is timing noise around a kernel that costs ~nothing.
    return KernelCosts(
        **attention,
        elementwise_forward_s=max(0.0, fwd - matmul_s - attn_fwd) / width,
        elementwise_backward_s=max(0.0, bwd - 2 * matmul_s - attn_bwd) / width,
        logits_forward_s=max(0.0, head_fwd - head_matmul_s) / logits,
        logits_backward_s=max(0.0, head_bwd - 2 * head_matmul_s) / logits,
        embedding_backward_s=embed_bwd / (cfg.vocab_size * cfg.hidden_size),
        # the bytes timing.py counts for a one-micro-batch fold: read es, write 4, read 4 for the norm
        gradient_fold_bytes_per_s=fold_params * (grad.element_size() + 8) / fold_s,
        compute_cast_bytes_per_s=fold_params * (4 + grad.element_size()) / cast_s,
        event_s=host.event_s, step_s=host.step_s, disk_event_s=host.disk_event_s, disk_step_s=host.disk_step_s,
        page_cache_bytes_per_s=host.page_cache_bytes_per_s, flush_s=host.flush_s,
        state_file_s=host.state_file_s, quantize_s=quantize_s,
        dequantize_s=dequantize_s, round_s=round_s)


def _precision_work(numel: int) -> tuple[Callable[[], object], ...]:
    """The opt-in precisions' work on `numel` random fp32 values (the code tables' look-ups depend on them), as the
    store and the update run it: an int8 moment quantized, then dequantized, and a bf16 master rounded
    stochastically."""
    from streamer.runtime.optim import stochastic_round_bf16_
    from streamer.store.quant import decode, encode

    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    raw = torch.empty(stored_bytes("int8", values.numel()), dtype=torch.uint8)
    decoded = torch.empty_like(values)
    return (lambda: encode(values, True, raw), lambda: decode(raw, True, decoded),
            lambda: stochastic_round_bf16_(decoded, 0, 0))


def measure_allreduce(nbytes: int, repeats: int) -> float:
    """Bus bandwidth of a 2-rank gloo all-reduce on this host: the data-parallel link of the cpu device.

    The two ranks are threads of this process, each with its own gloo group over loopback TCP (the transport
    two processes use): spawning two processes would cost seconds of importing torch. With two ranks a ring
    all-reduce moves 2 (n-1)/n = 1 times the data, so bus and algorithm bandwidth agree.
    """
    import torch.distributed as dist
    store, seconds, errors = dist.HashStore(), {}, []

    def rank(r: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=60))
            t = torch.ones(nbytes // 4)
            allreduce = group.allreduce  # type: ignore[attr-defined]  # torch's stubs omit Gloo's collectives
            seconds[r] = _best_time(lambda: allreduce([t]).wait(), repeats)
        except Exception as exc:  # reported below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors or 0 not in seconds:
        raise RuntimeError(f"the 2-rank gloo all-reduce measurement failed: {errors[0] if errors else 'no time'}")
    return nbytes / seconds[0]


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
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor()


def calibrate(directory: Path, shape: ModelConfig, dtype: str, sizes: CalibrationSizes | None = None) -> DeviceSpec:
    """Measure this machine now for planning `shape` in compute dtype `dtype` ("bf16" or "fp32"); the disk
    test writes its temp file in `directory`."""
    if dtype not in DTYPES:
        raise ValueError(f"cannot calibrate compute dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    sizes = DEFAULT_SIZES if sizes is None else sizes
    matmul_s = sizes.compute_seconds / 4
    n = matmul_side(DTYPES[dtype], sizes.matmul_n, sizes.repeats, matmul_s)
    flops = measure_matmul_flops(DTYPES[dtype], n, sizes.repeats, matmul_s)
    probe = probe_shape(shape, sizes)
    tokens = probe_tokens(probe, flops, sizes.repeats, sizes.compute_seconds - matmul_s)
    # One write ran 0.42-1.70 GB/s: the median of a few.
    tries = [measure_disk(directory, sizes.disk_bytes, as_store=True) for _ in range(sizes.repeats)]
    read_bw, write_bw = (statistics.median(t[i] for t in tries) for i in (0, 1))
    host = measure_host_costs(directory, shape, DTYPES[dtype], sizes.disk_bytes, sizes.repeats, write_bw)
    kernels = measure_kernel_costs(dtype, flops, sizes.update_params, sizes.repeats, probe, tokens, host,
                                   sizes.compute_seconds - matmul_s)
    copy_bw, latency = measure_copy(sizes.copy_bytes, sizes.repeats)
    update_bw = measure_update(sizes.update_params, sizes.repeats)
    allreduce_bw = measure_allreduce(sizes.allreduce_bytes, sizes.repeats)
    ram = psutil.virtual_memory().total
    link = Link(copy_bw, latency)
    fp = fingerprint()
    spec = DeviceSpec(
        name="local", memory_bytes=ram, h2d=link, d2h=link, flops={dtype: flops}, device_mem_bandwidth=update_bw,
        host_ram_bytes=ram, disk_read_bw=read_bw, disk_write_bw=write_bw, host_update_bw=update_bw,
        same_memory=True, interconnect=Link(allreduce_bw), kernels={dtype: kernels},
        source=(f"calibrated {time.strftime('%Y-%m-%d %H:%M:%S')} on {fp['processor']}, "
                f"{fp['threads']} threads, torch {fp['torch']}, {dtype} compute"),
        notes=(f"{dtype} matmul {n}^3; kernel costs on a d={probe.hidden_size}, {probe.num_attention_heads}-head, "
               f"vocab {probe.vocab_size} {probe.model_type} block, head and embedding at 1 x {tokens} tokens (the "
               f"planned model's, narrowed to fit {sizes.compute_seconds:g} s); copy {format_size(sizes.copy_bytes)} "
               f"into an existing buffer; disk: median of {sizes.repeats} x {format_size(sizes.disk_bytes)} written as "
               f"the store writes a state file, read with the page cache dropped; AdamW on {sizes.update_params:,} "
               f"fp32 params, {UPDATE_TOUCHED_BYTES_PER_PARAM} B/param; 2-rank all-reduce of "
               f"{format_size(sizes.allreduce_bytes)}",
               "device memory is the whole RAM: the cpu device and the host share it"),
    )
    return replace(spec, figures={name: Figure(value, "measured", _MEASURED_BY.get(name, spec.notes[0]))
                                  for name, value in figure_values(spec).items()})


# How each figure of `local` is known, beyond the probes its first note lists (calibrate() above).
_ADAMW = "torch fused AdamW on an 8 Mi-element fp32 tensor, 28 B/param touched"
_MEASURED_BY = {"memory_bytes": "psutil: the whole RAM, shared by the cpu device and the host",
                "host_ram_bytes": "psutil: the whole RAM", "reserve_bytes": "a cpu device has no runtime context",
                "matmul_efficiency": "1: the rates are measured (achieved, not datasheet peaks)",
                "training_mfu": "1: no cap, the kernels beside the matmuls are measured",
                "host_update_bw": _ADAMW, "device_mem_bandwidth": _ADAMW}


def cpu_clock() -> tuple[float, float, float]:
    """(wall seconds, CPU seconds every core has run since boot, of them this process's and its children's)."""
    machine = psutil.cpu_times()
    ran = sum(getattr(machine, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = psutil.Process().cpu_times()
    return time.perf_counter(), ran, own.user + own.system + own.children_user + own.children_system


def others_cores(begin: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """The cores other processes kept busy on average between two `cpu_clock` readings."""
    wall, ran, own = (b - a for a, b in zip(begin, end, strict=True))
    return max(0.0, ran - own) / max(wall, 1e-9)


def busy(load: float) -> bool:
    """Whether other processes' `load` (in cores) disturbs a calibration of this machine."""
    return load > BUSY_SHARE * (os.cpu_count() or 1)


def load_now() -> float:
    """Other processes' load on the cores now, sampled over QUIET_SAMPLE_S while this process waits."""
    begin = cpu_clock()
    time.sleep(QUIET_SAMPLE_S)
    return others_cores(begin, cpu_clock())


def _busy_note(load: float) -> str:
    return (f"calibrated while other processes kept {load:.1f} of {os.cpu_count()} cores busy: its times may be "
            "slow; it is measured again when the machine is quiet (or now with `streamer calibrate`)")


def local_spec(cache_dir: Path | None, shape: ModelConfig, dtype: str, refresh: bool = False,
               sizes: CalibrationSizes | None = None) -> DeviceSpec:
    """The cached calibration in cache_dir when it matches this machine, the dtype and the probed shape, else
    a fresh one (then cached beside the others). A cached one taken on a busy machine is measured again if the
    machine is quiet now; else it is used, its note saying it was busy."""
    if cache_dir is None:
        with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
            return calibrate(Path(tmp), shape, dtype, sizes)
    path = cache_dir / CACHE_NAME
    key = _cache_key(shape, dtype, DEFAULT_SIZES if sizes is None else sizes)
    entries = _read_cache(path)
    cached = None if refresh else cached_local_spec(cache_dir, shape, dtype, sizes)
    if cached is not None and not (busy(entries[key]["others_cores"]) and not busy(load_now())):
        return cached  # else none, damaged, or busy while the machine is quiet now: measured again below
    begin = cpu_clock()
    spec = calibrate(cache_dir, shape, dtype, sizes)
    load = others_cores(begin, cpu_clock())
    if busy(load):
        spec = replace(spec, notes=(*spec.notes, _busy_note(load)))
    payload = {"version": CACHE_VERSION, "fingerprint": fingerprint(),
               "entries": {**entries, key: {"spec": spec.to_dict(), "others_cores": load}}}
    staged = path.with_suffix(".json.tmp")
    staged.write_text(json.dumps(payload, indent=2))
    staged.replace(path)  # atomic: a concurrent reader sees the old cache or the new one, never half
    return spec


def cached_local_spec(cache_dir: Path, shape: ModelConfig, dtype: str, sizes: CalibrationSizes | None = None
                      ) -> DeviceSpec | None:
    """`local_spec`'s cached calibration, or None where this machine has none for the dtype and shape. Nothing
    is measured: `streamer train` reads it to price a clipping step's schedules on `local`."""
    entry = _read_cache(cache_dir / CACHE_NAME).get(_cache_key(shape, dtype, DEFAULT_SIZES if sizes is None else sizes))
    try:
        return None if entry is None or not isinstance(entry["others_cores"], (int, float)) \
            else DeviceSpec.from_dict(entry["spec"])
    except (ValueError, KeyError, TypeError):
        return None


def _cache_key(shape: ModelConfig, dtype: str, sizes: CalibrationSizes) -> str:
    """What a calibration measured: the dtype, the probed block and head, and the sizes' bounds."""
    probe = probe_shape(shape, sizes).to_dict()
    return json.dumps({"dtype": dtype, "probe": probe, "sizes": asdict(sizes)}, sort_keys=True)


def _read_cache(path: Path) -> dict[str, Any]:
    """The cached calibrations by key; a cache from another machine, an older format or a damaged file
    counts as none (and is then rewritten)."""
    try:
        payload = json.loads(path.read_text())
        if payload.get("version") != CACHE_VERSION or payload.get("fingerprint") != fingerprint():
            return {}
        entries = payload["entries"]
        return entries if isinstance(entries, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
