"""The weight-streaming runtime: executing the step (runtime/), the host store (store/), checkpoints,
tokenizers and data (io/), the trainer API and the `streamer` command (cli/).

The names below load on first use, so that `streamer.cli.launch` can set up the command before torch loads."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamer.config import LRSchedule, TrainerConfig
    from streamer.errors import CheckpointError, DataError, StoreError, StreamerError, TokenizerError
    from streamer.runtime.step import NonFiniteError
    from streamer.store.layout import Placement
    from streamer.trainer import StreamingTrainer

_HOMES = {
    "LRSchedule": "streamer.config", "TrainerConfig": "streamer.config",
    "CheckpointError": "streamer.errors", "DataError": "streamer.errors", "StoreError": "streamer.errors",
    "StreamerError": "streamer.errors", "TokenizerError": "streamer.errors",
    "NonFiniteError": "streamer.runtime.step", "Placement": "streamer.store.layout",
    "StreamingTrainer": "streamer.trainer",
}
__all__ = [
    "CheckpointError", "DataError", "LRSchedule", "NonFiniteError", "Placement", "StoreError", "StreamerError",
    "StreamingTrainer", "TokenizerError", "TrainerConfig",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'streamer' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
