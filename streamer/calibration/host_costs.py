"""What the runtime costs the host beyond the kernels: a fixed cost per compute event and per step, on each
store tier, the copying of each disk-tier byte through the page cache, each state file an update writes, and
each flush a commit makes beyond those of the measured disk-tier step.

Fixed costs. The kernel costs (memory_model/kernels.py) scale with tokens, widths and parameters; besides
them every event pays for the executor's hand-offs (the load's future, the ledger, the trace's span),
autograd's bookkeeping and the dispatch of each of its small kernels. On a model as small as the demo's
that is much of a step. It is measured on the runtime itself: steps of two models of the planned model's
family too small for their kernels to take measurable time (d_model 32, 8 tokens), one and five blocks deep
(each family's block runs its own number of small kernels). Their difference, over the difference in their
events, is the cost of an event. What the shallow one takes outside its events' spans, before the first and
after the last, is the step's own (the commit, the bookkeeping of a step). Both are measured on the RAM tier
and on the disk tier, whose events also read and write the store's files and whose commit makes them
durable: the disk tier's fixed costs hold its fused step's manifest and its flushes. The state files are not
among them: the planner books each one itself (below).

Page cache. A disk-tier byte is written into the page cache and read back from it (or from the disk into
it) by the host's cores; on a cpu device those are the cores that compute, so the planner charges that
time to the compute. It is timed as a buffered write (before its fsync) and a read of the cached pages.

State files. A disk-tier update writes each unit's new state file on the write worker, and seals it after the
unit's last chunk: it is opened, flushed, its trailer written and flushed, renamed and its folder flushed
(`streamer.store.files.GenerationWriter`). That costs the same whatever the file's size. It is timed on the
deep tiny model's own steps: the span of each unit's last write-back, less its bytes at the disk's write
rate. The planner books it on the disk's queue, where it overlaps the compute or, when write-backs follow
each other faster than they finish, makes them wait.

Flushes. A commit makes each file durable: a record is written, flushed, renamed and its folder flushed
(`streamer.store.slabfile.write_json_atomic`). Each flush waits for the disk whatever the file's size: the
disk's latency. The disk tier's fixed costs hold the flushes of the step they measure (a fused update);
a journaled step flushes more (its gradient files and its journal), priced per flush
(`memory_model.timing.unmeasured_flushes`). It is timed as a record's sequence on a one-page file.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from layers.config import ModelConfig
from memory_model.schedule import step_events
from streamer.config import TrainerConfig
from memory_model.tiers import DISK, RAM, TIERS, Tier
from streamer.store.host import HostStore
from streamer.store.layout import dtype_name
from streamer.trainer import StreamingTrainer

_DEPTHS = (1, 5)
_TOKENS = 8


@dataclass(frozen=True)
class HostCosts:
    event_s: float  # per forward, backward or update event, RAM tier
    step_s: float  # per optimizer step, besides its events, RAM tier
    disk_event_s: float  # the same on the disk tier, its fused step's flushes included
    disk_step_s: float
    page_cache_bytes_per_s: float  # a disk-tier byte through the page cache
    flush_s: float  # per flush of a commit beyond the measured disk-tier step's
    state_file_s: float  # per state file a disk-tier update writes, besides its bytes


def measure_host_costs(directory: Path, shape: ModelConfig, dtype: torch.dtype, disk_bytes: int, repeats: int,
                       write_bytes_per_s: float) -> HostCosts:
    """Every cost of the module doc, the fixed ones on tiny models of `shape`'s family; the disk's probes and the
    disk-tier steps write their files in `directory`, whose state files are written at `write_bytes_per_s`."""
    fixed = measure_fixed_costs(shape, dtype, directory, write_bytes_per_s)
    return HostCosts(*fixed[RAM][:2], *fixed[DISK][:2], measure_page_cache(directory, disk_bytes, repeats),
                     measure_flush(directory, repeats), fixed[DISK][2])


def _tiny(shape: ModelConfig, layers: int) -> ModelConfig:
    """`shape`'s family and its variations (grouped-query attention, MLP ratio) at d_model 32, two 16-wide query
    heads (sharing one key/value head where `shape`'s share), rotary over the whole head."""
    shared = shape.num_key_value_heads < shape.num_attention_heads
    return shape.resized(vocab_size=64, max_position_embeddings=_TOKENS, hidden_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1 if shared else 2, head_dim=16, rotary_dim=16,
                         intermediate_size=max(1, shape.intermediate_size * 32 // shape.hidden_size))


def measure_fixed_costs(shape: ModelConfig, dtype: torch.dtype, directory: Path, write_bytes_per_s: float,
                        steps: int = 21) -> dict[Tier, tuple[float, float, float]]:
    """Per store tier, the event's and the step's fixed seconds and a state file's, from the shallow and the deep
    tiny model (module doc). The disk tier's stores are written in `directory`, on the disk the runs use, at
    `write_bytes_per_s`."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="calibrate-events-", dir=directory) as tmp:
        return {tier: _fixed_costs(shape, dtype, tier, Path(tmp) / tier, steps, write_bytes_per_s)
                for tier in TIERS.values()}


def _fixed_costs(shape: ModelConfig, dtype: torch.dtype, tier: Tier, directory: Path, steps: int,
                 write_bytes_per_s: float) -> tuple[float, float, float]:
    """One tier's fixed costs. The two models' steps alternate, after two warm-up steps each, so that a change
    in the machine's load weighs on both alike: `event_s` is the median of the paired differences over the
    difference in events. Run one after the other under a changing load (2 cores, load average 7-9), it came
    out from 0 to 0.13 s, against 0.6 ms on the quiet machine. Each tier on its own: a disk-tier step's
    background work (old state files removed, checksums) would otherwise fall into a RAM-tier step's time. No
    clipping: every disk-tier step is the fused one, never undone. Seven pairs of gptj-debug's tiny models put the
    disk tier's event cost anywhere in a range half its median wide over five calibrations; 21 pairs, within 4%."""
    torch_state = torch.random.get_rng_state()
    try:
        with contextlib.ExitStack() as stack:
            tc = TrainerConfig.of(dtype=dtype_name(dtype), store=tier, max_grad_norm=0)
            trainers = [stack.enter_context(StreamingTrainer(_tiny(shape, n), tc, store_dir=directory / str(n)))
                        for n in _DEPTHS]
            ids = torch.randint(0, _tiny(shape, 1).vocab_size, (1, _TOKENS), generator=torch.Generator().manual_seed(0))
            times: list[list[float]] = [[], []]
            for i in range(2 + steps):
                for trainer, seconds in zip(trainers, times, strict=True):
                    start = time.perf_counter()
                    trainer.step(ids)
                    if i >= 2:
                        seconds.append(time.perf_counter() - start)
            events = [len(step_events(t.step_spec(1, t.fused))) for t in trainers]
            step_s = _outside_spans_s(trainers[0], times[0])
            file_s = _state_file_s(trainers[-1], write_bytes_per_s) if tier.crosses_link else 0.0
    finally:
        torch.random.set_rng_state(torch_state)
    (shallow, deep), (shallow_events, deep_events) = times, events
    # Timing noise can make the deeper model no slower: an event then costs nothing measurable.
    slower = statistics.median(d - s for s, d in zip(shallow, deep, strict=True))
    event_s = max(0.0, slower / (deep_events - shallow_events))
    return event_s, step_s, file_s


def _outside_spans_s(trainer: StreamingTrainer, seconds: list[float]) -> float:
    """The step's own seconds: the median, over the timed steps the trainer's trace kept (`seconds`, the last
    ones), of each step's time outside its spans, before the first and after the last (the step's bookkeeping,
    the commit). Its events' own costs, the loss between them and its last write-back are inside."""
    kept = trainer.trace.steps()[-len(seconds):]
    outside = [wall - (end - start) for wall, (start, end) in
               zip(seconds[-len(kept):], (trainer.trace.time_range(step) for step in kept), strict=True)]
    return max(0.0, statistics.median(outside))


def _state_file_s(trainer: StreamingTrainer, write_bytes_per_s: float) -> float:
    """A state file's seconds beyond its bytes: the median, over the steps the trainer's trace kept, of each
    unit's last write-back span (its last chunk's, which seals the file) less the file's bytes at
    `write_bytes_per_s`. A fused step's last span of a unit on the write worker is that write-back: its
    gradient's offload comes before its update."""
    store = trainer.store
    assert isinstance(store, HostStore)  # a trainer that writes its store holds the host store itself
    seconds = []
    for step in trainer.trace.steps():
        last = {e.layer: e for e in trainer.trace.spans(step) if e.phase == "offload"}
        seconds += [e.duration_s - store.spec.state_bytes(store.numels[unit]) / write_bytes_per_s
                    for unit, e in last.items()]
    return max(0.0, statistics.median(seconds))


def measure_flush(directory: Path, repeats: int) -> float:
    """Seconds of one flush as a commit makes them: the median over `repeats` one-page files, each written,
    flushed, renamed and its folder flushed, of half the two flushes' time."""
    directory.mkdir(parents=True, exist_ok=True)
    page = os.urandom(4096)
    flushes = []
    for _ in range(repeats):
        fd, name = tempfile.mkstemp(prefix="flush-calibration-", suffix=".tmp", dir=directory)
        final = Path(name).with_suffix("")
        try:
            os.write(fd, page)
            start = time.perf_counter()
            os.fsync(fd)
            file_s = time.perf_counter() - start
            os.replace(name, final)
            folder = os.open(directory, os.O_RDONLY)
            try:
                start = time.perf_counter()
                os.fsync(folder)
                flushes.append((file_s + time.perf_counter() - start) / 2)
            finally:
                os.close(folder)
        finally:
            os.close(fd)
            Path(name).unlink(missing_ok=True)
            final.unlink(missing_ok=True)
    return statistics.median(flushes)


def measure_page_cache(directory: Path, nbytes: int, repeats: int) -> float:
    """Bytes per second the host's cores move through the page cache: the median of `repeats` buffered
    writes of `nbytes` (timed before the fsync that follows) and reads of the same, still cached, pages."""
    piece = min(nbytes, 8 * 2**20)
    buf = bytearray(os.urandom(piece))
    directory.mkdir(parents=True, exist_ok=True)
    rates = []
    for _ in range(repeats):
        fd, name = tempfile.mkstemp(prefix="page-cache-calibration-", dir=directory)
        try:
            start = time.perf_counter()
            for offset in range(0, nbytes, piece):
                os.write(fd, memoryview(buf)[: min(piece, nbytes - offset)])
            written = time.perf_counter() - start
            os.fsync(fd)
            os.lseek(fd, 0, os.SEEK_SET)
            start = time.perf_counter()
            while os.readv(fd, [buf]):
                pass
            rates.append(2 * nbytes / max(written + time.perf_counter() - start, 1e-9))
        finally:
            os.close(fd)
            os.unlink(name)
    return statistics.median(rates)
