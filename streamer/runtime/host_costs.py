"""What the runtime costs the host's cores beyond the kernels: a fixed cost per compute event and per step, and
the copying of each disk-tier byte through the page cache.

Fixed costs. The kernel costs (memory_model/kernels.py) scale with tokens, widths and parameters; besides
them every event pays for the executor's hand-offs (the load's future, the ledger, the trace's span),
autograd's bookkeeping and the dispatch of each of its small kernels. On a model as small as the demo's
that is much of a step. It is measured on the runtime itself: RAM-tier steps of two GPT-J models too small
for their kernels to take measurable time (d_model 32, 8 tokens), one and five blocks deep. Their
difference, over the difference in their events, is the cost of an event; what the shallow one takes beyond
its events is the step's own (the loss, the commit, the bookkeeping of a step).

Page cache. A disk-tier byte is written into the page cache and read back from it (or from the disk into
it) by the host's cores; on a cpu device those are the cores that compute, so the planner charges that
time to the compute. It is timed as a buffered write (before its fsync) and a read of the cached pages.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from layers.config import GPTJConfig
from memory_model.schedule import step_events

_DEPTHS = (1, 5)
_TOKENS = 8


@dataclass(frozen=True)
class FixedCosts:
    event_s: float  # per forward, backward or update event
    step_s: float  # per optimizer step, besides its events


def _tiny(layers: int) -> GPTJConfig:
    return GPTJConfig(vocab_size=64, n_positions=_TOKENS, n_embd=32, n_layer=layers, n_head=2, rotary_dim=8)


def _step_seconds(cfg: GPTJConfig, dtype: torch.dtype, steps: int) -> tuple[float, int]:
    """Median seconds of `steps` RAM-tier steps after two warm-up ones, and the events each step runs."""
    from streamer.config import TrainerConfig  # the runtime measures itself: imported when calibrating
    from streamer.trainer import StreamingTrainer

    tc = TrainerConfig(compute_dtype=dtype, store="ram")
    ids = torch.randint(0, cfg.vocab_size, (1, _TOKENS), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory(prefix="calibrate-events-") as tmp, \
            StreamingTrainer(cfg, tc, store_dir=Path(tmp) / "store") as trainer:
        seconds = []
        for i in range(2 + steps):
            start = time.perf_counter()
            trainer.step(ids)
            if i >= 2:
                seconds.append(time.perf_counter() - start)
        numels = {u: trainer.layouts[u].numel for u in trainer.units}
        events = step_events(trainer.units, 1, numels, trainer.tc.update_chunk, fused=trainer.fused)
    return statistics.median(seconds), len(events)


def measure_fixed_costs(dtype: torch.dtype, steps: int = 7) -> FixedCosts:
    """The event's and the step's fixed seconds, from the shallow and the deep tiny model (module doc)."""
    torch_state = torch.random.get_rng_state()
    try:
        (shallow_s, shallow_events), (deep_s, deep_events) = (_step_seconds(_tiny(n), dtype, steps) for n in _DEPTHS)
    finally:
        torch.random.set_rng_state(torch_state)
    # Timing noise can make the deeper model no slower: an event then costs nothing measurable.
    event_s = max(0.0, (deep_s - shallow_s) / (deep_events - shallow_events))
    return FixedCosts(event_s, max(0.0, shallow_s - shallow_events * event_s))


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
