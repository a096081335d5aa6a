"""The weight-streaming runtime: executing the step (runtime/), the host store (store/), checkpoints,
tokenizers and data (io/), the trainer API and the `streamer` command (cli/).

The names below load on first use, so that `streamer.cli.launch` can set up the command before torch loads."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memory_model.lora import LoraConfig
    from memory_model.step import Placement, StepConfig
    from streamer.config import TrainerConfig
    from streamer.errors import CheckpointError, DataError, StoreError, StreamerError, TokenizerError
    from streamer.runtime.hardware import DeviceConfig
    from streamer.runtime.optim import LRSchedule, OptimizerConfig
    from streamer.runtime.step import NonFiniteError
    from streamer.trainer import StreamingTrainer

_HOMES = {
    "TrainerConfig": "streamer.config", "LRSchedule": "streamer.runtime.optim",
    "OptimizerConfig": "streamer.runtime.optim", "StepConfig": "memory_model.step",
    "DeviceConfig": "streamer.runtime.hardware", "LoraConfig": "memory_model.lora",
    "CheckpointError": "streamer.errors", "DataError": "streamer.errors", "StoreError": "streamer.errors",
    "StreamerError": "streamer.errors", "TokenizerError": "streamer.errors",
    "NonFiniteError": "streamer.runtime.step", "Placement": "memory_model.step",
    "StreamingTrainer": "streamer.trainer",
}
__all__ = [
    "CheckpointError", "DataError", "DeviceConfig", "LRSchedule", "LoraConfig", "NonFiniteError", "OptimizerConfig",
    "Placement", "StepConfig", "StoreError", "StreamerError", "StreamingTrainer", "TokenizerError", "TrainerConfig",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'streamer' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
