"""User-facing errors: the CLI prints one of these as a single line, without a traceback.

Every message states the problem and the fix in one line, so a user never needs
the stack to know what to do next.
"""
from __future__ import annotations


class StreamerError(Exception):
    """Base of every error a user can cause and fix (bad input, bad files, bad settings)."""


class CheckpointError(StreamerError):
    """A Hugging Face checkpoint that cannot be read, validated or written."""


class ConfigError(StreamerError):
    """Trainer settings that cannot run; the message names the fix."""

    key: str | None = None  # the setting at fault and what is wrong with it, where `of` made it
    problem: str | None = None

    @classmethod
    def of(cls, key: str, problem: str) -> "ConfigError":
        """The error check_settings raises for one trainer setting: `lr must be ..., got ...`."""
        error = cls(f"{key} {problem}")
        error.key, error.problem = key, problem  # so a settings tree can say it under the setting's flag name
        return error


class DataError(StreamerError):
    """A training data source that cannot be turned into sequences."""


class StoreError(StreamerError):
    """A host store (RAM or disk) that is missing, corrupt or out of space."""


class TokenizerError(StreamerError):
    """A tokenizer that cannot be loaded, trained or saved."""
