"""The time of GRPO's rollout (`rollout_plan`), by the step's own timing model: the passes
streamer.grpo.GRPOLoop.rollout makes, each priced as a forward-only step (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from layers.config import ModelConfig
from memory_model.devices import DeviceSpec
from memory_model.planner import planned_spec
from memory_model.schedule import resident_sets, step_events
from memory_model.shapes import PlanConfig
from memory_model.timing import simulate


@dataclass(frozen=True)
class RolloutPlan:
    """GRPO's rollout of one step as the runtime makes it (streamer.grpo.GRPOLoop.rollout), in seconds: for each
    prompt the prefill of its num_generations rows, then one pass per further completion token, every unit
    streamed in each pass as in training (streamer.generate: the KV cache stays on the device, the weights do
    not); then the forward passes over the step's rows that score the old policy (num_iterations > 1) and the
    reference (beta > 0). A decode pass is priced at one position: its attention over the cache is left out, small
    beside a pass's weight loads."""

    prompt_tokens: int
    prefill_s: float
    decode_s: float
    scoring_s: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s + self.scoring_s


def rollout_plan(shape: ModelConfig, device: DeviceSpec, cfg: PlanConfig) -> RolloutPlan:
    """The rollout of a GRPO step of `cfg` (`cfg.batch` completions, groups of num_generations, prompts of the
    longest `cfg.seq - max_completion_length` tokens) on `device`, by the step's own timing model."""
    objective = cfg.objective
    group, prompt = objective.num_generations, cfg.seq - objective.max_completion_length
    if not objective.grpo or prompt < 1 or cfg.batch % group:
        raise ValueError(f"a GRPO rollout needs --method grpo, a --batch of whole groups of {group} and a --seq "
                         f"longer than --max-completion-length {objective.max_completion_length}")

    def forward_s(rows: int, seq: int, micro_batches: int = 1) -> float:
        """A pass of `rows` rows of `seq` tokens in `micro_batches`, forward only, nothing updated or committed."""
        passing = cfg.replace(batch=rows, seq=seq, grad_accum=micro_batches)
        events = step_events(replace(planned_spec(shape, passing, update=False), backward=False))
        return simulate(events, resident_sets(events, passing.step.prefetch), shape, passing, device,
                        commits=False).end_s
    groups = cfg.batch // group
    scorings = (objective.num_iterations > 1) + (objective.beta > 0)
    return RolloutPlan(prompt, groups * forward_s(group, prompt),
                       groups * (objective.max_completion_length - 1) * forward_s(group, 1),
                       scorings * forward_s(cfg.batch, cfg.seq, cfg.step.grad_accum))
