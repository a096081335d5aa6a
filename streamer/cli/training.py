"""How `streamer train` shows a run (`streamer.session`'s events): set-up lines, a progress bar (or a line per
--log-every steps in a log), evaluations, kept steps and the closing report."""
from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.status import Status

from memory_model import format_size
from streamer.advice import planned_host, planned_peak
from streamer.cli.trace import memory_lines
from streamer.runtime.distributed import DataParallel, launcher
from streamer.session import Event, Session, Trained


@dataclass
class _Bar:
    """The progress bar of the steps under way, and what its lines are read against."""

    progress: Progress
    task: Any
    steps: int  # --steps
    first: int  # the step the session started at
    log_every: int
    budget: int | None
    began: float


class Printer:
    """`streamer train`'s listener: each event printed to the console, a set-up phase as a spinner (a terminal's
    only), steps on the progress bar (or, in a log or a pipe, one flushed line every --log-every steps)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.status: Status | None = None
        self.bar: _Bar | None = None

    def __call__(self, event: Event) -> None:
        self.settle()
        if event.kind == "phase":
            self.status = self.console.status(event.line)
            self.status.start()
        elif event.kind == "step":
            self._step(event)
        else:
            self.console.print(event.line, markup=False, highlight=False)

    def settle(self) -> None:
        """End the spinner of a set-up phase."""
        if self.status is not None:
            self.status.stop()
            self.status = None

    def __enter__(self) -> Printer:
        return self

    def __exit__(self, *_: object) -> None:
        self.settle()

    def _step(self, event: Event) -> None:
        record, bar = event.record, self.bar
        if bar is None or record.get("skipped"):  # a skipped step's line is a note of its own
            return
        step = record["step"]
        bar.progress.update(bar.task, completed=step, stats=(
            f"loss {record['loss']:.3f} | {record['tokens_per_s']:,.0f} tok/s{_mfu(record)} | step's device peak "
            f"{format_size(record['device_peak_bytes'])} / "
            f"{format_size(bar.budget) if bar.budget else 'no budget'} | RSS {format_size(record['host_rss_bytes'])}"))
        if not self.console.is_terminal and (step % bar.log_every == 0 or step == bar.steps):
            self.console.print(_progress_line(record, bar.steps, time.perf_counter() - bar.began, step - bar.first),
                               markup=False, highlight=False)


def describe(s: Session) -> str:
    cfg, tc = s.cfg, s.trainer.tc
    budget_bytes = tc.device.budget_bytes()
    budget = format_size(budget_bytes) if budget_bytes else "no"
    data = "Python's help topics (demo)" if cfg.data.data is None else cfg.data.data
    model = cfg.from_pretrained or cfg.model
    adapters = s.trainer.adapters
    lora = "" if adapters is None else (f"; LoRA rank {tc.lora.rank} on {','.join(adapters.targets)}: "
                                        f"{adapters.numel():,} trainable params, the base frozen")
    rows = "pairs" if tc.objective.preference else "prompts" if tc.objective.grpo else "sequences"
    train = len(s.grpo.dataset) if s.grpo is not None else len(s.stream.dataset) if s.stream is not None else 0
    return (f"{model} ({s.trainer.cfg.num_params():,} params), {data}: {train} train / "
            f"{len(s.held_out) if s.held_out else 0} held-out {rows} of {cfg.seq} tokens"
            f"{f' ({cfg.epochs} epochs: {cfg.steps} steps)' if cfg.epochs else ''}; batch {cfg.batch}"
            f"{f' in {tc.step.grad_accum} micro-batches' if tc.step.grad_accum > 1 else ''}, "
            f"{tc.step.precision.compute}, "
            f"{tc.step.activations} activations, {tc.step.store.tier} store, {budget} budget{lora}")


def shell_word(text: str) -> str:
    """`text` as one shell word on one line: quoted, and a prompt's newlines and tabs written as bash's $'\\n'."""
    if not any(c in text for c in "\n\t\r"):
        return shlex.quote(text)
    escaped = text.replace("\\", "\\\\").replace("'", "\\'")
    return "$'" + escaped.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r") + "'"


def resume_command(run: str, parallel: DataParallel | None, steps: int | None = None) -> str:
    """The command that continues `run`, launched as this process was: a run trained by N processes resumes
    only with N (torchrun)."""
    launch, _ = launcher(parallel)
    return f"{launch} train --resume {shlex.quote(run)}" + (f" --steps {steps}" if steps else "")


def train(s: Session, printer: Printer) -> Trained:
    """`Session.train` under a progress bar (in the lead process, on a terminal)."""
    columns = (TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(bar_width=20),
               TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    plain = not printer.console.is_terminal  # a log or a pipe gets one flushed line per step, not a redrawn bar
    with Progress(*columns, console=printer.console, disable=not s.lead or plain) as progress:
        first = s.trainer.step_count
        task = progress.add_task("train", total=s.cfg.steps, completed=first, stats="")
        printer.bar = _Bar(progress, task, s.cfg.steps, first, s.cfg.log_every, s.trainer.tc.device.budget_bytes(),
                           time.perf_counter())
        try:
            return s.train()
        finally:
            printer.bar = None


def _mfu(record: Any) -> str:
    return f" MFU {record['mfu']:.1%}" if "mfu" in record else ""


def _progress_line(record: Any, steps: int, elapsed: float, done: int) -> str:
    """`step 3/80 loss 7.812 lr 6.00e-04 1,024 tok/s MFU 3.1% elapsed 0:00:03 eta 0:01:17`: one step, for logs
    (MFU where the device's peak is known)."""
    eta = elapsed / done * (steps - record["step"])
    reward = "" if record.get("reward") is None else f" reward {record['reward']:.3f}"  # --method grpo's mean
    return (f"step {record['step']}/{steps} loss {record['loss']:.4f}{reward} lr {record['lr']:.2e} "
            f"{record['tokens_per_s']:,.0f} tok/s{_mfu(record)} elapsed {_clock(elapsed)} eta {_clock(eta)}")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


# --- the report ----------------------------------------------------------------------------------------------
def report(s: Session, trained: Trained, printer: Printer) -> None:
    """Memory table and comparison with the plan, throughput, the closing evaluation and sample
    (`Session.finish`), where the trace is, and the next commands."""
    cfg, trainer, run, console = s.cfg, s.trainer, s.run, printer.console
    if trained.steps and s.lead:
        top = trained.trace_step
        assert top is not None  # steps were trained
        console.print(trainer.trace.table(step=top))
        for line in memory_lines(trainer.trace, top, planned=planned_peak(trainer.cfg, cfg, s.devices),
                                 planned_host=planned_host(trainer.cfg, cfg, s.devices).total):
            console.print(line)
        peak = s.peak_flops()
        mfu = ("; no MFU: no peak FLOP/s is known for this device (a --budget preset has one; `streamer calibrate` "
               "measures this cpu's)") if peak is None else \
            f", MFU {s.model_flops(cfg.batch, cfg.seq) * trained.steps / trained.seconds / peak[0]:.1%} of {peak[1]}"
        console.print(f"throughput: {trained.learned / trained.seconds:,.0f} learned tokens/s over {trained.steps} "
                      f"steps ({trained.seconds / trained.steps:.2f} s/step){mfu}")
    text = s.finish()
    if not s.lead:
        return
    if text is not None:
        console.print("sample: ", end="")
        console.print(cfg.sample_prompt, style="dim", end="", markup=False, highlight=False)
        console.print(text, markup=False, highlight=False)
    if trained.steps:
        console.print(f"trace: {run.trace_json} (Chrome/Perfetto: {run.trace_chrome}); plot: {run.plot}")
    folder = shlex.quote(str(run.root))
    _, placeholders = launcher(s.parallel)
    console.print(f"next (one command per line{f'; the last {placeholders}' if placeholders else ''}):\n" + "\n".join(
        f"  {command}" for command in (
            f"streamer generate {folder} --prompt {shell_word(cfg.sample_prompt or 'The')}",
            f"streamer export {folder} {shlex.quote(str(run.root) + '-hf')}",
            resume_command(str(run.root), s.parallel, cfg.steps * 2))), markup=False, highlight=False)
