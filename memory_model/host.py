"""The host memory one process of a run holds at its peak, priced as the device's is: what `streamer plan` prints
beside device memory, and what `streamer train` checks against the machine's available RAM.

- `base`: the process itself (Python, torch, the tokenizer and data), measured once (`BASE_BYTES`);
- `store`: the RAM tier's slabs;
- `device`: where the device is the host (the cpu device), the device's own bytes at its planned peak: its
  buffers are host memory, and the runtime's pool of them keeps no more than the device has held at once
  (`streamer.runtime.transport.BufferPool`);
- `staging`: on an accelerator, the bounded pool of host buffers loads and offloads cross through
  (`staging_pool_bytes`; a frozen base's, `frozen_staging_bytes`);
- `fold`: disk-tier gradients, folded in host memory into one fp32 buffer of the largest unit folded whole (a
  unit over twice the largest block is folded through its file in blocks of that buffer, `folded_by_chunk`);
- `master`: where the device is the host, the fp32 masters fused updates take from their units' weights loads, each
  kept from its load's issue to the unit's last update chunk (the ledger charges the weights cast from it; an
  accelerator's is staged), as many as are held at once beside the device's bytes at their highest sum
  (`shared_peak`): with two slots ahead, the next backward's beside this unit's update. A unit folded by chunk
  loads each chunk's master with its state instead;
- `writes`: the state files' writes: the stages a file is written through (`STAGE_BYTES`, one filling and
  `STAGES_IN_FLIGHT` being written); a kind of one chunk's state in its stored form (a bf16 master, an int8
  moment) in the buffer each thread that reads, quantizes or casts it keeps (the read thread; the main thread,
  which narrows the units as the run starts; the write thread, where the update does not narrow them; on the RAM
  tier, the update's thread quantizing int8 moments); and the block a gradient file's checksum is read in
  (`CHECKSUM_BLOCK_BYTES`);
- `write_backs`: where the device is the host, the chunks whose write-back is still running after their release.
  Where a kind narrows (a bf16 master, int8 or bf16 moments), the update narrows each chunk's new state into a
  buffer of the write-back's own and lets go of its fp32 state and gradient at once: `write_lag` chunks of that
  state in its stored form (`narrowed_layout`). Else `prefetch` chunks of fp32 state and gradient, narrowed as
  they are written. Either outlives its update only where the write is slower than the next chunks' compute, so
  a run may stay below the plan by these bytes;
- `activations`: offloaded block inputs (`--activations offload`);
- `start`: the units stored a unit at a time as the run starts (`start_unit_bytes`), each chunk by chunk from its
  tensors as given: the largest unit as the start holds it (in `PlanConfig.source_dtype`: a fresh initialisation's
  fp32, an import's checkpoint dtype as saved, never widened), and what one chunk holds as it is written: a frozen
  base's (LoRA), one chunk of its slab and a 4-bit or 8-bit base's quantizer's working set on one chunk
  (layers.packed4's `QUANTIZE_CHUNK`, or its largest weight where smaller); a trained unit's (full fine-tuning),
  one chunk of its fp32 master, the moments' zeros and, where the store keeps a compute copy, the chunk cast to
  it. Less what a step holds and the start does not: the device's bytes and the staging pool (not the part of
  `base` a process adds once it steps, so a run may stay below the plan by these bytes). And a 4-bit or
  8-bit base's bitsandbytes: its modules and its kernels' first calls, measured once (`BITSANDBYTES_BYTES`);
- `compiled`: where a bf16 master is rounded off the CPU (on a GPU) in chunks that torch.compile compiles
  (`COMPILE_MIN_NUMEL`, streamer.compiled), the compiler's modules and kernels, measured once (`COMPILED_BYTES`).
  On the CPU, rounding and int8 moments' quantizing run in C++ of their own (streamer.native), which adds no
  compiler.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Sequence

from layers import ModelConfig
from layers.packed4 import QUANTIZE_BYTES_PER_ELEMENT, QUANTIZE_CHUNK, quantized_numels
from memory_model.ledger import CATEGORIES
from memory_model.lora import base_unit_bytes
from memory_model.schedule import Event, folded_by_chunk, shard_numel, updated_from_backward
from memory_model.shapes import (
    GRAD_ACCUM_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM, PlanConfig, offloaded_inputs_bytes,
)
from memory_model.tiers import Tier
from memory_model.step import StepConfig
from memory_model.units import DTYPE_BYTES, format_size, stored_bytes

# ru_maxrss of `streamer train` on a 2-layer Llama of hidden size 64 and 512 tokens (batch 1 x 128, 2 steps) on
# this project's box: 0.357 GiB on the RAM tier, 0.359 GiB on the disk tier; tests/test_host_memory.py
# measures it again beside each tier's run.
BASE_BYTES = 368 * 2**20
# A state file is written through page-aligned stages of this size, one filling while STAGES_IN_FLIGHT are written
# (streamer.store.direct).
STAGE_BYTES = 8 * 2**20
STAGES_IN_FLIGHT = 2
# A flushed file's checksum reads it back in blocks of this size (streamer.store.slabfile.file_checksum).
CHECKSUM_BLOCK_BYTES = 4 * 2**20
# Off the CPU, a bf16 master's stochastic rounding is compiled on its first call of at least this many elements
# (streamer.compiled); so are the CPU's kernels where their C++ cannot be built.
COMPILE_MIN_NUMEL = 2**20
# What compiling them adds to the process: the resident set of a process that has imported the trainer grew by
# 156 MiB once it had quantized, dequantized and rounded a chunk of COMPILE_MIN_NUMEL x 2 elements on this project's
# box (inductor's modules and the loaded kernels; the compiler itself runs in processes of its own).
COMPILED_BYTES = 160 * 2**20
# What a 4-bit or 8-bit base's bitsandbytes adds: the resident set of a process that had made a 16-bit LoRA step grew
# by 46 MiB once it had imported bitsandbytes, quantized a 1024 x 2048 weight and dequantized it, on this project's
# box; an import of a checkpoint of a few hundred thousand parameters peaked 52 MiB (4-bit) and 49 MiB (8-bit) above
# its 16-bit import (tests/test_host_memory.py's imports).
BITSANDBYTES_BYTES = 48 * 2**20
# The staging pool holds, at once, one unit's fp32 gradient on its way to the store and one unit's weights on
# their way to the device (two whole units; a third where loads read the fp32 master, for the master a fused
# update takes from its backward's load), plus a chunk of every state kind and the gradient, for the chunk
# being updated and the one loaded next.
STAGING_UNITS = 2
STAGING_CHUNK_SETS = 2
STAGED_KINDS = 4  # master, exp_avg, exp_avg_sq and the gradient


def staging_pool_bytes(largest: int, chunk: int, loads_read_master: bool) -> int:
    """The bound of an accelerator's pool of host staging buffers: `largest`, the elements of the largest unit a
    process stores; `chunk`, of an update chunk."""
    units = STAGING_UNITS + loads_read_master
    return 4 * (units * largest + STAGING_CHUNK_SETS * STAGED_KINDS * min(chunk, largest))


def frozen_staging_bytes(slab_bytes: Iterable[int]) -> int:
    """The staging pool of a frozen base (LoRA), given every unit's slab bytes as stored: only weights loads
    cross it (no gradient, master or moments does), each owner's slab into a buffer of its size. Loads run one at
    a time on the read thread, and each hands its buffer back as its copy starts; a load of a size already pooled
    waits for that copy and takes the same buffer. So the pool holds one buffer of each size."""
    return sum(set(slab_bytes))


def frozen_slab_bytes(shape: ModelConfig, cfg: PlanConfig, unit: str) -> int:
    """Bytes of a frozen base's unit slab as stored: a quantized base's packed slab, else its parameters in the
    compute dtype."""
    if cfg.lora.quantized:
        return base_unit_bytes(shape, cfg.lora, unit, cfg.dtype_bytes)
    return shard_numel(shape.params().own(unit), cfg.shards) * cfg.dtype_bytes


def start_unit_bytes(shape: ModelConfig, cfg: PlanConfig, unit: str) -> int:
    """What the start holds as it stores a unit (streamer.weights): its tensors as given (in `source_dtype`), and
    what one chunk holds as it is written. A frozen base's (`write_frozen`): one chunk of its slab, but for an
    embedding (one tensor) given in the compute dtype, written from its own storage; and where bitsandbytes
    quantizes its weights, the quantizer on one chunk. A trained unit's (`write_fresh_state`): one chunk of its
    fp32 master, but for an embedding given in fp32 and sliced whole, a view of it; the moments' zeros; and
    where the store keeps a compute copy, the chunk cast to the master's dtype, then to the compute dtype."""
    own = shape.params().own(unit)
    source = DTYPE_BYTES[cfg.source_dtype] * own
    if not cfg.lora.enabled:
        stored = shard_numel(own, cfg.shards)
        viewed = unit == "embed" and cfg.source_dtype == "fp32" and stored * cfg.shards == own
        narrowed = cfg.master_bytes if cfg.precision.master != "fp32" else 0
        cast = cfg.dtype_bytes if cfg.precision.compute != cfg.precision.master else 0
        compute = narrowed + cast if cfg.step.store.compute.zero_copy and not cfg.compute_is_master else 0
        return source + min(cfg.step.update_chunk, stored) * ((0 if viewed else 4) + 4 + compute)
    slab = base_unit_bytes(shape, cfg.lora, unit, cfg.dtype_bytes) if cfg.lora.quantized else own * cfg.dtype_bytes
    element = 1 if cfg.lora.quantized else cfg.dtype_bytes  # the slab's
    assembled = unit != "embed" or cfg.source_dtype != cfg.precision.compute
    bitsandbytes = cfg.lora.load_in_4bit or cfg.lora.load_in_8bit
    quantized = max(quantized_numels(shape, unit), default=0) if bitsandbytes else 0
    return source + (min(cfg.step.update_chunk * element, slab) if assembled else 0) \
        + QUANTIZE_BYTES_PER_ELEMENT * min(QUANTIZE_CHUNK, quantized)


# Each kind's stored piece of a narrowed chunk starts on this many bytes of its buffer: an int8 moment's records
# begin with fp32 scales.
NARROWED_ALIGN = 64


def narrows_write_backs(step: StepConfig, frozen: bool, same_memory: bool) -> bool:
    """The update narrows each chunk's new state to its stored form before its write-back (`write_backs` in the
    module's docstring): where a write-back can lag its update (the state on disk, trained, the device the host's
    memory, the update on it) and a kind of the state narrows."""
    narrows = step.precision.master != "fp32" or step.precision.moments != "fp32"
    return not step.store.state.zero_copy and not frozen and same_memory and step.update_on != "host" and narrows


def narrowed_layout(dtypes: Sequence[str], count: int) -> tuple[list[int], int]:
    """Where each kind's stored piece of a `count`-element chunk starts in its narrowed write-back's buffer (the
    kinds' dtypes in order), and the buffer's bytes."""
    starts, at = [], 0
    for dtype in dtypes:
        starts.append(at)
        at += -(-stored_bytes(dtype, count) // NARROWED_ALIGN) * NARROWED_ALIGN
    return starts, at


def narrowed_buffer_bytes(dtypes: Sequence[str], step: StepConfig, numels: Mapping[str, int]) -> int:
    """One narrowed write-back's buffer: the largest chunk's (`numels`: each unit's elements), so that a unit's
    last, shorter chunk takes a buffer the next full chunk can reuse and the pool holds `write_lag` of them."""
    return narrowed_layout(dtypes, min(step.update_chunk, max(numels.values(), default=0)))[1]


def write_lag(step: StepConfig) -> int:
    """Narrowed write-backs in flight at most: one more than the loads ahead, as many as a step holds unnarrowed
    (`prefetch`) and the one being narrowed. A lag of a whole block's chunks bought no speed on a CPU's disk tier
    (a Llama of d_model 2048 whose blocks have 15 chunks: the same median step within noise, and the same peak
    RSS, since the writes kept up), and the plan would price every chunk of it."""
    return step.prefetch + 1


@dataclass(frozen=True)
class HostBytes:
    """One process's host memory at its peak, by part (the module's docstring says what each holds)."""

    base: int
    store: int
    device: int
    staging: int
    fold: int
    master: int
    writes: int
    activations: int
    write_backs: int = 0
    start: int = 0
    compiled: int = 0

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def describe(self) -> str:
        return ", ".join(f"{name.replace('_', '-')} {format_size(n)}" for name, n in asdict(self).items() if n)


def store_kinds(shape: ModelConfig, cfg: PlanConfig) -> dict[str, tuple[Tier, int]]:
    """Each kind of one process's store: (its tier, its bytes). A frozen base (LoRA) is stored as its compute
    weights alone: no master, moments or gradient. Compute weights in the master's dtype are the master: no copy."""
    stored, store = shard_numel(shape.num_params(), cfg.shards), cfg.step.store
    frozen = cfg.lora.enabled
    compute_bytes = stored * (cfg.dtype_bytes if frozen or not cfg.compute_is_master else 0)
    kinds: dict[str, tuple[Tier, int]] = {"compute": (store.compute, compute_bytes)}
    if cfg.lora.quantized:  # each unit's packed slab
        kinds["compute"] = (store.compute, sum(base_unit_bytes(shape, cfg.lora, unit, cfg.dtype_bytes)
                                               for unit in shape.unit_names()))
    if not frozen:
        kinds.update(state=(store.state, stored * cfg.master_bytes + cfg.moment_bytes(stored)),
                     grad=(store.grad, stored * GRAD_ACCUM_BYTES_PER_PARAM))
    return kinds


def offloaded_bytes(shape: ModelConfig, cfg: PlanConfig) -> int:
    """Offloaded block inputs in host memory at most, per device: every block's input of one micro-batch."""
    return offloaded_inputs_bytes(shape, cfg.micro_batch, cfg.seq, cfg.dtype_bytes) if cfg.step.offloads_inputs else 0


@dataclass(frozen=True)
class SharedPeak:
    """Where the device is the host: at the moment their sum is highest, the device's bytes that are host memory
    of their own (`device`) and the fp32 masters fused updates keep from their units' weights loads (`master`)."""

    device: int
    master: int


def shared_peak(shape: ModelConfig, moments: Sequence[tuple[Event, tuple[int, ...]]], cfg: PlanConfig,
                masters: Sequence[frozenset[str]]) -> SharedPeak:
    """Each moment's device bytes less those that are the store's RAM slabs, handed to the compute as they lie
    where the device is the host: a weights load of the compute copy in RAM, an update's fp32 master and moments
    in RAM, and its gradient in the RAM accumulator, or in a fused step the one the fold left (priced apart:
    `fold`). What is read from a file, widened or dequantized takes buffers of its own. Beside them, the masters
    kept at that moment (`masters`, per event: memory_model.schedule.kept_masters); the highest sum."""
    store = cfg.step.store
    weights_lie = store.compute.zero_copy and not store.loads_read_master(cfg.compute_is_master)
    in_ram = store.state.zero_copy
    own_state = ((0 if in_ram and cfg.precision.master == "fp32" else 4)
                 + (0 if in_ram and cfg.precision.moments == "fp32" else 8))
    # A fused update's chunks of a unit that takes them from the backward's gradient are copies of their own.
    from_backward = updated_from_backward(shape, cfg.step, cfg.devices) if cfg.fused else frozenset()
    numels = {u: shard_numel(shape.params().own(u), cfg.shards) for u in shape.unit_names()}
    peak = SharedPeak(0, 0)
    for (event, nbytes), kept in zip(moments, masters, strict=True):
        held = dict(zip(CATEGORIES, nbytes, strict=True))
        if weights_lie:
            held["weights"] = 0
        if event.phase == "update":
            held["optimizer"] = held["optimizer"] * own_state // OPTIMIZER_BYTES_PER_PARAM
            if store.grad.zero_copy or (cfg.fused and not event.chunk.grad and event.unit not in from_backward):
                held["gradients"] = 0
        here = SharedPeak(sum(held.values()), sum(4 * numels[u] for u in kept))
        peak = max(peak, here, key=lambda p: p.device + p.master)
    return peak


def host_bytes(shape: ModelConfig, cfg: PlanConfig, shared: SharedPeak | None) -> HostBytes:
    """`shared`: where the device is the host, the device bytes and kept masters at their peak (`shared_peak`);
    None where the device has its own memory."""
    frozen, store, same_memory = cfg.lora.enabled, cfg.step.store, shared is not None
    store_ram = sum(nbytes for tier, nbytes in store_kinds(shape, cfg).values() if tier.zero_copy)
    numels = {u: shard_numel(shape.params().own(u), cfg.shards) for u in shape.unit_names()}
    largest = max(numels.values())
    # The largest unit whose fold is whole: larger ones go chunk by chunk.
    by_chunk = folded_by_chunk(shape, cfg.step, cfg.shards)
    whole = max(n for u, n in numels.items() if u not in by_chunk)
    chunk = min(cfg.step.update_chunk, largest)
    pool = frozen_staging_bytes(frozen_slab_bytes(shape, cfg, u) for u in shape.unit_names()) if frozen else \
        staging_pool_bytes(largest, chunk, store.loads_read_master(cfg.compute_is_master))
    state_on_disk = not store.state.zero_copy and not frozen
    # Kinds stored other than in fp32, one kind of a chunk at a time, in a buffer each thread keeps
    # (streamer.store.slabfile.Scratch): read into the read thread's and widened; narrowed into the main thread's
    # as the run starts, and into the write thread's as a step writes them, unless the update narrowed them
    # (`write_backs`). On the RAM tier, int8 moments are quantized into the update's thread's.
    narrowed = max(chunk * cfg.master_bytes if cfg.precision.master != "fp32" else 0,
                   cfg.moment_bytes(chunk) // 2 if cfg.precision.moments != "fp32" else 0) if state_on_disk else 0
    quantized = cfg.moment_bytes(chunk) // 2 if cfg.precision.moments != "fp32" and not frozen else 0
    narrows = narrows_write_backs(cfg.step, frozen, same_memory)
    # A weights load casts an fp32 master to the compute dtype as it reads it, a chunk at a time, through a buffer
    # of the transport's pool: one the update's state chunks reuse, held apart at most while a load runs.
    cast = 4 * chunk if state_on_disk and cfg.precision.master == "fp32" and not cfg.compute_is_master \
        and store.loads_read_master(cfg.compute_is_master) else 0
    scratch = (2 if narrows else 3) * narrowed + cast if state_on_disk else quantized
    # Gradient files are checksummed as they are flushed, read back in blocks into the checksum thread's buffer.
    checksummed = CHECKSUM_BLOCK_BYTES if store.grad.durable and not frozen else 0
    lags = state_on_disk and same_memory and cfg.step.update_on != "host"
    if narrows:
        lagging = write_lag(cfg.step) * narrowed_buffer_bytes(
            (cfg.precision.master, cfg.precision.moments, cfg.precision.moments), cfg.step, numels)
    else:  # the write narrows each kind as it writes it, into the write thread's buffer (`scratch`)
        lagging = cfg.step.prefetch * chunk * (OPTIMIZER_BYTES_PER_PARAM + GRAD_ACCUM_BYTES_PER_PARAM) if lags else 0
    staging = 0 if same_memory else pool
    # The start's units, where a step holds the device's bytes and the staging pool (empty until the first step's
    # loads take its buffers).
    held = 0 if shared is None else shared.device
    start = max(0, max(start_unit_bytes(shape, cfg, u) for u in shape.unit_names()) - held - staging) \
        + (BITSANDBYTES_BYTES if cfg.lora.load_in_4bit or cfg.lora.load_in_8bit else 0)
    return HostBytes(
        base=BASE_BYTES, store=store_ram, device=held,
        staging=staging,
        fold=whole * GRAD_ACCUM_BYTES_PER_PARAM if not store.grad.zero_copy and not frozen else 0,
        master=0 if shared is None else shared.master,
        writes=(STAGES_IN_FLIGHT + 1) * STAGE_BYTES + scratch + checksummed,
        activations=offloaded_bytes(shape, cfg), write_backs=lagging, start=start,
        compiled=COMPILED_BYTES if not frozen and chunk >= COMPILE_MIN_NUMEL and cfg.precision.master == "bf16"
        and not same_memory and cfg.step.update_on != "host" else 0)
