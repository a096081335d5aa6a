"""The time and device peak of GRPO's rollout (`rollout_plan`), by the step's own timing model: the passes
streamer.grpo.GRPOLoop.rollout makes, each priced as a forward-only step; the device bytes as the ledger charges
them during generation: the KV cache beside each pass's weights and hidden state. Its decode passes stream every
unit, or keep them resident where they fit beside the cache (`resident_decode`) (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from layers.config import ModelConfig
from memory_model.allocator import workspace_bytes
from memory_model.devices import DeviceSpec
from memory_model.ledger import CATEGORIES
from memory_model.lora import dequantized_bytes
from memory_model.planner import loaded_bytes, planned_spec
from memory_model.schedule import Resource, Weights, inference_events, resident_sets, step_events
from memory_model.shapes import PlanConfig, block_input_numel
from memory_model.units import format_size
from memory_model.timing import simulate


@dataclass(frozen=True)
class Generation:
    """A prompt's generation with its units streamed in each pass, or resident from their first load: the seconds
    of the rollout's decode passes; the device peak (a prefill pass, the KV cache at full length) and its makeup;
    a decode pass's peak."""

    decode_s: float
    peak_bytes: int
    peak_breakdown: dict[str, int]
    decode_peak_bytes: int


@dataclass(frozen=True)
class RolloutPlan:
    """GRPO's rollout of one step as the runtime makes it (streamer.grpo.GRPOLoop.rollout), in seconds: for each
    prompt the prefill of its num_generations rows, then one pass per further completion token (streamer.generate:
    the KV cache stays on the device); then the forward passes over the step's rows that score the old policy
    (num_iterations > 1) and the reference (beta > 0). A decode pass is priced at one position: its attention over
    the cache is left out, small beside a pass's weight loads.

    Both ways of decoding are priced: `streamed` loads every unit in each pass, as in training; `resident` keeps
    the units the prefill loaded to the end of the prompt's generation, each later pass its units' compute or, where
    longer, the read of their weights from device memory (a pass at one position is bound by it). The runtime
    decodes resident where that peak fits the device (`resident_decode`); `decode_s`, `peak_bytes` and `total_s`
    are that choice's. The scoring passes are forward-only steps over the step's rows, within the step's peak."""

    prompt_tokens: int
    prefill_s: float
    scoring_s: float
    kv_cache_bytes: int
    streamed: Generation
    resident: Generation
    chose_resident: bool
    does_not_fit: str | None  # why no prompt's generation fits the device, even streamed, and what would

    @property
    def chosen(self) -> Generation:
        return self.resident if self.chose_resident else self.streamed

    @property
    def decode_s(self) -> float:
        return self.chosen.decode_s

    @property
    def peak_bytes(self) -> int:
        return self.chosen.peak_bytes

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

    def forward(rows: int, seq: int, micro_batches: int = 1) -> tuple[float, float]:
        """A pass of `rows` rows of `seq` tokens in `micro_batches`, forward only, nothing updated or committed:
        its seconds, and its units' compute seconds alone (the pass with every unit already on the device)."""
        passing = cfg.replace(batch=rows, seq=seq, grad_accum=micro_batches)
        events = step_events(replace(planned_spec(shape, passing, update=False), backward=False))
        timeline = simulate(events, resident_sets(events, passing.step.prefetch), shape, passing, device,
                            commits=False)
        return timeline.end_s, sum(t.forward_s for t in timeline.per_unit.values())
    # A resident decode pass reads every unit's weights from device memory once: at one position a row its
    # matmuls are bound by that read rather than by their FLOPs.
    weights = loaded_bytes(shape, cfg, [Weights(u) for u in shape.unit_names()], group, 1)["weights"] \
        - loaded_bytes(shape, cfg, [], group, 1)["weights"]
    read_s = weights / (device.device_mem_bandwidth * device.bandwidth_efficiency)
    groups, decodes = cfg.batch // group, objective.max_completion_length - 1
    scorings = (objective.num_iterations > 1) + (objective.beta > 0)
    cache = kv_cache_bytes(shape, group, cfg.seq, cfg.dtype_bytes)
    streamed_s, compute_s = forward(group, 1)
    ways = {}
    for resident, decode_s in ((False, streamed_s), (True, max(compute_s, read_s))):
        prefill = max(generation_moments(shape, cfg, group, prompt, cache, resident), key=sum)
        decode = max(generation_moments(shape, cfg, group, 1, cache, resident, kept=resident), key=sum)
        ways[resident] = Generation(groups * decodes * decode_s, sum(prefill), dict(zip(CATEGORIES, prefill,
                                                                                     strict=True)), sum(decode))
    room = device.memory_bytes - device.reserve_bytes - workspace_bytes(device.cuda_arch)
    why = None
    if ways[False].peak_bytes > room:
        fixes = generation_fixes(shape, cfg, lambda trial: generation_peak(shape, trial) <= room)
        why = (f"a prompt's generation needs {format_size(ways[False].peak_bytes)} with its units streamed, over the "
               f"{format_size(room)} {device.name} leaves to tensors; to fit: "
               + ", or ".join([*fixes, "a --target with more memory"]))
    return RolloutPlan(prompt, groups * forward(group, prompt)[0], scorings * forward(cfg.batch, cfg.seq,
                                                                                      cfg.step.grad_accum)[0],
                       cache, ways[False], ways[True], resident_decode(shape, cfg, group, prompt, cfg.seq, room), why)


def generation_peak(shape: ModelConfig, cfg: PlanConfig) -> int:
    """The least device bytes a prompt's generation in GRPO's rollout of `cfg` takes: its num_generations rows,
    the longest prompt (--seq less --max-completion-length) and its KV cache at --seq, the units streamed in each
    pass (the prefill's peak, the highest)."""
    objective = cfg.objective
    rows, prompt = objective.num_generations, cfg.seq - objective.max_completion_length
    cache = kv_cache_bytes(shape, rows, cfg.seq, cfg.dtype_bytes)
    return max(sum(m) for m in generation_moments(shape, cfg, rows, prompt, cache))


def generation_fixes(shape: ModelConfig, cfg: PlanConfig, fits: Callable[[PlanConfig], bool]) -> list[str]:
    """The settings with which a prompt's generation `fits` (each re-planned): the longest --seq (the KV cache
    holds its positions), the most --num-generations that divide --batch, a shallower --prefetch, a 4-bit base."""
    objective, out = cfg.objective, []
    low, high = objective.max_completion_length, cfg.seq  # the longest that fits, by bisection: the peak grows
    while high - low > 1:                                   # with --seq
        middle = (low + high) // 2
        low, high = (middle, high) if fits(cfg.replace(seq=middle)) else (low, middle)
    if low > objective.max_completion_length:
        out.append(f"--seq {low} (the KV cache holds --seq positions: the longest prompt and "
                   f"--max-completion-length {objective.max_completion_length})")
    fewer = [g for g in range(2, objective.num_generations) if not cfg.batch % g
             and fits(replace(cfg, objective=replace(objective, num_generations=g)))]
    if fewer:
        out.append(f"--num-generations {fewer[-1]} (fewer rows a prompt)")
    shallower = [p for p in range(cfg.step.prefetch) if fits(cfg.replace(prefetch=p))]
    if shallower:
        out.append(f"--prefetch {shallower[-1]}")
    if not cfg.lora.quantized:
        four_bit = replace(cfg.lora, rank=cfg.lora.rank or 16, load_in_4bit=True)
        if fits(cfg.replace(lora=four_bit)):
            out.append("--load-in-4bit" if cfg.lora.enabled else "--lora-rank 16 --load-in-4bit (QLoRA)")
    return out


def resident_decode(shape: ModelConfig, cfg: PlanConfig, rows: int, prompt: int, positions: int,
                    capacity: int | None) -> bool:
    """Whether a prompt's generation (`rows` rows, `prompt` tokens, a KV cache of `positions`) keeps its units on
    the device: where their weights, the cache and the prefill's hidden state fit `capacity` (None: no limit)."""
    if capacity is None:
        return True
    cache = kv_cache_bytes(shape, rows, positions, cfg.dtype_bytes)
    return max(sum(m) for m in generation_moments(shape, cfg, rows, prompt, cache, resident=True)) <= capacity


def kv_cache_bytes(shape: ModelConfig, rows: int, positions: int, dtype_bytes: int) -> int:
    """streamer.generate's KV cache: for every block, keys and values of (rows, key/value heads, positions,
    head_dim) in the compute dtype, allocated at the sequence's full length before the first pass."""
    per_block = 2 * rows * shape.num_key_value_heads * positions * shape.head_dim * dtype_bytes
    return shape.num_hidden_layers * per_block


def generation_moments(shape: ModelConfig, cfg: PlanConfig, rows: int, tokens: int, cache_bytes: int,
                       resident: bool = False, kept: bool = False) -> list[tuple[int, ...]]:
    """Device bytes by category (CATEGORIES order) at each unit of one generation pass over `tokens` new positions
    of `rows` rows (the prefill: the prompt; a decode pass: 1), as the ledger charges them: the units loaded or in
    flight (the pass's own prefetch; `resident`: also every unit before, none released; `kept`: every unit, left
    by the passes before), LoRA's adapters, the KV cache (activations), the pass's hidden state (workspace, from
    the embedding on) and a quantized base's dequantized weight (workspace, in its blocks)."""
    events = inference_events(shape.unit_names())
    hidden = block_input_numel(shape, rows, tokens) * cfg.dtype_bytes
    moments = []
    for index, own in enumerate(resident_sets(events, cfg.step.prefetch)):
        before: list[Resource] = [Weights(u) for u in shape.unit_names()] if kept else \
            [e.resource for e in events[:index]] if resident else []
        at = loaded_bytes(shape, cfg, list(dict.fromkeys([*before, *own])), rows, tokens)
        at["activations"] += cache_bytes
        # (a quantized base's block: the weight each matmul dequantizes, as in a step's forward)
        at["workspace"] += hidden + dequantized_bytes(shape, cfg.lora, events[index].unit, cfg.dtype_bytes)
        moments.append(tuple(at[c] for c in CATEGORIES))
    return moments
