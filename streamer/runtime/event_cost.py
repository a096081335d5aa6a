"""The fixed cost of a compute event on this machine: what one unit's forward, backward or update chunk costs
whatever its size.

The kernel costs (memory_model/kernels.py) scale with tokens, widths and parameters; besides them every event
pays for the executor's hand-offs (the load's future, the ledger, the trace's span), autograd's bookkeeping
and the dispatch of each of its small kernels. On a model as small as the demo's that is much of a step.
It is measured on the runtime itself: RAM-tier steps of two GPT-J models too small for their kernels to take
measurable time (d_model 32, 8 tokens), one and five blocks deep. Their difference, over the difference in
their events, is the cost of an event; what the shallow one takes beyond its events is the step's own (the
loss, the commit, the bookkeeping of a step).
"""
from __future__ import annotations

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
