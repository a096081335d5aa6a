"""A mixture-of-experts block whose experts load in groups (`StepConfig.expert_group_size`), as the planner prices
it and the runtime charges it: the block's weights resource holds all but its experts (attention, norms, router),
and its forward and its backward each load the experts a group at a time, inside the block's event, releasing
each group before the next loads. A group's weight gradient is offloaded as a unit's is: made while the group is
on the device, on its way to the host while the next group's backward runs. What each moment adds to the block's
event is stated here; memory_model/planner.py adds it to the event's resident set, activations and workspace.
Torch-free.
"""
from __future__ import annotations

from layers.config import ModelConfig
from memory_model.schedule import Charge, expert_charges, gradient_charges
from memory_model.settings import SettingError
from memory_model.shapes import PlanConfig


def expert_group(shape: ModelConfig, cfg: PlanConfig) -> int:
    """The experts each block of `shape` has on the device at once under `cfg` where it loads them in groups; 0
    where its blocks load whole (a dense MLP, or `expert_group_size` 0 or all the experts)."""
    return checked_group(shape, cfg.step.expert_group_size, cfg.lora.enabled, cfg.devices)


def checked_group(shape: ModelConfig, size: int, lora: bool, devices: int) -> int:
    """`expert_group` of --expert-group-size `size`, checked: a divisor of the experts, for full fine-tuning (not
    `lora`) on one device (a group's gradient is not all-reduced)."""
    experts = shape.params().experts()
    if size in (0, experts):
        return 0
    if not experts:
        raise SettingError("expert_group_size", f"is for a mixture of experts; this model's MLP is dense (use 0), "
                                                f"not {size}")
    if experts % size:
        divisors = ", ".join(str(g) for g in range(1, experts + 1) if experts % g == 0)
        raise SettingError("expert_group_size", f"must divide a block's {experts} experts ({divisors}), not {size}")
    if lora or devices > 1:
        raise SettingError("expert_group_size", "is for full fine-tuning on one process: not with LoRA or data "
                                                "parallel; use 0")
    return size


def group_sizes(shape: ModelConfig, cfg: PlanConfig) -> list[int]:
    """The sizes `cfg`'s step may load a block's experts in, largest (all of them: whole blocks) first: the
    divisors of its experts, for full fine-tuning on one device (`checked_group`); none for a dense model."""
    experts = shape.params().experts()
    if not experts or cfg.lora.enabled or cfg.devices > 1:
        return []
    return [g for g in range(experts, 0, -1) if experts % g == 0]


def grouped(shape: ModelConfig, cfg: PlanConfig, unit: str) -> bool:
    """Whether `unit` is a block whose experts load in groups."""
    return unit.startswith("block.") and expert_group(shape, cfg) > 0


def grouped_block_numel(shape: ModelConfig, group: int) -> int:
    """A block's parameters its weights load holds where its experts load `group` at a time: all but the
    experts; the whole block where `group` is 0."""
    params = shape.params()
    return params.block() - (params.experts() * params.expert() if group else 0)


def reloaded(shape: ModelConfig, cfg: PlanConfig) -> dict[str, int]:
    """The weights each unit's backward loads once more than its forward: a checkpointed grouped block's experts
    (its recompute loads them, and its backward again)."""
    params = shape.params()
    experts = params.experts() * params.expert()
    return {u: experts for u in shape.unit_names() if cfg.step.recomputes and grouped(shape, cfg, u)}


def last_gradient(shape: ModelConfig, cfg: PlanConfig, unit: str) -> tuple[Charge, ...]:
    """The last weight gradient a unit's backward offloads: its whole one, or a grouped block's all but its
    experts' (made after every group's, when its attention's backward is done)."""
    parts = ([grouped_block_numel(shape, expert_group(shape, cfg))] if grouped(shape, cfg, unit)
             else shape.params().device_parts(unit))
    return gradient_charges(parts, cfg.dtype_bytes, cfg.devices, cfg.shards > 1)


def _total(charges: tuple[Charge, ...]) -> int:
    return sum(c.nbytes for c in charges)


def forward_moment(shape: ModelConfig, cfg: PlanConfig, batch: int, seq: int) -> tuple[tuple[Charge, ...], int]:
    """A grouped block's forward at its highest moment, as (charges added, activations not yet saved then): its
    last group on the device, before the experts' outputs are recombined (what that saves is not saved yet), or
    the forward's end (nothing), whichever holds more. A forward that saves nothing (recomputed in the
    backward) holds the most with a group on the device."""
    group = expert_charges(expert_group(shape, cfg) * shape.params().expert(), cfg.dtype_bytes)
    later = 0 if cfg.step.recomputes else batch * seq * shape.costs().experts_saved_after_per_token(cfg.dtype_bytes)
    return (group, later) if _total(group) > later else ((), 0)


def backward_moment(shape: ModelConfig, cfg: PlanConfig, previous: tuple[Charge, ...]) -> tuple[Charge, ...]:
    """What a grouped block's backward adds at its highest moment, of the three where a weight gradient appears.
    The backward loads the groups in reverse: the first one's gradient appears with the previous unit's last
    gradient (`previous`) still on its way to the host, each later one's with the group before's, and that of
    all but the experts, last, with the last group's (no group on the device then). A checkpointed block's
    recompute loads the groups once more before these, holding less: a group and no gradient of its own."""
    size = expert_group(shape, cfg) * shape.params().expert()
    group = expert_charges(size, cfg.dtype_bytes)
    grad = gradient_charges([size], cfg.dtype_bytes, cfg.devices)
    rest = gradient_charges([grouped_block_numel(shape, expert_group(shape, cfg))], cfg.dtype_bytes, cfg.devices)
    return max((group + grad + previous, group + grad + grad, rest + grad), key=_total)
