"""`streamer calibrate --device cuda`'s measurements, run on the cpu: the same code with a device argument."""
from __future__ import annotations

import pytest
import torch

from memory_model import DEVICE_PRESETS
from memory_model.devices import with_sets
from streamer.errors import StreamerError
from streamer.calibration.calibrate_device import ProbeSizes, calibrate_device, preset_for, set_flags

TINY = ProbeSizes(matmul_n=128, attention_heads=2, attention_seq=64, head_dim=32, copy_bytes=2**20,
                  update_params=2**16, repeats=1)
MEASURED = {"matmul_efficiency", "attention_efficiency", "h2d_bytes_per_s", "d2h_bytes_per_s", "host_update_bw"}


def test_a_preset_calibrated_on_the_cpu_is_measured_and_replays_through_set():
    spec = calibrate_device(torch.device("cpu"), "h100-sxm", "fp32", TINY)
    preset = DEVICE_PRESETS["h100-sxm"]
    assert {n for n, f in spec.figures.items() if f.basis == "measured"} == MEASURED
    assert all(spec.figures[n].source for n in MEASURED)
    # A cpu reaches a sliver of an H100's peak; the fractions are shares, never above 1.
    assert 0 < spec.matmul_efficiency < 0.1 and 0 < spec.attention_efficiency < 0.1
    # The planner's achieved link rate is the measured one.
    measured_h2d = float(spec.figures["h2d_bytes_per_s"].source.split(": ")[1].split(" GB/s")[0]) * 1e9
    assert spec.h2d.bandwidth_bytes_per_s * spec.bandwidth_efficiency == pytest.approx(measured_h2d, rel=1e-3)
    assert spec.flops == preset.flops and spec.memory_bytes == preset.memory_bytes  # the datasheet's stay
    # The printed --set flags give back the same figures in plan and train.
    flags = set_flags(spec).split()
    replayed = with_sets(preset, [item for item in flags if item != "--set"])
    assert replayed.matmul_efficiency == pytest.approx(spec.matmul_efficiency, rel=1e-5)
    assert replayed.host_update_bw == pytest.approx(spec.host_update_bw, rel=1e-5)


@pytest.mark.parametrize("name,preset", [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
                                         ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA H200", "h200"),
                                         ("NVIDIA A100-SXM4-40GB", "a100-40g"), ("NVIDIA A100-SXM4-80GB", "a100-80g"),
                                         ("NVIDIA GeForce RTX 4090", "rtx4090")])
def test_a_gpu_is_measured_against_its_own_preset(name, preset):
    assert preset_for(name) == preset


def test_an_unknown_gpu_names_the_target_flag():
    with pytest.raises(StreamerError, match="--target"):
        preset_for("Tesla T4")
