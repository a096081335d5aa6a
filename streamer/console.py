"""The rich console every command prints through."""
from __future__ import annotations

import sys

from rich.console import Console


def make_console() -> Console:
    """Piped output (logs, CI, `| tee`) gets 160 columns instead of rich's 80, so per-layer tables stay readable."""
    return Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
