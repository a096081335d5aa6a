"""A catalogue preset measured on the accelerator it describes: `streamer calibrate --device cuda`.

The presets' achievable fractions are published ceilings (catalogue.py); this measures the machine at hand
against the preset's own peaks: the achieved share of the dense matmul and of causal attention, the host
links with pinned host buffers (one direction at a time, as the transport copies), and the host's AdamW.
The figures come back with basis "measured", and as the `--set` flags that put them into `streamer plan`
and `streamer train`. Every measurement takes a torch device, so the same code runs on the cpu in the tests;
on CUDA it ran on an H100 80GB (55 GB/s each way over pinned buffers, 74% of the bf16 matmul peak).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from layers.gptj.config import GPTJConfig
from memory_model.catalogue import Figure
from memory_model.devices import DEVICE_PRESETS, DeviceSpec, with_figures
from memory_model.kernels import attention_flops
from streamer.errors import StreamerError
from streamer.calibration.calibrate import DTYPES, measure_update

# (words in torch.cuda.get_device_name, the preset): the first match names the GPU's preset.
GPU_NAMES = (("GH200", "gh200"), ("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"),
             ("A100-SXM4-40GB", "a100-40g"), ("A100-PCIE-40GB", "a100-40g"), ("A100", "a100-80g"),
             ("4090", "rtx4090"))


@dataclass(frozen=True)
class ProbeSizes:
    """How large each measurement is: the GPU sizes by default, tiny ones for the cpu in the tests."""

    matmul_n: int = 8192
    attention_heads: int = 16
    attention_seq: int = 4096
    head_dim: int = 128
    copy_bytes: int = 1 << 30
    update_params: int = 64 * 2**20
    repeats: int = 5


def preset_for(name: str) -> str:
    """The preset of a GPU by its name (torch.cuda.get_device_name); a StreamerError naming --target when
    none matches."""
    for words, preset in GPU_NAMES:
        if words in name:
            return preset
    raise StreamerError(f"no catalogue preset matches {name!r}; name the one whose peaks to measure against: "
                        f"--target ({', '.join(DEVICE_PRESETS)})")


def _timed(device: torch.device, run: Callable[[], object], repeats: int) -> float:
    """Best seconds of `repeats` calls after a warm-up, each waited for on the device."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _=None: None)
    run()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def matmul_flops(device: torch.device, dtype: torch.dtype, sizes: ProbeSizes) -> float:
    n = sizes.matmul_n
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _timed(device, lambda: torch.mm(a, b, out=out), sizes.repeats)


def attention_flops_per_s(device: torch.device, dtype: torch.dtype, sizes: ProbeSizes) -> float:
    """Causal SDPA forward, counted as the planner counts it (the full T x T, kernels.attention_flops)."""
    q, k, v = (torch.randn(1, sizes.attention_heads, sizes.attention_seq, sizes.head_dim, device=device,
                           dtype=dtype) for _ in range(3))
    attention = torch.nn.functional.scaled_dot_product_attention
    seconds = _timed(device, lambda: attention(q, k, v, is_causal=True), sizes.repeats)
    shape = GPTJConfig(n_embd=sizes.attention_heads * sizes.head_dim, n_head=sizes.attention_heads,
                       n_positions=sizes.attention_seq, rotary_dim=min(64, sizes.head_dim))
    return attention_flops(shape, 1, sizes.attention_seq) / seconds


def copy_bandwidths(device: torch.device, sizes: ProbeSizes) -> tuple[float, float]:
    """Host-to-device and device-to-host bytes/s, host side pinned where the device can use it (CUDA)."""
    pinned = device.type == "cuda"
    host = torch.empty(sizes.copy_bytes, dtype=torch.uint8, pin_memory=pinned)
    on_device = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    h2d = _timed(device, lambda: on_device.copy_(host, non_blocking=pinned), sizes.repeats)
    d2h = _timed(device, lambda: host.copy_(on_device, non_blocking=pinned), sizes.repeats)
    return sizes.copy_bytes / h2d, sizes.copy_bytes / d2h


def calibrate_device(device: torch.device, preset: str, dtype: str = "bf16",
                     sizes: ProbeSizes | None = None) -> DeviceSpec:
    """`preset` with its achievable fractions, link rates and host AdamW measured on `device`."""
    sizes = ProbeSizes() if sizes is None else sizes
    spec = DEVICE_PRESETS[preset]
    peak = spec.flops_for(dtype)
    torch_dtype = DTYPES[dtype]
    matmul = matmul_flops(device, torch_dtype, sizes)
    attention = attention_flops_per_s(device, torch_dtype, sizes)
    h2d, d2h = copy_bandwidths(device, sizes)
    update = measure_update(sizes.update_params, sizes.repeats)
    where = f"on {torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type}"
    # The planner moves bytes at bandwidth x bandwidth_efficiency: the measured rates are stored over it so that
    # the product is what was measured.
    share = spec.bandwidth_efficiency
    figures = {
        "matmul_efficiency": Figure(min(1.0, matmul / peak), "measured",
                                    f"{dtype} {sizes.matmul_n}^3 matmul {where}: {matmul / 1e12:.4g} TFLOP/s of "
                                    f"the preset's {peak / 1e12:.4g}"),
        "attention_efficiency": Figure(min(1.0, attention / peak), "measured",
                                       f"causal SDPA forward {where}, {sizes.attention_heads} heads x "
                                       f"{sizes.attention_seq} tokens x {sizes.head_dim}: {attention / 1e12:.4g} "
                                       f"TFLOP/s (4 T^2 d counted)"),
        "h2d_bytes_per_s": Figure(h2d / share, "measured",
                                  f"{sizes.copy_bytes:,} B {'pinned ' if device.type == 'cuda' else ''}host -> "
                                  f"{device.type} {where}: {h2d / 1e9:.4g} GB/s / bandwidth_efficiency {share:g}"),
        "d2h_bytes_per_s": Figure(d2h / share, "measured",
                                  f"{sizes.copy_bytes:,} B {device.type} -> "
                                  f"{'pinned ' if device.type == 'cuda' else ''}host {where}: {d2h / 1e9:.4g} GB/s "
                                  f"/ bandwidth_efficiency {share:g}"),
        "host_update_bw": Figure(update, "measured", f"torch fused AdamW on {sizes.update_params:,} fp32 params "
                                                     "on this host's cores, 28 B/param touched"),
    }
    return with_figures(spec, figures)


def set_flags(spec: DeviceSpec) -> str:
    """The measured figures as the `--set` flags of `streamer plan` and `streamer train`."""
    return " ".join(f"--set {name}={f.value:.6g}" for name, f in spec.figures.items() if f.basis == "measured")

