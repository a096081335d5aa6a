"""Data-parallel weak scaling as planned: a step's tokens/s on 1, 2, 4, ... devices, each with the same
micro-batches, from the plan of each (memory_model/planner.py)."""
from __future__ import annotations

from layers.config import ModelConfig
from memory_model.devices import DeviceSpec
from memory_model.planner import plan
from memory_model.shapes import PlanConfig

# What a scaling curve means: Cerebras measures its CS-3 clusters the same way (catalogue.PUBLISHED_RUNS).
SCALING_ASSUMPTION = ("weak scaling: each device keeps its own micro-batches, so n devices train an n times "
                      "larger global batch; efficiency = tokens/s on n / (n x tokens/s on 1)")


def scaling_curve(shape: ModelConfig, device: DeviceSpec, cfg: PlanConfig) -> list[dict[str, float]]:
    """Tokens/s on 1, 2, 4, ... up to cfg.devices devices, each with cfg's micro-batches (SCALING_ASSUMPTION)."""
    per_device = cfg.batch // cfg.devices
    counts = sorted({n for n in (2**k for k in range(cfg.devices.bit_length())) if n <= cfg.devices} | {cfg.devices})
    # One schedule for every point: `auto` fuses the update of one device on the disk tier, never of several.
    timing = "after-backward" if cfg.step.update_timing == "auto" and cfg.devices > 1 else cfg.step.update_timing
    rows = [(n, plan(shape, device, cfg.replace(devices=n, batch=per_device * n, update_timing=timing),
                     limits=False)) for n in counts]
    one = rows[0][1].tokens_per_s
    return [{"devices": n, "step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s,
             "efficiency": p.tokens_per_s / (n * one)} for n, p in rows]
