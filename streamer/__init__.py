"""The weight-streaming runtime: host store, step schedule, streamed execution, CLI."""
from streamer.config import LRSchedule, TrainerConfig
from streamer.errors import CheckpointError, DataError, StoreError, StreamerError, TokenizerError
from streamer.store.layout import Placement
from streamer.runtime.executor import NonFiniteError
from streamer.trainer import StreamingTrainer

__all__ = [
    "CheckpointError", "DataError", "LRSchedule", "NonFiniteError", "Placement", "StoreError", "StreamerError",
    "StreamingTrainer", "TokenizerError", "TrainerConfig",
]
