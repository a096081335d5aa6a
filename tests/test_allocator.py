"""The CUDA caching allocator's arithmetic (memory_model.allocator) against torch's rules
(c10/cuda/CUDACachingAllocator.cpp: round_size, get_allocation_size, should_split; CublasHandlePool.cpp), and
where the ledger and the planner apply it: CUDA devices only, never the cpu or a wafer."""
from __future__ import annotations

import pytest

from layers import GPTJConfig
from memory_model import Ledger, PlanConfig, device_spec, plan
from memory_model.allocator import cublas_workspace_blocks, cuda_block_bytes, workspace_blocks, workspace_bytes
from streamer.runtime.hardware import DeviceConfig

MiB = 2**20


@pytest.mark.parametrize("request_bytes,block", [
    (0, 0),  # an empty tensor takes no block
    (1, 512), (512, 512), (513, 1024),  # rounded up to kMinBlockSize
    (MiB, MiB),  # kSmallSize: still the small pool (2 MiB segments split at 512 B)
    (MiB + 1, MiB + 512),  # the large pool: a 20 MiB segment (kLargeBuffer), the rest split off
    (9 * MiB, 9 * MiB),  # below kMinLargeAlloc: a 20 MiB segment, 11 MiB split off
    (10 * MiB, 10 * MiB),  # a segment of its own size (kRoundLarge multiple), nothing left
    (10 * MiB + 1, 10 * MiB + 512),  # a 12 MiB segment: 2 MiB - 512 B left, more than 1 MiB, split off
    (11 * MiB - 512, 11 * MiB - 512),  # a 12 MiB segment: 1 MiB + 512 B left, split off
    (11 * MiB + 512, 12 * MiB),  # 1 MiB - 512 B left: not more than kSmallSize, so the block keeps it
    (13 * MiB, 14 * MiB),  # exactly 1 MiB left: kept too (should_split needs more than kSmallSize)
])
def test_blocks_follow_the_caching_allocators_rules(request_bytes: int, block: int) -> None:
    assert cuda_block_bytes(request_bytes) == block


def test_cublas_workspaces_as_torch_sizes_them() -> None:
    """32 MiB per handle and stream on Hopper, :4096:2:16:8 elsewhere, CUBLAS_WORKSPACE_CONFIG's pairs where set;
    cuBLASLt's 1 MiB beside it; one pair for each of the two threads a step's matmuls run on."""
    assert cublas_workspace_blocks("sm90") == (32 * MiB, MiB)
    assert cublas_workspace_blocks("sm80") == (4096 * 1024 * 2 + 16 * 1024 * 8, MiB)
    assert cublas_workspace_blocks("sm90", ":4096:8") == (32 * MiB, MiB)
    assert cublas_workspace_blocks("sm90", ":16:8") == (128 * 1024, MiB)  # the deterministic setting
    assert cublas_workspace_blocks("sm90", "garbage") == (32 * MiB, MiB)  # torch warns and takes its default
    assert workspace_blocks("sm90") == (32 * MiB, MiB, 32 * MiB, MiB) and workspace_bytes("sm90") == 66 * MiB
    assert workspace_blocks("") == () and workspace_bytes("") == 0


def test_the_ledger_rounds_each_allocation_only_when_told() -> None:
    exact, rounded = Ledger(None), Ledger(None, "cuda", block_bytes=cuda_block_bytes)
    for ledger in (exact, rounded):
        ledger.free(ledger.allocate("activations", "block.0", 1000))
        ledger.allocate("workspace", "block.0", 11 * MiB + 512)
    assert exact.peak == 11 * MiB + 512 and rounded.peak == 12 * MiB
    assert rounded.peak_breakdown["activations"] == 0 and rounded.in_use == 12 * MiB


def test_cuda_terms_apply_to_cuda_devices_only() -> None:
    """A GPU preset (as a --budget or a --target) rounds and keeps cuBLAS's workspaces; the cpu, a wafer and a size
    do not. The planner's own peak stays the ledger's charges, equal on every device."""
    assert DeviceConfig(device="cpu", budget="h100-sxm").cuda_arch() == "sm90"
    assert DeviceConfig(device="cpu", budget="a100-80g").cuda_arch() == "sm80"
    assert DeviceConfig(device="cpu", budget="cs2").cuda_arch() == ""
    assert DeviceConfig(device="cpu", budget="64MiB").cuda_arch() == DeviceConfig().cuda_arch() == ""
    shape, cfg = GPTJConfig.preset("gptj-debug"), PlanConfig.of(batch=2, seq=48)
    on_gpu, on_wafer = plan(shape, device_spec("h100-sxm"), cfg), plan(shape, device_spec("cs2"), cfg)
    assert on_gpu.peak_device_bytes == on_wafer.peak_device_bytes == on_wafer.allocated_peak_bytes
    assert on_gpu.allocated_peak_bytes - on_gpu.peak_device_bytes >= workspace_bytes("sm90")
    assert on_gpu.allocated_peak_bytes - on_gpu.peak_device_bytes < workspace_bytes("sm90") + 5 * 512


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_step_on_a_simulated_gpu_charges_what_the_planner_allocates(dtype: str) -> None:
    """A cpu run with a GPU preset's budget: its ledger rounds every allocation and keeps the workspaces; the
    planner rounds each category's bytes at each moment (measured: 3,072 B below in bf16, 1,024 B in fp32)."""
    import torch

    from streamer import StreamingTrainer, TrainerConfig

    cfg = GPTJConfig.preset("gptj-debug")
    tc = TrainerConfig.of(dtype=dtype, budget="h100-sxm", update_chunk=20_000)
    with StreamingTrainer(cfg, tc) as trainer:
        trainer.step(torch.randint(0, cfg.vocab_size, (2, 48)))
        real = trainer.ledger.peak
    planned = plan(cfg, device_spec("h100-sxm"),
                   PlanConfig.of(batch=2, seq=48, compute_dtype=dtype, update_chunk=20_000))
    assert real - planned.peak_device_bytes > workspace_bytes("sm90")
    assert planned.allocated_peak_bytes == pytest.approx(real, abs=4096)


def test_a_budget_check_on_a_gpu_counts_cublas_workspaces() -> None:
    """`streamer train`'s check before set-up: a GPU preset whose memory leaves the planned step 1 MiB more than
    it charges, but not the 66 MiB of workspaces its ledger keeps, is refused in one line with a budget that fits."""
    from memory_model.planner import PLAN_MARGIN_BYTES
    from streamer.advice import check_fits, planned_peak
    from streamer.run import RunConfig, RunError

    settings = dict(model="gptj-debug", batch=2, seq=48, dtype="bf16")
    run = RunConfig.of(settings)
    peak = planned_peak(run.model_config(), run)
    h100 = device_spec("h100-sxm")
    reserve = h100.memory_bytes - (peak + PLAN_MARGIN_BYTES + MiB)
    tight = RunConfig.of({**settings, "budget": "h100-sxm", "set": (f"reserve_bytes={reserve}",)})
    with pytest.raises(RunError, match=r"--budget h100-sxm .* is too small.*--budget 6\dMiB"):
        check_fits(tight.model_config(), tight)
    roomy = RunConfig.of({**settings, "budget": "h100-sxm",
                          "set": (f"reserve_bytes={reserve - workspace_bytes('sm90')}",)})
    check_fits(roomy.model_config(), roomy)
