"""Will a run fit its device budget, and if not, which settings would: every alternative is re-planned.

The analytic planner (memory_model.planner) sizes a run's step before anything is built, so `streamer train`
refuses a run that cannot fit in seconds, and a DeviceOutOfMemory raised mid-step carries the same advice
(the trainer's ledger calls `ledger_advice` through its hints) rather than one sized from the failed allocation.
"""
from __future__ import annotations

from typing import Any, Callable

from layers import ModelConfig
from memory_model import DEVICE_PRESETS, PlanConfig, format_size, peak_device_bytes, plan
from memory_model.allocator import workspace_bytes
from memory_model.expert_groups import fewest_groups_within
from memory_model.host import HostBytes, host_bytes
from memory_model.ledger import round_up_size
from memory_model.planner import shared_peak_bytes
from streamer.config import TrainerConfig
from streamer.run import RunConfig, RunError

# The real step's ledger peak minus the planner's, measured on CPU (one step, budget off) for gptj-demo
# (2x64, 8x128) and a 2-layer d64 model (2x16, 4x64) over resident/checkpoint x device/host update x
# grad-accum 1/2 x fp32/bf16 (56 runs): equal in 50, 8 bytes over in 6 (grad-accum 2; ratio 1.000022 at most).
PLAN_MARGIN_BYTES = 1024


def planned_peak(model_cfg: ModelConfig, cfg: RunConfig, devices: int = 1) -> int:
    """The analytic planner's peak device bytes for one step of this run."""
    return peak_device_bytes(model_cfg, peak_plan_config(model_cfg, cfg, devices))


def planned_host(model_cfg: ModelConfig, cfg: RunConfig, devices: int = 1) -> HostBytes:
    """One process's planned peak host memory for this run, on its own device (`step_host`)."""
    return step_host(model_cfg, cfg.trainer, cfg.plan_config(devices))


def step_host(model_cfg: ModelConfig, tc: TrainerConfig, pc: PlanConfig) -> HostBytes:
    """One process's planned peak host memory for the step `pc` of a trainer with settings `tc`: where its device
    is the cpu, the device's bytes are the host's. With clipping on, the higher of the fused step and the
    after-backward one a step that clips is made again as (`peak_plan_config`)."""
    cpu = tc.device.device == "cpu"
    steps = [pc, pc.replace(update_timing="after-backward")] if pc.fused and tc.optimizer.max_grad_norm else [pc]
    return max((host_bytes(model_cfg, p, shared_peak_bytes(model_cfg, p) if cpu else None) for p in steps),
               key=lambda h: h.total)


def peak_plan_config(model_cfg: ModelConfig, cfg: RunConfig, devices: int = 1) -> PlanConfig:
    """The run's step as its peak is planned: a fused step that clipping would change is undone and made again
    after the backward or norm-first, so with clipping on it is whichever of the fused and the after-backward
    step peaks higher. A norm-first step is covered: its norm pass is the after-backward step's forward and
    backward (planner.norm_pass_peak), and its fused pass is the fused step."""
    pc = cfg.plan_config(devices)
    if not (pc.fused and cfg.trainer.optimizer.max_grad_norm):
        return pc
    return max((pc, pc.replace(update_timing="after-backward")), key=lambda p: peak_device_bytes(model_cfg, p))


def _needs(shape: ModelConfig, pc: PlanConfig, arch: str = "") -> int:
    """The budget a step needs: the planner's peak with the margin the real ledger was measured to need, and on a
    CUDA device (`arch`, DeviceConfig.cuda_arch) cuBLAS's workspaces, which its ledger charges for the run."""
    return peak_device_bytes(shape, pc) + PLAN_MARGIN_BYTES + workspace_bytes(arch)


def alternatives(shape: ModelConfig, pc: PlanConfig, budget: int, arch: str = "") -> list[str]:
    """Settings that fit `budget`, each re-planned: a larger budget first, then a grad-accum split that keeps
    the batch, checkpointed activations (or offloaded, where checkpointed do not fit), the host update, the
    update after the backward, a mixture's experts in groups. Only those that fit are listed."""
    out = [f"--budget {round_up_size(_needs(shape, pc, arch))}"]
    per_device = pc.batch // pc.devices
    for k in range(pc.step.grad_accum + 1, per_device + 1):
        if per_device % k == 0 and _needs(shape, pc.replace(grad_accum=k), arch) <= budget:
            out.append(f"--grad-accum {k} (micro-batches of {per_device // k}, the batch of {pc.batch} kept)")
            break
    if pc.step.activations == "resident" and _needs(shape, pc.replace(activations="checkpoint"), arch) <= budget:
        out.append("--activations checkpoint")
    elif pc.step.activations != "offload" and _needs(shape, pc.replace(activations="offload"), arch) <= budget:
        out.append("--activations offload")
    if pc.step.update_on == "device" and _needs(shape, pc.replace(update_on="host"), arch) <= budget:
        out.append("--update-on host")
    # A fused update holds a unit's optimizer state while later units' activations are still on the device.
    if pc.fused and _needs(shape, pc.replace(update_timing="after-backward"), arch) <= budget:
        out.append("--update-timing after-backward")
    fitting = _fewest_expert_groups(shape, pc, budget, arch)
    if fitting is not None:
        out.append(f"--expert-group-size {fitting} (the fewest groups of experts that fit)")
    return out


def _fewest_expert_groups(shape: ModelConfig, pc: PlanConfig, budget: int, arch: str = "") -> int | None:
    """The most experts a block can load at once below what `pc` loads (one process, full fine-tuning) for the
    step to fit `budget`, or None."""
    fitting = fewest_groups_within(shape, pc, budget, lambda trial: _needs(shape, trial, arch))
    now = pc.step.expert_group_size or shape.params().experts()
    return fitting if fitting is not None and (fitting or shape.params().experts()) < now else None


def fit_expert_groups(model_cfg: ModelConfig, cfg: RunConfig, devices: int = 1) -> tuple[RunConfig, str | None]:
    """The run with --expert-group-size 0 (auto) and whole blocks over its --budget: its experts in the fewest
    groups that fit, and a line saying so; else the run as it is and None."""
    budget, arch = cfg.budget_bytes(), cfg.trainer.device.cuda_arch()
    if budget is None or cfg.trainer.step.expert_group_size:
        return cfg, None
    pc = peak_plan_config(model_cfg, cfg, devices)
    whole = _needs(model_cfg, pc, arch)
    if whole <= budget:
        return cfg, None
    size = _fewest_expert_groups(model_cfg, pc, budget, arch)
    if size is None:
        return cfg, None  # nothing fits: check_fits says why
    grouped = cfg.replace(expert_group_size=size)
    return grouped, (f"experts in groups of {size}: whole blocks need "
                     f"{format_size(whole)} of the {format_size(budget)} --budget; grouped, "
                     f"{format_size(_needs(model_cfg, peak_plan_config(model_cfg, grouped, devices), arch))} "
                     "(--expert-group-size sets it)")


def _breakdown(shape: ModelConfig, pc: PlanConfig) -> str:
    """The planned peak by category, e.g. `57.1 MiB (weights 6 MiB, activations 40 MiB, ...)`."""
    planned = plan(shape, next(iter(DEVICE_PRESETS.values())), pc)  # any device: only bytes are read
    parts = ", ".join(f"{c} {format_size(b)}" for c, b in planned.peak_breakdown.items() if b)
    return f"{format_size(planned.peak_device_bytes)} ({parts})"


def check_fits(model_cfg: ModelConfig, cfg: RunConfig, devices: int = 1) -> None:
    """RunError (one line: the planned peak by category and the alternatives that fit) when the run's step
    cannot fit its --budget; nothing when there is no budget or it fits."""
    budget, arch = cfg.budget_bytes(), cfg.trainer.device.cuda_arch()
    pc = peak_plan_config(model_cfg, cfg, devices)
    if budget is None or _needs(model_cfg, pc, arch) <= budget:
        return
    raise RunError(f"--budget {cfg.trainer.device.budget} ({format_size(budget)}) is too small: a step needs "
                   f"{_breakdown(model_cfg, pc)} by the planner. To fit, one of: "
                   f"{'; or '.join(alternatives(model_cfg, pc, budget, arch))}")


def ledger_advice(model_cfg: ModelConfig, cfg: RunConfig, devices: int = 1
                  ) -> Callable[[dict[str, int], int, dict[str, Any]], list[str]]:
    """For the ledger's hints (`advise`): a DeviceOutOfMemory mid-step names the planner's alternatives."""
    pc, arch = peak_plan_config(model_cfg, cfg, devices), cfg.trainer.device.cuda_arch()

    def advise(needed: dict[str, int], capacity: int, hints: dict[str, Any]) -> list[str]:
        return [f"the planner puts a step's peak at {_breakdown(model_cfg, pc)}; one of "
                + "; or ".join(alternatives(model_cfg, pc, capacity, arch))]

    return advise
