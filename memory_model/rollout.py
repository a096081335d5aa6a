"""The time and device peak of GRPO's rollout (`rollout_plan`), by the step's own timing model: the passes
streamer.grpo.GRPOLoop.rollout makes, each priced as a forward-only step; the device bytes as the ledger charges
them during generation: the KV cache beside each pass's streamed weights and hidden state (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from layers.config import ModelConfig
from memory_model.devices import DeviceSpec
from memory_model.ledger import CATEGORIES
from memory_model.planner import loaded_bytes, planned_spec
from memory_model.schedule import inference_events, resident_sets, step_events
from memory_model.shapes import block_input_numel
from memory_model.shapes import PlanConfig
from memory_model.timing import simulate


@dataclass(frozen=True)
class RolloutPlan:
    """GRPO's rollout of one step as the runtime makes it (streamer.grpo.GRPOLoop.rollout), in seconds: for each
    prompt the prefill of its num_generations rows, then one pass per further completion token, every unit
    streamed in each pass as in training (streamer.generate: the KV cache stays on the device, the weights do
    not); then the forward passes over the step's rows that score the old policy (num_iterations > 1) and the
    reference (beta > 0). A decode pass is priced at one position: its attention over the cache is left out, small
    beside a pass's weight loads.

    The device peak of generation (`generation_moments`): the KV cache of a prompt's rows at its longest, with a
    prefill pass's loaded units and hidden state; a decode pass holds the same but one position of hidden state.
    The scoring passes are forward-only steps over the step's rows, within the step's own peak (`plan`)."""

    prompt_tokens: int
    prefill_s: float
    decode_s: float
    scoring_s: float
    kv_cache_bytes: int
    peak_bytes: int
    peak_breakdown: dict[str, int]
    decode_peak_bytes: int

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
    cache = kv_cache_bytes(shape, group, cfg.seq, cfg.dtype_bytes)
    prefill = max(generation_moments(shape, cfg, group, prompt, cache), key=sum)
    decode = max(generation_moments(shape, cfg, group, 1, cache), key=sum)
    return RolloutPlan(prompt, groups * forward_s(group, prompt),
                       groups * (objective.max_completion_length - 1) * forward_s(group, 1),
                       scorings * forward_s(cfg.batch, cfg.seq, cfg.step.grad_accum), cache, sum(prefill),
                       dict(zip(CATEGORIES, prefill, strict=True)), sum(decode))


def kv_cache_bytes(shape: ModelConfig, rows: int, positions: int, dtype_bytes: int) -> int:
    """streamer.generate's KV cache: for every block, keys and values of (rows, key/value heads, positions,
    head_dim) in the compute dtype, allocated at the sequence's full length before the first pass."""
    per_block = 2 * rows * shape.num_key_value_heads * positions * shape.head_dim * dtype_bytes
    return shape.num_hidden_layers * per_block


def generation_moments(shape: ModelConfig, cfg: PlanConfig, rows: int, tokens: int,
                       cache_bytes: int) -> list[tuple[int, ...]]:
    """Device bytes by category (CATEGORIES order) at each unit of one generation pass over `tokens` new positions
    of `rows` rows (the prefill: the prompt; a decode pass: 1), as the ledger charges them: the units loaded or in
    flight (the pass's own prefetch), LoRA's adapters, the KV cache (activations) and the pass's hidden state
    (workspace, from the embedding on)."""
    events = inference_events(shape.unit_names())
    hidden = block_input_numel(shape, rows, tokens) * cfg.dtype_bytes
    moments = []
    for resident in resident_sets(events, cfg.step.prefetch):
        at = loaded_bytes(shape, cfg, resident, rows, tokens)
        at["activations"] += cache_bytes
        at["workspace"] += hidden
        moments.append(tuple(at[c] for c in CATEGORIES))
    return moments
