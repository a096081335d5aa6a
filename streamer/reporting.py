"""Training metrics where people look: TensorBoard event files in the run folder, and Weights & Biases.

RUN/metrics.jsonl always gets every record; `--report-to` adds the others. Both are optional packages (the
`tensorboard` and `wandb` extras), imported only when asked for. W&B runs offline (files under RUN/wandb, synced
later with `wandb sync`) unless WANDB_MODE says otherwise, so a run never needs a network or an account.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from memory_model.settings import SettingError, Text, check_settings, setting
from streamer.errors import StreamerError

REPORTERS = ("tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"
WANDB_PROJECT = "weight-streaming"


class ReportError(StreamerError):
    """A reporter that cannot start: its package is missing."""


class ReportSettingError(ReportError, SettingError):
    """--report-to names no reporter."""


@dataclass(frozen=True)
class ReportConfig:
    report_to: str = setting("none", "where metrics go besides RUN/metrics.jsonl: tensorboard, wandb, both "
                                     "(tensorboard,wandb) or none", Text(), "LIST")

    def __post_init__(self) -> None:
        check_settings(self, ReportSettingError)
        unknown = [n for n in self.targets if n not in REPORTERS]
        if unknown or (self.report_to != "none" and not self.targets):
            what = f"an unknown target ({', '.join(unknown)})" if unknown else "no target"
            raise ReportSettingError("report_to", f"{self.report_to!r} names {what}; give "
                                                  f"{', '.join(REPORTERS)}, both comma-separated, or none")

    @property
    def targets(self) -> tuple[str, ...]:
        return () if self.report_to == "none" else tuple(n.strip() for n in self.report_to.split(",") if n.strip())

    def check_installed(self) -> None:
        """Raise a ReportError naming the extra to install if a reporter's package is missing: checked before a
        run is set up, so a missing package leaves nothing behind."""
        if "tensorboard" in self.targets:
            _summary_writer()
        if "wandb" in self.targets:
            _import_wandb()


class Reporters:
    """The reporters a run asked for; `log(step, record)` sends a metrics.jsonl record's numbers to each."""

    def __init__(self, config: ReportConfig, run_root: Path, settings: Mapping[str, Any], first_step: int) -> None:
        self._writers: list[Any] = []
        self._wandb: Any = None
        try:
            if "tensorboard" in config.targets:
                self._writers.append(_tensorboard(run_root, first_step))
            if "wandb" in config.targets:
                self._wandb = _wandb_run(run_root, settings)
        except BaseException:
            self.close()
            raise

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        values = {k: float(v) for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        for writer in self._writers:
            for key, value in values.items():
                writer.add_scalar(key, value, step)
            writer.flush()  # a run killed later still shows every step up to here
        if self._wandb is not None and values:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._writers, self._wandb = [], None


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's module imports the tensorboard package
        raise ReportError("--report-to tensorboard needs the tensorboard package: pip install "
                          "'weight-streaming[tensorboard]'") from None
    return SummaryWriter


def _tensorboard(run_root: Path, first_step: int) -> Any:
    # purge_step: a resumed run drops events a killed invocation wrote past the step it resumes from.
    return _summary_writer()(str(run_root / TENSORBOARD_DIR), purge_step=first_step + 1 if first_step else None)


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ReportError("--report-to wandb needs the wandb package: pip install 'weight-streaming[wandb]'") from None
    return wandb


def _wandb_run(run_root: Path, settings: Mapping[str, Any]) -> Any:
    wandb = _import_wandb()
    # One W&B run per run folder, whichever invocation (a resume, a rerun) logs to it.
    run_id = hashlib.sha1(str(run_root.resolve()).encode()).hexdigest()[:16]
    return wandb.init(project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT), name=run_root.name, id=run_id,
                      resume="allow", dir=str(run_root), config=dict(settings),
                      mode=os.environ.get("WANDB_MODE", "offline"),
                      # console off: W&B would otherwise wrap this process's stdout and stderr.
                      settings=wandb.Settings(console="off", silent=True))
