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
from memory_model.host import HostBytes, host_bytes
from memory_model.ledger import round_up_size
from memory_model.planner import fewest_groups_within, made_as, shared_peak_bytes, step_needs
from memory_model.rollout import generation_fixes, generation_peak
from streamer.config import TrainerConfig
from streamer.run import RunConfig, RunError


def planned_peak(model_cfg: ModelConfig, cfg: RunConfig, devices: int = 1) -> int:
    """The analytic planner's peak device bytes for one step of this run."""
    return peak_device_bytes(model_cfg, peak_plan_config(model_cfg, cfg, devices))


def planned_host(model_cfg: ModelConfig, cfg: RunConfig, devices: int = 1) -> HostBytes:
    """One process's planned peak host memory for this run, on its own device (`step_host`)."""
    return step_host(model_cfg, cfg.trainer, cfg.plan_config(devices))


def step_host(model_cfg: ModelConfig, tc: TrainerConfig, pc: PlanConfig) -> HostBytes:
    """One process's planned peak host memory for the step `pc` of a trainer with settings `tc`: where its device
    is the cpu, the device's bytes are the host's. With clipping on, the higher of the fused step and the
    after-backward one a step that clips is made again as (`planner.made_as`)."""
    cpu = tc.device.device == "cpu"
    steps = made_as(pc, tc.optimizer.max_grad_norm > 0)
    return max((host_bytes(model_cfg, p, shared_peak_bytes(model_cfg, p) if cpu else None) for p in steps),
               key=lambda h: h.total)


def peak_plan_config(model_cfg: ModelConfig, cfg: RunConfig, devices: int = 1) -> PlanConfig:
    """The run's step as its peak is planned: of the steps it makes (`planner.made_as`: with clipping on, a fused
    step and the after-backward step it is made again as), the one that peaks higher."""
    return max(made_as(cfg.plan_config(devices), _clips(cfg)), key=lambda p: peak_device_bytes(model_cfg, p))


def _clips(cfg: RunConfig) -> bool:
    return cfg.trainer.optimizer.max_grad_norm > 0


def alternatives(shape: ModelConfig, pc: PlanConfig, budget: int, arch: str = "") -> list[str]:
    """Settings that fit `budget`, each re-planned: a larger budget first, then a grad-accum split that keeps
    the batch, checkpointed activations (or offloaded, where checkpointed do not fit), the host update, the
    update after the backward, a mixture's experts in groups. Only those that fit are listed."""
    def fits(trial: PlanConfig) -> bool:
        return step_needs(shape, trial, arch) <= budget

    out = [f"--budget {round_up_size(step_needs(shape, pc, arch))}"]
    per_device = pc.batch // pc.devices
    for k in range(pc.step.grad_accum + 1, per_device + 1):
        if per_device % k == 0 and fits(pc.replace(grad_accum=k)):
            out.append(f"--grad-accum {k} (micro-batches of {per_device // k}, the batch of {pc.batch} kept)")
            break
    if pc.step.activations == "resident" and fits(pc.replace(activations="checkpoint")):
        out.append("--activations checkpoint")
    elif pc.step.activations != "offload" and fits(pc.replace(activations="offload")):
        out.append("--activations offload")
    if pc.step.update_on == "device" and fits(pc.replace(update_on="host")):
        out.append("--update-on host")
    # A fused update holds a unit's optimizer state while later units' activations are still on the device.
    if pc.fused and fits(pc.replace(update_timing="after-backward")):
        out.append("--update-timing after-backward")
    fitting = _fewest_expert_groups(shape, pc, budget, arch)
    if fitting is not None:
        out.append(f"--expert-group-size {fitting} (the fewest groups of experts that fit)")
    return out


def _fewest_expert_groups(shape: ModelConfig, pc: PlanConfig, budget: int, arch: str = "",
                          clips: bool = False) -> int | None:
    """The most experts a block can load at once below what `pc` loads (one process, full fine-tuning) for the
    step to fit `budget` (`planner.fewest_groups_within`, `streamer plan`'s search), or None."""
    fitting = fewest_groups_within(shape, pc, budget, arch, clips)
    now = pc.step.expert_group_size or shape.params().experts()
    return fitting if fitting is not None and (fitting or shape.params().experts()) < now else None


def fit_expert_groups(model_cfg: ModelConfig, cfg: RunConfig, devices: int = 1) -> tuple[RunConfig, str | None]:
    """The run with --expert-group-size 0 (auto) and whole blocks over its --budget: its experts in the fewest
    groups that fit, and a line saying so; else the run as it is and None."""
    budget, arch = cfg.budget_bytes(), cfg.trainer.device.cuda_arch()
    if budget is None or cfg.trainer.step.expert_group_size:
        return cfg, None
    pc, clips = cfg.plan_config(devices), _clips(cfg)
    whole = step_needs(model_cfg, pc, arch, clips)
    if whole <= budget:
        return cfg, None
    size = _fewest_expert_groups(model_cfg, pc, budget, arch, clips)
    if size is None:
        return cfg, None  # nothing fits: check_fits says why
    grouped = cfg.replace(expert_group_size=size)
    return grouped, (f"experts in groups of {size}: whole blocks need "
                     f"{format_size(whole)} of the {format_size(budget)} --budget; grouped, "
                     f"{format_size(step_needs(model_cfg, grouped.plan_config(devices), arch, clips))} "
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
    if budget is None:
        return
    pc = peak_plan_config(model_cfg, cfg, devices)
    if step_needs(model_cfg, cfg.plan_config(devices), arch, _clips(cfg)) <= budget:
        if pc.objective.grpo:
            _check_generation_fits(model_cfg, cfg, pc, budget, arch)
        return
    raise RunError(f"--budget {cfg.trainer.device.budget} ({format_size(budget)}) is too small: a step needs "
                   f"{_breakdown(model_cfg, pc)} by the planner. To fit, one of: "
                   f"{'; or '.join(alternatives(model_cfg, pc, budget, arch))}")


def _check_generation_fits(shape: ModelConfig, cfg: RunConfig, pc: PlanConfig, budget: int, arch: str) -> None:
    """RunError (one line: the planned peak and the settings that fit) when GRPO's rollout cannot generate within
    --budget even with its units streamed in each pass."""
    def needs(trial: PlanConfig) -> int:  # (the ledger charges a generation as planned, to the byte)
        return generation_peak(shape, trial) + workspace_bytes(arch)

    def fits(trial: PlanConfig) -> bool:  # the step of the changed settings too
        return needs(trial) <= budget and step_needs(shape, trial, arch) <= budget
    need = needs(pc)
    if need <= budget:
        return
    objective = pc.objective
    fixes = [f"--budget {round_up_size(need)}", *generation_fixes(shape, pc, fits)]
    raise RunError(f"--budget {cfg.trainer.device.budget} ({format_size(budget)}) is too small for a GRPO rollout: "
                   f"generating a prompt's {objective.num_generations} completions (a KV cache of --seq {pc.seq} "
                   f"positions) needs {format_size(need)} by the planner, with the units streamed in each pass. To "
                   f"fit, one of: {'; or '.join(fixes)}")


def ledger_advice(model_cfg: ModelConfig, cfg: RunConfig, devices: int = 1
                  ) -> Callable[[dict[str, int], int, dict[str, Any]], list[str]]:
    """For the ledger's hints (`advise`): a DeviceOutOfMemory mid-step names the planner's alternatives."""
    pc, arch = peak_plan_config(model_cfg, cfg, devices), cfg.trainer.device.cuda_arch()

    def advise(needed: dict[str, int], capacity: int, hints: dict[str, Any]) -> list[str]:
        return [f"the planner puts a step's peak at {_breakdown(model_cfg, pc)}; one of "
                + "; or ".join(alternatives(model_cfg, pc, capacity, arch))]

    return advise
