"""The host's side of a step on a CUDA device, tested on a CPU: staging copies split over threads, the I/O
threads' intra-op thread count (the gradient fold runs on one), and the planner's price of each host copy."""
from __future__ import annotations

import threading

import pytest
import torch

from streamer.runtime.transport import HostCopier, IOQueues, split_evenly, staging_threads


@pytest.mark.parametrize("n,parts", [(1000, 3), (2**20 + 7, 4), (64, 4), (5, 2)])
def test_split_evenly_covers_every_element_once(n, parts):
    bounds = split_evenly(n, parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == n and len(bounds) <= parts
    assert all(hi == lo for (_, hi), (lo, _) in zip(bounds, bounds[1:], strict=False))
    assert all(lo % 64 == 0 for lo, _ in bounds)


def test_a_split_copy_equals_torchs_and_runs_on_several_threads(monkeypatch):
    copier = HostCopier(3)
    src = torch.randn(3 * 2**20 + 5).to(torch.bfloat16)  # widened on the way, as a bf16 moment slab is
    dst = torch.empty(src.numel(), dtype=torch.float32)
    pieces: list[tuple[int, int, int]] = []  # (thread, offset into dst, elements) of each copy into dst
    real = torch.Tensor.copy_

    def watched(self, other, *args, **kwargs):
        offset = (self.data_ptr() - dst.data_ptr()) // 4
        if 0 <= offset < dst.numel():
            pieces.append((threading.get_ident(), offset, self.numel()))
        return real(self, other, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", watched)
    copier.copy_(dst, src)
    monkeypatch.undo()
    assert torch.equal(dst, src.float())
    expected = split_evenly(dst.numel(), 3)
    assert sorted((offset, offset + n) for _, offset, n in pieces) == expected
    assert any(thread != threading.get_ident() for thread, _, _ in pieces)  # the pool took some
    small = torch.arange(10.0)
    assert torch.equal(copier.copy_(torch.empty(10), small), small)  # below MIN_SPLIT_BYTES: one plain copy
    with pytest.raises(ValueError):
        copier.copy_(torch.empty(3), torch.empty(4))
    copier.close()


def test_staging_threads_by_cores():
    assert [staging_threads(c) for c in (1, 2, 7, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]


def test_the_io_threads_use_every_intra_op_thread():
    """The gradient fold (add_ into the fp32 accumulator) runs on the write thread on CUDA: its OpenMP team is
    the main thread's size, so it is spread over the host's cores; torch.set_num_threads reaches it too."""
    before = torch.get_num_threads()
    io = IOQueues(threaded=True, inline_fold=False)
    try:
        assert io.folds.submit(torch.get_num_threads).result() == before
        torch.set_num_threads(1)
        fresh = IOQueues(threaded=True, inline_fold=False)
        assert fresh.writes.submit(torch.get_num_threads).result() == 1
        fresh.close()
    finally:
        torch.set_num_threads(before)
        io.close()


# --- the planner's price of the host's copies ------------------------------------------------------------------------
def test_a_pageable_store_plan_pays_each_staging_copy_at_the_hosts_copy_rate():
    """A RAM-tier step on a GPU preset whose host copies slowly: staged (--pin-memory staging), each load's bytes
    are copied on the host before they cross, and the step takes at least those copies; registered, only the
    update's write-backs are copied (from their pinned buffer into the slabs)."""
    from dataclasses import replace

    from layers import PRESETS
    from memory_model import DEVICE_PRESETS, PlanConfig, plan
    from memory_model.devices import with_sets

    rate = 2e9
    device = with_sets(DEVICE_PRESETS["h100-sxm"], [f"host_copy_bw={rate}"])
    cfg = PlanConfig.of(batch=1, seq=2048, activations="checkpoint", moment_dtype="bf16")
    shape = PRESETS["gptj-1.3b"]
    registered = plan(shape, device, cfg, limits=False, pin_memory="register")
    pageable = plan(shape, device, cfg, limits=False, pin_memory="staging")
    assert pinned_all_equals(plan(shape, device, cfg, limits=False, pin_memory="all"), registered)
    staged = pageable.link_bytes["host_copy"] - registered.link_bytes["host_copy"]
    assert staged == pageable.link_bytes["h2d"]  # every load crosses from a RAM slab
    assert registered.link_bytes["host_copy"] == registered.link_bytes["d2h"] - gradient_bytes(shape, cfg)
    extra = pageable.resource_s["host copy"] - registered.resource_s["host copy"]
    assert extra == pytest.approx(staged / rate, rel=1e-12)
    assert pageable.step_time_s >= pageable.resource_s["host copy"] > registered.step_time_s
    assert pageable.step_time_s - registered.step_time_s >= 0.5 * extra
    # Where host and device share memory, or the device has no host copy rate, nothing is priced.
    unknown = replace(device, host_copy_bw=None)
    assert plan(shape, unknown, cfg, limits=False, pin_memory="staging").resource_s["host copy"] == 0.0


def pinned_all_equals(a, b) -> bool:
    return a.step_time_s == b.step_time_s and a.link_bytes == b.link_bytes


def gradient_bytes(shape, cfg) -> int:
    """The weight gradients a backward sends home: bf16, one per unit's device parameters."""
    return sum(shape.params().device(u) for u in shape.unit_names()) * cfg.dtype_bytes
