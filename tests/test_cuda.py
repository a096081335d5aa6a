"""On a CUDA GPU: streamed training equals resident training, pinned side-stream copies overlap compute, the
experts' grouped matmul equals one matmul per expert, and the ledger's peak matches the CUDA allocator's.

Skipped where torch sees no CUDA device (so `make test` skips them on a CPU); `make gpu-check`
(benchmarks/gpu_check.py) runs them first. Each test records what it measured (`record_property`), which
gpu-check puts in its report. The fp32 equality test's tolerance is twice torch's own difference between
its resident trainer on the GPU and on the CPU, measured in the test.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from layers import GPTJConfig
from memory_model import device_spec, plan
from streamer import StreamingTrainer, TrainerConfig
from benchmarks.gpu_check import overlap, union
from benchmarks.resident import ResidentTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU; `make gpu-check` runs these on one")

DEBUG = GPTJConfig.preset("gptj-debug")
Record = Callable[[str, Any], None]


def batches(cfg: GPTJConfig, n: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(n)]


def masters_of(resident: ResidentTrainer) -> dict[str, torch.Tensor]:
    names = (k for k, _ in resident.model.named_parameters())
    return dict(zip(names, (m.detach().float().cpu() for m in resident.masters), strict=True))


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def streamed_and_resident(tc: TrainerConfig, data: list[torch.Tensor], store_dir: Path
                          ) -> tuple[list[float], list[float], float, float]:
    """Losses of the streamed and the resident trainer from the same weights; the largest difference between
    their final fp32 master weights; and torch's own: the resident trainer on the GPU against itself on the CPU."""
    with StreamingTrainer(DEBUG, tc, store_dir=store_dir) as trainer:
        resident = ResidentTrainer(DEBUG, tc, trainer.state_dict())
        on_cpu = ResidentTrainer(DEBUG, tc.replace(device="cpu"), trainer.state_dict())
        streamed = [trainer.step(ids) for ids in data]
        state = trainer.state_dict()
    reference = [resident.step(ids) for ids in data]
    for ids in data:
        on_cpu.step(ids)
    masters = masters_of(resident)
    return (streamed, reference, largest_difference(state, masters),
            largest_difference(masters, masters_of(on_cpu)))


@pytest.mark.parametrize("activations,store,update_on", [("resident", "ram", "device"), ("checkpoint", "disk", "host"),
                                                        ("offload", "ram", "device")])
def test_fp32_streamed_equals_resident_on_the_gpu(tmp_path: Path, record_property: Record, activations: str,
                                                  store: str, update_on: str) -> None:
    tc = TrainerConfig.of(lr=1e-3, grad_accum=2, max_grad_norm=1.0, dtype="fp32", activations=activations,
                          store=store, update_on=update_on, update_chunk=10_000, device="cuda")
    data = batches(DEBUG, 5, 4, 32)
    streamed, reference, weights_diff, torch_noise = streamed_and_resident(tc, data, tmp_path / "run")
    loss_diff = max(abs(s - r) for s, r in zip(streamed, reference, strict=True))
    record_property("max loss difference", f"{loss_diff:.2e}")
    record_property("max master-weight difference", f"{weights_diff:.2e}")
    record_property("torch's own: resident on the GPU vs on the CPU", f"{torch_noise:.2e}")
    # AdamW divides by sqrt(v), so the fp32 rounding of a kernel's sums reaches the weights amplified. On an H100
    # torch's resident trainer differs from itself on the CPU by 6.6e-6 here, and the streamed one from it by
    # the same; the losses by 4.8e-7 (the CPU's own streamed/resident difference too). Twice torch's own.
    assert loss_diff <= 5e-6 and weights_diff <= 2 * torch_noise
    assert streamed[0] > 5.0  # clipping is active (the norm is far above 1), so it is compared too


def test_bf16_streamed_tracks_resident_on_the_gpu(tmp_path: Path, record_property: Record) -> None:
    tc = TrainerConfig.of(lr=3e-3, dtype="bf16", max_grad_norm=1.0, device="cuda")
    data = batches(DEBUG, 2, 4, 32, seed=1) * 10  # a few batches, seen again: the curve has to move
    streamed, reference, _, _ = streamed_and_resident(tc, data, tmp_path / "run")
    worst = max(abs(s - r) / r for s, r in zip(streamed, reference, strict=True))
    record_property("largest relative loss difference", f"{worst:.2%}")
    assert streamed[-1] < streamed[0] - 0.3  # it learns
    # These 20 steps differ by at most 0.047% on the CPU (device="cpu") and 0.02% on an H100.
    assert worst <= 0.005


def _intervals(events: list[dict], keep: Callable[[dict], bool]) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if keep(e))


def test_pinned_side_stream_copies_overlap_compute(tmp_path: Path, record_property: Record) -> None:
    """One step under torch.profiler: the weight and state copies to the GPU come from pinned memory, run on a
    stream other than the compute kernels', and run while kernels run (the Chrome trace is kept for a look)."""
    cfg = GPTJConfig(vocab_size=8192, n_positions=1024, n_embd=1024, n_layer=8, n_head=16, rotary_dim=64)
    tc = TrainerConfig.of(dtype="bf16", store="ram", activations="checkpoint", device="cuda", prefetch=1)
    ids = torch.randint(0, cfg.vocab_size, (8, 1024), generator=torch.Generator().manual_seed(0))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(ids)  # warm-up: pinned staging buffers, cuBLAS handles, kernel selection
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as profile:
            trainer.step(ids)
            torch.cuda.synchronize()
    path = Path(os.environ.get("GPU_CHECK_DIR", tmp_path)) / "cuda-step.trace.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    # Large host-to-device copies: compute weights (16 MiB per block here) and update-state chunks; the
    # token ids (a few KiB, from pageable memory, on the compute stream) are left out.
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")
              and e.get("args", {}).get("bytes", 0) >= 2**20]
    assert kernels and copies, f"the trace has {len(kernels)} kernels and {len(copies)} large HtoD copies"
    busy: dict[Any, float] = {}
    for e in kernels:
        busy[e["args"].get("stream")] = busy.get(e["args"].get("stream"), 0.0) + e["dur"]
    compute_stream = max(busy, key=busy.__getitem__)
    kinds = sorted({e["name"] for e in copies})
    record_property("large HtoD copies", f"{len(copies)}: {', '.join(kinds)}")
    assert all("Pinned" in e["name"] for e in copies), f"copies from pageable memory: {kinds}"
    on_compute = [e for e in copies if e["args"].get("stream") == compute_stream]
    assert not on_compute, f"{len(on_compute)} of {len(copies)} large copies ran on the compute stream"
    copy_time = union(_intervals(copies, lambda e: True))
    compute_time = union(_intervals(kernels, lambda e: e["args"].get("stream") == compute_stream))
    overlapped = overlap(copy_time, compute_time)
    copy_total = sum(end - start for start, end in copy_time)
    record_property("copy time overlapped by compute", f"{overlapped / 1e3:.2f} of {copy_total / 1e3:.2f} ms "
                                                       f"({overlapped / copy_total:.0%}); trace {path}")
    assert overlapped > 0, "no copy ran while a compute kernel ran: the prefetch does not overlap"


@pytest.mark.parametrize("activations", ["checkpoint", "offload"])
def test_ledger_peak_matches_the_allocator(tmp_path: Path, record_property: Record, activations: str) -> None:
    """A steady-state step's ledger peak, and the planner's allocated peak, against
    torch.cuda.max_memory_allocated over the same step: within 5% (on CUDA the ledger rounds every allocation as
    the caching allocator does and keeps cuBLAS's workspaces). Offloaded, the block inputs' device storage is
    freed once copied out (the embedding's output kept as a shape only)."""
    cfg = GPTJConfig(vocab_size=8192, n_positions=2048, n_embd=2048, n_layer=6, n_head=16, rotary_dim=64)
    tc = TrainerConfig.of(dtype="bf16", store="ram", activations=activations, device="cuda",
                          update_chunk=2**20)
    ids = torch.randint(0, cfg.vocab_size, (2, 2048), generator=torch.Generator().manual_seed(0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # what earlier tests left alive (a failed test's traceback, say)
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(ids)  # warm-up: kernel selection, cuBLAS workspaces
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer.ledger.reset_peak()
        trainer.step(ids)
        torch.cuda.synchronize()
        allocator, ledger = torch.cuda.max_memory_allocated() - before, trainer.ledger.peak
    # The planner on this GPU: its compute capability sizes cuBLAS's workspaces, its blocks are rounded.
    major, minor = torch.cuda.get_device_capability()
    device = replace(device_spec("h100-sxm"), cuda_arch=f"sm{major}{minor}")
    planned = plan(cfg, device, tc.plan_config(2, 2048)).allocated_peak_bytes
    record_property("ledger peak (MiB)", f"{ledger / 2**20:,.1f}")
    record_property("planner's allocated peak (MiB)", f"{planned / 2**20:,.1f}")
    record_property("torch.cuda.max_memory_allocated (MiB)", f"{allocator / 2**20:,.1f}")
    record_property("allocator / ledger", f"{allocator / ledger:.3f}")
    assert abs(allocator / ledger - 1) <= 0.05, (f"allocator peak {allocator / 2**20:,.1f} MiB vs ledger peak "
                                                 f"{ledger / 2**20:,.1f} MiB")
    assert abs(allocator / planned - 1) <= 0.05, (f"allocator peak {allocator / 2**20:,.1f} MiB vs the planner's "
                                                  f"{planned / 2**20:,.1f} MiB")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_grouped_mm_on_the_gpu_equals_the_loop(record_property: Record, dtype: torch.dtype) -> None:
    """torch._grouped_mm computes a mixture's experts on CUDA: its forward and gradients against one matmul per
    expert on the same GPU, within the dtype's rounding of the largest element (fp32 without TF32: 1e-5), an
    expert with no rows exactly zero."""
    import layers.moe.units as units
    from layers.moe.units import GroupedLinear
    g = torch.Generator().manual_seed(0)
    sizes = [40, 0, 130, 7, 0, 79]
    x = torch.randn(sum(sizes), 256, generator=g).to("cuda", dtype).requires_grad_()
    w = torch.randn(len(sizes), 128, 256, generator=g).to("cuda", dtype).requires_grad_()
    upstream = torch.randn(sum(sizes), 128, generator=g).to("cuda", dtype)
    assert units.grouped_mm_serves(x, w)

    def products() -> tuple[torch.Tensor, ...]:
        out = GroupedLinear.apply(x, w, sizes)
        return (out, *torch.autograd.grad(out, (x, w), upstream))

    grouped = products()
    devices, units.GROUPED_MM_DEVICES = units.GROUPED_MM_DEVICES, set()
    try:
        loop = products()
    finally:
        units.GROUPED_MM_DEVICES = devices
    errors = [(a.float() - b.float()).abs().max().item() for a, b in zip(grouped, loop, strict=True)]
    record_property("max |grouped - loop| (out, grad x, grad w)", errors)
    rtol = 1e-5 if dtype == torch.float32 else 1.6e-2
    for a, b in zip(grouped, loop, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item())
    assert torch.count_nonzero(grouped[2][[1, 4]]) == 0
