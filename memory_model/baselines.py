"""Model-state memory of the usual alternatives to weight streaming, by their own published formulas.

Model states only (weights, gradients, optimizer state): activations come on top in every row, as in the
plan. Psi = parameters, N = data-parallel ranks, L = the largest unit's parameters (DeepSpeed's estimators
take the largest single module; for GPT-J that is the head or a block, which are within 3% of each other).
"""
from __future__ import annotations

from dataclasses import dataclass

from layers.config import ModelConfig


@dataclass(frozen=True)
class Baseline:
    name: str
    device_bytes: int  # per GPU
    host_bytes: int  # CPU RAM per node
    nvme_bytes: int
    formula: str
    source: str


def baselines(shape: ModelConfig, ranks: int, compute_bytes: int = 2) -> list[Baseline]:
    psi, n = shape.num_params(), ranks
    largest = max(shape.params().own(u) for u in shape.unit_names())
    zero_paper = "Rajbhandari et al., ZeRO (arXiv 1910.02054), sec. 3.1 and 5"
    return [
        Baseline("data parallel, mixed precision", 16 * psi, 0, 0, "(2 + 2 + 12) Psi",
                 f"{zero_paper}: fp16 weights and gradients, fp32 master, momentum, variance = 16 Psi"),
        Baseline("ZeRO-3", 16 * psi // n, 0, 0, "(2 + 2 + 12) Psi / N", f"{zero_paper}: P_os+g+p"),
        Baseline("ZeRO-Offload (ZeRO-2, CPU optimizer)", 2 * psi, int(1.5 * psi * max(4 * n, 16)), 0,
                 "GPU 2 Psi; CPU 1.5 max(4 N, 16) Psi",
                 "Ren et al., ZeRO-Offload (arXiv 2101.06840); DeepSpeed estimate_zero2_model_states_mem_needs "
                 "(cpu_offload=True, additional_buffer_factor=1.5)"),
        Baseline("ZeRO-3 CPU offload (params + optimizer)", 4 * largest, int(1.5 * 18 * psi), 0,
                 "GPU 4 L; CPU 1.5 x 18 Psi",
                 "DeepSpeed estimate_zero3_model_states_mem_needs (cpu_offload, cpu_offload_params, zero_init)"),
        Baseline("ZeRO-Infinity NVMe offload", 4 * largest, 0, 16 * psi, "GPU 4 L; NVMe 16 Psi",
                 "Rajbhandari et al., ZeRO-Infinity (arXiv 2104.07857): all model states on NVMe; GPU as ZeRO-3 "
                 "offload (derived: the 16 Psi of model states moved to NVMe)"),
        Baseline("FSDP CPU offload", 2 * compute_bytes * largest + compute_bytes * largest, 16 * psi, 0,
                 "GPU 2 L weights (current + prefetched unit) + L gradient; CPU 16 Psi (fp32 params, grads, Adam)",
                 "PyTorch FSDP docs, CPUOffload(offload_params=True): 'parameters and gradients' offloaded to CPU; "
                 "one unit is unsharded while it computes, BackwardPrefetch gathers the next (derived)"),
    ]
