"""The weight-streaming runtime: executing the step (runtime/), the host store (store/), checkpoints,
tokenizers and data (io/), the trainer API and the `streamer` command (cli/)."""
from streamer.config import LRSchedule, TrainerConfig
from streamer.errors import CheckpointError, DataError, StoreError, StreamerError, TokenizerError
from streamer.store.layout import Placement
from streamer.runtime.step import NonFiniteError
from streamer.trainer import StreamingTrainer

__all__ = [
    "CheckpointError", "DataError", "LRSchedule", "NonFiniteError", "Placement", "StoreError", "StreamerError",
    "StreamingTrainer", "TokenizerError", "TrainerConfig",
]
