"""A training step as an ordered list of compute events: the runtime executes it, the planner prices it.

Each event names the resource it needs on the device (a unit's compute weights, or one chunk of a unit's
optimizer state). While event k runs, its resource and the next `prefetch` distinct resources are loaded or
in flight (`resident_sets`); after it, its resource is released unless the next event uses it too
(`released_after`: the head from its forward into its backward, the embedding from one micro-batch's
backward into the next one's forward). A resource released and needed again later is loaded again. Where
weights loads read the master (`Placement.loads_read_master`), a fused update's chunks take theirs from the
unit's last weights load (`StateChunk.master`, `loads_keeping_master`) instead of reading it a second time.
With the block inputs offloaded (`StepSpec.offload_inputs`) a block's events carry its input (`Event.stash`):
its forward sends it to host memory, and its backward's copy back is issued with the lookahead, like a
weights load, and held until that backward ends (`releases`).
streamer/runtime/executor.py, memory_model/planner.py, memory_model/timing.py and the dry run all walk
these lists, so the planner's peak and the runtime's ledger come from one schedule. What a resource costs
on the device while it is held (`resource_charges`) and what an update chunk writes there
(`update_charges`) are stated here once: the executor allocates exactly these on its ledger and the planner
adds up the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from layers.config import ModelConfig
from memory_model.lora import ADAPTER_GRAD_BYTES, ADAPTER_MOMENT_BYTES, ADAPTER_WEIGHT_BYTES
from memory_model.shapes import GRAD_ACCUM_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM, PlanConfig
from memory_model.step import StepConfig
from memory_model.units import stored_bytes


@dataclass(frozen=True)
class Weights:
    unit: str


@dataclass(frozen=True)
class StateChunk:
    unit: str
    start: int
    count: int
    last: bool  # the unit's final chunk: its new state version can be closed after it
    # False: the chunk's fp32 master is not loaded with its moments but taken from the unit's last weights load
    # (a fused update on a store whose weights loads read the master): one read serves backward and update.
    master: bool = True
    # False: the chunk's fp32 gradient is not loaded with its state but taken from the accumulator the backward's
    # fold left in host memory (a fused update), or from the backward's gradient itself (`updated_from_backward`);
    # a unit folded by chunk (`folded_by_chunk`) loads it otherwise.
    grad: bool = True


@dataclass(frozen=True)
class BlockInput:
    """A block's input of one micro-batch, kept in host memory between its forward and its backward."""

    unit: str
    micro: int


@dataclass(frozen=True)
class ExpertGroup:
    """One group of a block's experts (memory_model.step.StepConfig.expert_group_size), loaded inside the
    block's forward or backward and released before the next group loads: no event names it."""

    unit: str
    group: int


Resource = Weights | StateChunk | BlockInput | ExpertGroup


@dataclass(frozen=True)
class Event:
    phase: str  # "forward" | "backward" | "update" | "infer"
    resource: Resource
    micro: int = 0
    # Offloaded activations: a forward sends this block input to the host while it computes; a backward needs
    # it back on the device (a resource loaded ahead like weights, released after the backward).
    stash: BlockInput | None = None

    @property
    def unit(self) -> str:
        return self.resource.unit

    @property
    def chunk(self) -> StateChunk:
        """An update event's state chunk."""
        assert isinstance(self.resource, StateChunk), f"a {self.phase} event holds {self.resource}, not a chunk"
        return self.resource


@dataclass(frozen=True)
class Charge:
    """Device bytes of one ledger category, held for a while by one unit."""

    category: str  # one of memory_model.ledger.CATEGORIES
    nbytes: int
    what: str


def resource_charges(resource: Resource, unit_numel: int, dtype_bytes: int, update_on: str) -> tuple[Charge, ...]:
    """What a resource holds on the device from its load being issued until its release: a unit's compute
    weights, one chunk's master, moments and fp32 gradient (nothing when the update runs on the host), a group of
    a block's experts, or a block input (`unit_numel`: its elements) back from the host. The same charge holds an
    offloaded block input on the device during its forward, while it is copied out."""
    if isinstance(resource, Weights):
        return (Charge("weights", unit_numel * dtype_bytes, "compute weights"),)
    if isinstance(resource, BlockInput):
        return (Charge("activations", unit_numel * dtype_bytes, "offloaded block input"),)
    if isinstance(resource, ExpertGroup):
        return expert_charges(unit_numel, dtype_bytes)
    if update_on == "host":
        return ()
    return (Charge("optimizer", resource.count * OPTIMIZER_BYTES_PER_PARAM, "master, exp_avg, exp_avg_sq"),
            Charge("gradients", resource.count * GRAD_ACCUM_BYTES_PER_PARAM, "fp32 gradient"))


def expert_charges(numel: int, dtype_bytes: int) -> tuple[Charge, ...]:
    """A group of a block's experts on the device, loaded inside the block's forward or backward and released
    before the next group loads (memory_model.step.StepConfig.expert_group_size): `numel`, its parameters."""
    return (Charge("weights", numel * dtype_bytes, "an expert group's weights"),)


def gradient_charges(parts: Sequence[int], dtype_bytes: int, ranks: int, sharded: bool = False) -> tuple[Charge, ...]:
    """A unit's weight gradient on the device from its backward until its offload is finished; under data
    parallel also the flat fp32 copy the all-reduce sums (in fp32: a bf16 sum over ranks would round every
    partial sum). `parts`: the unit's device parameters by the state that holds them (`gathered_numel`). With
    the state sharded each part's copy is padded to equal slices and reduce-scattered into this rank's slice
    of the sum."""
    numel = sum(parts)
    charges: tuple[Charge, ...] = (Charge("gradients", numel * dtype_bytes, "weight gradient"),)
    if ranks > 1 and not sharded:
        charges += (Charge("gradients", numel * GRAD_ACCUM_BYTES_PER_PARAM, "fp32 gradient for the all-reduce"),)
    elif ranks > 1:
        charges += (Charge("gradients", gathered_numel(parts, ranks) * GRAD_ACCUM_BYTES_PER_PARAM,
                           "fp32 gradient for the reduce-scatter"),
                    Charge("gradients", sum(shard_numel(n, ranks) for n in parts) * GRAD_ACCUM_BYTES_PER_PARAM,
                           "this rank's slice of the summed gradient"))
    return charges


def update_charges(chunk: StateChunk, new_compute_bytes: int, update_on: str) -> tuple[Charge, ...]:
    """What an update chunk adds while it runs: its new compute-dtype weights, written on the device before
    they go back to the store (`new_compute_bytes` per parameter; 0 in fp32, where master is compute)."""
    if update_on == "host" or new_compute_bytes == 0:
        return ()
    return (Charge("weights", chunk.count * new_compute_bytes, "new compute weights"),)


def adapter_charges(adapter_numel: int) -> tuple[Charge, ...]:
    """LoRA's adapters, on the device for the whole run: fp32 weights, their gradient and AdamW moments."""
    return (Charge("weights", adapter_numel * ADAPTER_WEIGHT_BYTES, "LoRA adapters"),
            Charge("gradients", adapter_numel * ADAPTER_GRAD_BYTES, "LoRA adapter gradients"),
            Charge("optimizer", adapter_numel * ADAPTER_MOMENT_BYTES, "LoRA adapters' exp_avg, exp_avg_sq"))


def shard_numel(numel: int, shards: int) -> int:
    """Elements of a unit's flat state each of `shards` data-parallel processes stores and updates when the state
    is sharded: rank r owns [r * n, (r + 1) * n) of the unit padded with zeros to `shards * n` elements, so every
    rank's slice has one size (what an all-gather and a reduce-scatter of equal pieces need). The zero padding
    stays zero: its gradient is zero, so AdamW leaves it there."""
    return -(-numel // shards)


def gathered_numel(parts: Sequence[int], shards: int) -> int:
    """Elements of a unit's weights on the device when `shards` ranks each hold a slice of every unit's state:
    `parts`, the unit's device parameters by the state that holds them (`UnitParams.device_parts`: a tied
    head's are the embedding's and its own), each part's slices all-gathered, its padding included (their sum
    for one shard)."""
    return sum(shard_numel(n, shards) * shards for n in parts)


def chunks(numel: int, size: int) -> list[tuple[int, int]]:
    """(start, count) pieces of a slab, in file order: the update's chunks and the store's I/O pieces."""
    return [(s, min(size, numel - s)) for s in range(0, numel, size)]


@dataclass(frozen=True)
class StepSpec:
    """Everything one step's event list depends on. `step_spec` makes it from a model and its step settings,
    for the trainer (`StreamingTrainer.step_spec`), the planner and the calibration alike, and `step_events`
    turns it into the events: the runtime and the planner walk one list by construction.

    `numels`: the elements of each unit its update walks (with the state sharded, this process's slice,
    `shard_numel`); its forward and backward still see whole units. `fused`: each unit's update follows its
    backward in the last micro-batch (`memory_model.step.StepConfig.fused`). `frozen_base`: LoRA's step, whose
    streamed base has no update and whose embedding has no backward. `master_from_weights`
    (`Placement.loads_read_master`): a fused update takes each unit's master from its backward's weights load.
    `offload_inputs`: each block's input waits for its backward in host memory (`--activations offload`).
    `by_chunk`: the units whose gradient is folded a chunk at a time through its file (`folded_by_chunk`): a
    fused update loads their chunks' gradient and master as an update after the backward does, but for
    `from_backward`, those whose fused update takes each chunk of the gradient from the backward's own
    (`updated_from_backward`) and loads only the master.
    `backward=False`: evaluation, forwards only. `update_units`: the units updated (None: all; a step rolled
    forward after a crash updates the pending ones, with no micro-batches left to run).
    """

    units: tuple[str, ...]
    micro_batches: int
    numels: Mapping[str, int]
    chunk: int  # parameters per update chunk: the optimizer state on the device at once
    fused: bool = False
    frozen_base: bool = False
    master_from_weights: bool = False
    backward: bool = True
    update_units: tuple[str, ...] | None = None
    offload_inputs: bool = False
    by_chunk: frozenset[str] = frozenset()
    from_backward: frozenset[str] = frozenset()


# A unit is folded by chunk where it holds more than this many times the largest block's parameters.
BY_CHUNK_BLOCKS = 2


def folded_by_chunk(shape: ModelConfig, settings: StepConfig, shards: int = 1) -> frozenset[str]:
    """The units much larger than every block (a large vocabulary's embedding, an untied head: over
    `BY_CHUNK_BLOCKS` blocks) where the gradient accumulates in files: their gradient is folded through its file
    in blocks of the largest block's size, and their fused update loads each chunk's gradient and master from
    the store, so the host holds no fp32 copy of them (Llama-3.2-1B's tied embedding is 4.3 blocks: a GiB each
    for its accumulator and its master). A unit under that bound is held whole: that costs less than a block
    more, and reading its gradient and master back would cost disk time (GPT-J-6B's embedding is 1.03 blocks)."""
    if settings.store.grad.zero_copy:
        return frozenset()
    numels = {u: shard_numel(shape.params().own(u), shards) for u in shape.unit_names()}
    largest_block = max((n for u, n in numels.items() if u.startswith("block.")), default=0)
    return frozenset(u for u, n in numels.items() if largest_block and n > BY_CHUNK_BLOCKS * largest_block)


def updated_from_backward(shape: ModelConfig, settings: StepConfig, devices: int = 1) -> frozenset[str]:
    """The units folded by chunk (`folded_by_chunk`) whose fused update takes each chunk of its gradient from the
    backward's own, which stays on the device until the unit's last chunk, instead of folding it through the
    gradient file and reading it back: where one micro-batch makes the whole gradient (one of them, one process,
    no other unit's backward adding to it, as a tied head adds to its embedding's) and the update runs on the
    device. Llama-3.1-8B's embedding and head: 7.8 GiB less to write and read a step."""
    if settings.grad_accum != 1 or devices != 1 or settings.update_on == "host":
        return frozenset()
    return folded_by_chunk(shape, settings) - shape.params().lenders()


def step_spec(shape: ModelConfig, settings: StepConfig, compute_is_master: bool, devices: int = 1,
              frozen_base: bool = False, micro_batches: int | None = None, fused: bool | None = None,
              backward: bool = True, update_units: tuple[str, ...] | None = None) -> StepSpec:
    """The step `settings` make of `shape` on `devices` data-parallel devices: the one builder of a `StepSpec`.
    Each unit's update walks this device's slice of its state (`StepConfig.shards`). `compute_is_master`: the
    compute weights are in the master's dtype (memory_model.units.Precision.compute_is_master). By default the training
    step: `settings.grad_accum` micro-batches, fused where `StepConfig.fused` says; the trainer names its own
    (`micro_batches`, a speculative `fused`, an evaluation's `backward=False`, a roll-forward's `update_units`)."""
    units = tuple(shape.unit_names())
    shards = settings.shards(devices)
    # A block whose experts load in groups loads them apart from its weights: its update reads its own master.
    grouped = 0 < settings.expert_group_size < shape.params().experts()
    fused = settings.fused(devices, frozen_base) if fused is None else fused
    return StepSpec(units, settings.grad_accum if micro_batches is None else micro_batches,
                    {u: shard_numel(shape.params().own(u), shards) for u in units}, settings.update_chunk,
                    fused=fused, frozen_base=frozen_base,
                    master_from_weights=settings.store.loads_read_master(compute_is_master) and not grouped,
                    backward=backward, update_units=update_units, offload_inputs=settings.offloads_inputs,
                    by_chunk=folded_by_chunk(shape, settings, shards),
                    from_backward=updated_from_backward(shape, settings, devices) if fused else frozenset())


def norm_pass_spec(step: StepSpec) -> StepSpec:
    """A norm-first step's first pass: the forward and backward of `step` (a fused step of one micro-batch)
    with no update. Each unit's gradient is dropped once its squared norm is summed; nothing reaches the
    store. The clip coefficient is then known, and `step` itself runs clipped (memory_model.shapes.
    norm_first_allowed)."""
    return replace(step, fused=False, update_units=())


def step_events(step: StepSpec) -> list[Event]:
    """The ordered events of `step`: forward and backward of every micro-batch, and the update in chunks.

    After the backward (not fused): the update follows the whole backward, clipped by the global norm the
    backward has just summed. Fused: each unit's update follows its backward in the last micro-batch, as soon
    as its gradient is final, speculatively unclipped (the executor undoes and redoes a step whose clipping
    triggers). Under data parallel every device applies the whole update to its own copy of its state.
    """
    update_units = () if step.frozen_base or not step.backward else (
        step.units if step.update_units is None else step.update_units)
    backward_units = step.units[1:] if step.frozen_base else step.units

    def stash(unit: str, micro: int) -> BlockInput | None:
        offloaded = step.offload_inputs and step.backward and unit.startswith("block.")
        return BlockInput(unit, micro) if offloaded else None

    events: list[Event] = []
    for micro in range(step.micro_batches):
        events += [Event("forward", Weights(u), micro, stash(u, micro)) for u in step.units]
        if not step.backward:
            continue
        for u in reversed(backward_units):
            events.append(Event("backward", Weights(u), micro, stash(u, micro)))
            if step.fused and micro == step.micro_batches - 1 and u in update_units:
                by_chunk = u in step.by_chunk
                events += _update_events(step, [u], with_master=by_chunk or not step.master_from_weights,
                                         with_grad=by_chunk and u not in step.from_backward)
    if not step.fused:
        events += _update_events(step, update_units)
    return events


def _update_events(step: StepSpec, units: Sequence[str], with_master: bool = True,
                   with_grad: bool = True) -> list[Event]:
    events = []
    for unit in units:
        pieces = chunks(step.numels[unit], step.chunk)
        events += [Event("update", StateChunk(unit, start, count, i == len(pieces) - 1, with_master, with_grad))
                   for i, (start, count) in enumerate(pieces)]
    return events


def is_fused(events: list[Event]) -> bool:
    """Some update runs before a backward: the update is fused into the backward."""
    seen_update = False
    for event in events:
        seen_update |= event.phase == "update"
        if seen_update and event.phase == "backward":
            return True
    return False


def inference_events(units: list[str]) -> list[Event]:
    """Generation: each unit called by the caller's code (KV caches, sampling) with its streamed weights."""
    return [Event("infer", Weights(u)) for u in units]


def resident_sets(events: list[Event], prefetch: int) -> list[list[Resource]]:
    """What is loaded or in flight while each event runs: its own resource (and a backward's block input
    back from the host), then its lookahead.

    A fused update takes its gradient from the backward, not from the store, so its state chunks may be
    fetched while the backward still runs; the update after the backward, and a fused update of a unit folded by
    chunk, load the gradient with them."""
    loading = {e.unit for e in events if e.phase == "update" and e.chunk.grad}
    last_backward = {e.unit: k for k, e in enumerate(events) if e.phase == "backward" and e.unit in loading}
    leads = _leads(events) if prefetch >= 2 and is_fused(events) else [None] * len(events)
    return [[e.resource, *_fetched(e), *_lookahead(events, k, prefetch, last_backward, leads[k])]
            for k, e in enumerate(events)]


def fetched_input(event: Event) -> BlockInput | None:
    """The block input a backward needs back from the host (None for any other event)."""
    return event.stash if event.phase == "backward" else None


def _fetched(event: Event) -> tuple[BlockInput, ...]:
    fetched = fetched_input(event)
    return () if fetched is None else (fetched,)


def _lookahead(events: list[Event], index: int, depth: int, last_backward: dict[str, int],
               lead: Resource | None) -> list[Resource]:
    """The next `depth` distinct resources after event `index`'s own, in order of first use, each backward's
    block input after the weights it comes with (the inputs do not count towards `depth`).

    `lead` (`_leads`), where given, takes the first slot: in a fused step with two or more slots, the next
    backward's weights. The unit's update chunks, which come between, read and write its state, and the next
    unit's backward would otherwise wait for its weights behind them. With one slot, the update's own next chunk
    keeps it.

    A unit's optimizer state is not fetched while any of its backward events is still to run (its gradient
    is final only once the last micro-batch's backward has been offloaded), so the lookahead stops there.
    `last_backward` maps a unit to the index of its last backward event (empty when no load holds a gradient).
    A block input is not fetched before its forward has sent it to the host.
    """
    current = events[index].resource
    seen: list[Resource] = [] if lead is None else [lead]
    stashing = {events[index].stash}  # inputs whose forward is this event or still to come
    count = len(seen)
    for k in range(index + 1, len(events)):  # not a slice: that would copy the whole tail per event
        if count >= depth:
            break
        event = events[k]
        if isinstance(event.resource, StateChunk) and last_backward.get(event.unit, -1) >= index:
            break
        if event.resource != current and event.resource not in seen:
            seen.append(event.resource)
            count += 1
        if event.phase == "forward":
            stashing.add(event.stash)
        elif event.stash is not None and event.stash not in stashing:
            seen.append(event.stash)
    return seen


def _leads(events: list[Event]) -> list[Resource | None]:
    """For each event, the weights it loads first: for a backward or update event, the next backward's in the same
    backward pass (None past its last, and for any other event). A forward that runs straight into its own
    backward (the head's, at the turn) takes that backward's lead: what it fetches ahead is then what the backward
    holds, and no chunk it fetched is pushed out of the backward's window yet still held through it."""
    leads: list[Resource | None] = []
    upcoming: Resource | None = None  # the nearest backward's weights after the event, with no forward between
    following: Event | None = None
    for event in reversed(events):
        own = event.phase in ("backward", "update") and upcoming != event.resource
        turn = (event.phase == "forward" and following is not None and following.phase == "backward"
                and following.resource == event.resource)
        leads.append(leads[-1] if turn else upcoming if own else None)
        if event.phase == "backward":
            upcoming = event.resource
        elif event.phase == "forward":
            upcoming = None
        following = event
    return leads[::-1]


def released_after(events: list[Event], index: int) -> bool:
    """Event `index`'s resource leaves the device after it: the next event (if any) needs another."""
    return index + 1 == len(events) or events[index + 1].resource != events[index].resource


def releases(events: list[Event], index: int) -> tuple[Resource, ...]:
    """What leaves the device after event `index`: its resource (`released_after`), and a backward's block input."""
    own = (events[index].resource,) if released_after(events, index) else ()
    return own + _fetched(events[index])


def load_order(events: list[Event], prefetch: int) -> list[Resource]:
    """Every load a step issues, in order, as the executor issues them: a resource is loaded when it enters
    a resident set and is not on the device, and leaves after its last consecutive use."""
    loaded: set[Resource] = set()
    order: list[Resource] = []
    for index, resident in enumerate(resident_sets(events, prefetch)):
        for resource in resident:
            if resource not in loaded:
                loaded.add(resource)
                order.append(resource)
        loaded.difference_update(releases(events, index))
    return order


def kept_masters(events: list[Event], resident: list[list[Resource]]) -> list[frozenset[str]]:
    """Per event, the units whose fp32 master, kept from their last weights load (`loads_keeping_master`), is held:
    from the event issuing that load (`resident`: the events' `resident_sets`; the weights stay loaded from then
    into the unit's last backward) to the unit's last update chunk, which gives it back. With two or more slots
    ahead, the next backward's load, and its master, comes while this unit's update still holds its own."""
    spans: dict[str, list[int]] = {}
    for k, event in enumerate(events):
        if not isinstance(event.resource, StateChunk) or event.resource.master:
            continue
        if event.unit not in spans:
            start = max(j for j in range(k) if events[j].phase == "backward" and events[j].unit == event.unit)
            while start > 0 and Weights(event.unit) in resident[start - 1]:
                start -= 1
            spans[event.unit] = [start, k]
        spans[event.unit][1] = k
    return [frozenset(u for u, (first, last) in spans.items() if first <= k <= last) for k in range(len(events))]


def loads_keeping_master(events: list[Event], prefetch: int) -> list[bool]:
    """Per load of `load_order`: whether it is a weights load whose fp32 master the unit's update takes (a
    chunk with `master=False`): the unit's last weights load in the step, the one its last backward uses."""
    order = load_order(events, prefetch)
    borrowing = {e.unit for e in events if isinstance(e.resource, StateChunk) and not e.resource.master}
    last = {r.unit: k for k, r in enumerate(order) if isinstance(r, Weights) and r.unit in borrowing}
    return [last.get(r.unit) == k for k, r in enumerate(order)]


@dataclass(frozen=True)
class StoreBytes:
    """What a store's files move, per parameter: what a weights load reads (the master, which it casts to the
    compute dtype; 0 where the compute weights are in RAM), the master as stored and the dtype of the Adam
    moments (0 and None where the state is in RAM), and the fp32 gradient accumulator (0 where it is in RAM).
    An update writes the master and the moments; files keep no compute-dtype copy."""

    weights: int
    master: int
    moment_dtype: str | None
    grad: int = GRAD_ACCUM_BYTES_PER_PARAM

    def moments(self, count: int) -> int:
        """Both Adam moments of an update chunk of `count` parameters, as stored (a quantized dtype's scales too)."""
        return 0 if self.moment_dtype is None else 2 * stored_bytes(self.moment_dtype, count)


def store_bytes(cfg: PlanConfig) -> StoreBytes:
    """What the store's files move, each slab kind where `cfg.step.store` places it: a weights load reads the
    master and casts it where there is no compute copy in RAM (`Placement.loads_read_master`)."""
    store = cfg.step.store
    state = store.state.crosses_link
    return StoreBytes(weights=cfg.master_bytes if store.loads_read_master(cfg.compute_is_master) else 0,
                      master=cfg.master_bytes if state else 0, moment_dtype=cfg.precision.moments if state else None,
                      grad=GRAD_ACCUM_BYTES_PER_PARAM if store.grad.crosses_link else 0)


def load_disk_bytes(resource: Resource, numel: int, sizes: StoreBytes) -> int:
    """Bytes one load reads from the store's files: a unit's weights (or a group of a block's experts), or a
    chunk's moments with its fp32 master (unless taken from the weights load) and its fp32 gradient (unless taken
    from a fused backward's fold). A block input comes from host memory on either tier: none."""
    if isinstance(resource, BlockInput):
        return 0
    if isinstance(resource, (Weights, ExpertGroup)):
        return numel * sizes.weights
    master = sizes.master if resource.master else 0
    return resource.count * master + load_gradient_bytes(resource, sizes) + sizes.moments(resource.count)


def load_gradient_bytes(resource: Resource, sizes: StoreBytes) -> int:
    """The part of `load_disk_bytes` read from the gradient files: a state chunk's fp32 gradient, unless taken from
    a fused backward's fold."""
    return resource.count * sizes.grad if isinstance(resource, StateChunk) and resource.grad else 0


def disk_bytes(events: list[Event], prefetch: int, numels: dict[str, int], sizes: StoreBytes,
               micro_batches: int, borrowed: Mapping[str, Sequence[str]] | None = None,
               norm_pass: bool = False, reread: Mapping[str, int] | None = None) -> tuple[int, int]:
    """(read, written) bytes of a step on a store with files: exactly what they are asked for (the state
    files' trailers and the checksums' read-back from the page cache aside).

    Loads: `load_disk_bytes`. The gradient accumulator: the first micro-batch writes it, later ones read and
    write it, except that the last one of a fused step keeps it in memory for the update (but for a unit whose
    update loads it: folded by chunk, `folded_by_chunk`, unless `updated_from_backward`). Updates write the master
    and the moments, as stored. `borrowed`: the units whose weights a unit's load reads too and into whose
    accumulator its backward folds (a tied head: the embedding's), which it persists for their own backward.
    `norm_pass`: the events are a norm-first step's first pass (`norm_pass_spec`), which keeps the last
    micro-batch's gradient in memory as a fused step does, only to take its norm. `reread`: the weights each
    backward of a unit reads once more (a checkpointed block's experts loaded in groups: its recompute loads
    them, and its backward again).
    """
    borrowed = borrowed or {}
    owners = {owner for units in borrowed.values() for owner in units}
    fused = is_fused(events) or norm_pass
    # A fused update that loads its gradient (a unit folded by chunk) has it written by the last fold too.
    loaded = {e.unit for e in events if e.phase == "update" and e.chunk.grad}
    read = sum(load_disk_bytes(r, numels[r.unit] + sum(numels[o] for o in borrowed.get(r.unit, ())), sizes)
               for r in load_order(events, prefetch))
    written = 0
    for event in events:
        if event.phase == "backward":
            read += (reread or {}).get(event.unit, 0) * sizes.weights
            grad = numels[event.unit] * sizes.grad
            read += grad if event.micro > 0 or event.unit in owners else 0
            written += 0 if fused and event.micro == micro_batches - 1 and event.unit not in loaded else grad
            for owner in borrowed.get(event.unit, ()):
                shared = numels[owner] * sizes.grad
                read, written = read + (shared if event.micro > 0 else 0), written + shared
        elif event.phase == "update":
            written += event.chunk.count * sizes.master + sizes.moments(event.chunk.count)
    return read, written
