"""The steps, evaluations and closing report of `streamer train`, on a set-up `Session`."""
from __future__ import annotations

import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Collection

import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from layers import learned_tokens
from memory_model import format_size
from memory_model.shapes import step_model_flops
from streamer.advice import planned_host, planned_peak
from streamer.calibration.calibrate import cached_local_spec
from streamer.cli.eval import evaluate_dataset
from streamer.cli.trace import memory_lines
from streamer.generate import Sampling, complete
from streamer.io.data import BatchStream, Dataset
from streamer.io.tokenizer import Tokenizer
from streamer.reporting import Reporters
from streamer.resources import check_keep_room
from streamer.run import RunConfig
from streamer.run_dir import RunDir
from streamer.runtime.distributed import DataParallel, launcher
from streamer.store.layout import dtype_name
from streamer.errors import StreamerError
from streamer.trainer import StreamingTrainer

# --nonfinite skip moves on to the next batch, which gets past a few bad batches; a model whose every step is
# non-finite (a diverged run, an lr far too high) would otherwise retry the same step forever.
MAX_SKIPPED_ATTEMPTS = 10


@dataclass
class Session:
    """Everything one `streamer train` invocation works with."""

    cfg: RunConfig
    run: RunDir
    trainer: StreamingTrainer
    tokenizer: Tokenizer
    stream: BatchStream
    held_out: Dataset | None
    parallel: DataParallel | None = None
    reporters: Reporters | None = None  # --report-to, in the lead process only
    evaluated: tuple[int, float] | None = None  # the last evaluation's (step, loss): a step is evaluated once

    def __post_init__(self) -> None:
        step = self.trainer.step_count
        logged = [r["eval_loss"] for r in self.run.read_metrics() if r.get("step") == step and "eval_loss" in r]
        if logged:  # a kill came after this step's evaluation was logged: it is not logged again
            self.evaluated = (step, logged[-1])
        if self.trainer.tc.device.device == "cpu":  # the target --clipped-steps auto prices on, where calibrated
            self.trainer.local_target = cached_local_spec(Path("runs"), self.trainer.cfg,
                                                          dtype_name(self.trainer.tc.compute_dtype))

    def log(self, record: dict) -> None:
        """One record into RUN/metrics.jsonl and to --report-to's reporters (the lead process only)."""
        if not self.lead:
            return
        self.run.append_metrics(record)
        if self.reporters is not None:
            self.reporters.log(record["step"], record)

    @property
    def lead(self) -> bool:
        """The process that prints, logs and writes the run's files (rank 0 under torchrun)."""
        return self.parallel is None or self.parallel.rank == 0

    @property
    def devices(self) -> int:
        """Data-parallel processes, one device each."""
        return 1 if self.parallel is None else self.parallel.world



def describe(s: Session) -> str:
    cfg, tc = s.cfg, s.trainer.tc
    budget_bytes = tc.device.budget_bytes()
    budget = format_size(budget_bytes) if budget_bytes else "no"
    data = "Python's help topics (demo)" if cfg.data.data is None else cfg.data.data
    model = cfg.from_pretrained or cfg.model
    adapters = s.trainer.adapters
    lora = "" if adapters is None else (f"; LoRA rank {tc.lora.rank} on {','.join(adapters.targets)}: "
                                        f"{adapters.numel():,} trainable params, the base frozen")
    return (f"{model} ({s.trainer.cfg.num_params():,} params), {data}: {len(s.stream.dataset)} train / "
            f"{len(s.held_out) if s.held_out else 0} held-out sequences of {cfg.seq} tokens"
            f"{f' ({cfg.epochs} epochs: {cfg.steps} steps)' if cfg.epochs else ''}; batch {cfg.batch}"
            f"{f' in {tc.step.grad_accum} micro-batches' if tc.step.grad_accum > 1 else ''}, {tc.device.dtype}, "
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


# --- training ------------------------------------------------------------------------------------------------
def train(s: Session, console: Console) -> tuple[int, float, int]:
    """Steps until --steps; returns (steps trained, seconds spent in them, tokens learned in them)."""
    cfg, trainer = s.cfg, s.trainer
    first = trainer.step_count
    budget = trainer.tc.device.budget_bytes()
    process = psutil.Process()
    seconds, learned = 0.0, 0
    peak = _peak_flops(s)
    columns = (TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(bar_width=20),
               TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    plain = not console.is_terminal  # a log or a pipe gets one flushed line per step, not a redrawn bar
    began = time.perf_counter()
    attempts = 0  # consecutive skipped attempts at the same step
    with Progress(*columns, console=console, disable=not s.lead or plain) as progress:
        task = progress.add_task("train", total=cfg.steps, completed=first, stats="")
        if evaluation_due(cfg, first):  # step 0's: the baseline every later evaluation is read against
            evaluate(s, progress.console)  # (or the committed step's, where a kill came before it was logged)
        keep_missed(s, progress.console)
        while trainer.step_count < cfg.steps:
            ids, labels, positions, mask = next(s.stream)
            trainer.extra_state = {"data": s.stream.state_dict()}  # committed with this step
            begin = time.perf_counter()
            step = trainer.step_count + 1
            window = trainer.ledger.open_window()  # this step's own peak, as the trace's spans of it record it
            try:
                loss = trainer.step(ids, labels, positions, mask)
            finally:
                step_peak = trainer.ledger.close_window(window).peak
            elapsed = time.perf_counter() - begin
            seconds += elapsed
            rss = process.memory_info().rss
            skipped = trainer.step_count < step  # --nonfinite skip: nothing committed, the next batch tries step again
            # A skipped attempt is logged under the step it tried, without its non-finite loss (not valid JSON).
            outcome = {"skipped": True} if skipped else {"loss": loss, "grad_norm": trainer.grad_norm,
                                                         "schedule": trainer.last_schedule,
                                                         "redone": trainer.last_redone}
            # Learned tokens (what the loss covers), not padding or prompts; MFU counts every position computed.
            tokens = learned_tokens(labels)
            record = {"step": step, **outcome,
                      "lr": trainer.tc.schedule.lr_at(step, trainer.tc.optimizer.lr),
                      "tokens_per_s": tokens / elapsed, "step_s": elapsed,
                      **({} if peak is None else {"mfu": _model_flops(s, *ids.shape) / elapsed / peak[0]}),
                      "device_peak_bytes": step_peak, "host_rss_bytes": rss}
            s.log(record)
            attempts = attempts + 1 if skipped else 0
            if attempts == MAX_SKIPPED_ATTEMPTS:
                raise StreamerError(f"step {step} was non-finite on {attempts} batches in a row, so --nonfinite skip "
                                    f"cannot make progress; the run keeps step {step - 1}: lower --lr or check the "
                                    "data, then run the same command again")
            if skipped:
                if s.lead:
                    progress.console.print(f"step {step} skipped: non-finite loss or gradient (--nonfinite skip); "
                                           "the next batch tries it again", markup=False, highlight=False)
                continue
            learned += tokens
            progress.update(task, completed=step, stats=(
                f"loss {loss:.3f} | {record['tokens_per_s']:,.0f} tok/s{_mfu(record)} | step's device peak "
                f"{format_size(step_peak)} / {format_size(budget) if budget else 'no budget'} | "
                f"RSS {format_size(rss)}"))
            if plain and s.lead and (step % cfg.log_every == 0 or step == cfg.steps):
                console.print(_progress_line(record, cfg.steps, time.perf_counter() - began, step - first),
                              markup=False, highlight=False)
            if cfg.trainer.step.store.tier == "ram" and (step % cfg.save_interval == 0 or step == cfg.steps):
                trainer.save()  # the RAM tier is durable only when saved
            kept = cfg.keeps() and step % cfg.save_interval == 0
            eval_loss = None
            if (cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps) or (kept and cfg.keep_best):
                eval_loss = evaluate(s, progress.console)
            if kept:
                keep(s, eval_loss, progress.console)
    return trainer.step_count - first, seconds, learned


def evaluation_due(cfg: RunConfig, step: int) -> bool:
    """Whether a run evaluates at `step` before training on: before the first step, every --eval-every steps, and
    at each --save-every step --keep-best ranks (the last step's evaluation is the closing report's)."""
    if step >= cfg.steps:
        return False
    if step == 0:
        return cfg.eval_every > 0
    return (cfg.eval_every > 0 and step % cfg.eval_every == 0) or (cfg.keep_best and step % cfg.save_interval == 0)


def final_evaluation_missing(cfg: RunConfig, run: RunDir, step: int) -> bool:
    """Whether a run at its last step, with held-out data, has no evaluation of it logged: a kill came between
    the step's commit and the closing report's evaluation."""
    held_out = cfg.data.eval_data is not None or cfg.data.eval_fraction > 0
    return held_out and step == cfg.steps and not any(
        r.get("step") == step and "eval_loss" in r for r in run.read_metrics())


def _peak_flops(s: Session) -> tuple[float, str] | None:
    """(FLOP/s, what it is): one device's dense peak in the run's compute dtype that MFU is read against, the
    run's target's (the --budget preset, else this cpu's matmul rate measured by its calibration); None where
    none is known."""
    target = s.trainer.target()
    dtype = dtype_name(s.trainer.tc.compute_dtype)
    if target is None or dtype not in target.flops:
        return None
    return target.flops_for(dtype), f"{target.name}'s {dtype} peak {target.flops_for(dtype) / 1e9:,.1f} GFLOP/s"


def _model_flops(s: Session, batch: int, seq: int) -> int:
    """One device's model FLOPs in a step of `batch` rows (the global batch, split over the processes)."""
    return step_model_flops(s.trainer.cfg, batch // s.devices, seq)


def _mfu(record: dict) -> str:
    return f" MFU {record['mfu']:.1%}" if "mfu" in record else ""


def keep(s: Session, eval_loss: float | None, console: Console) -> None:
    """Keep the step just committed (a --save-every step), and let go of the kept steps that --keep-last and
    --keep-best no longer hold; the disk must have room for the kept copy (`check_keep_room`)."""
    trainer, step = s.trainer, s.trainer.step_count
    losses = {kept: note.get("eval_loss") for kept, note in trainer.kept().items()}
    losses[step] = eval_loss
    held = steps_to_keep(losses, s.cfg.keep_limit(), s.cfg.keep_best)
    for old in sorted(set(losses) - held - {step}):
        trainer.drop_kept(old)
    if step not in held:
        return
    check_keep_room(trainer.held_store.root, trainer.held_store.spec, step)
    trainer.keep({} if eval_loss is None else {"eval_loss": eval_loss})
    if s.lead:
        console.print(f"step {step} kept (kept steps: {', '.join(map(str, sorted(held)))})", markup=False,
                      highlight=False)


def keep_missed(s: Session, console: Console) -> None:
    """Keep the step the run continues from where a kill came between its commit and its keep (a --save-every
    step not kept): the same decision, on the same kept steps and eval loss, as the uninterrupted run's."""
    cfg, trainer, step = s.cfg, s.trainer, s.trainer.step_count
    if not keep_due(cfg, step, trainer.kept()):
        return
    # Its evaluation is logged once: one a kill left logged is the session's own (`Session.evaluated`).
    keep(s, evaluate(s, console) if cfg.keep_best else None, console)


def keep_due(cfg: RunConfig, step: int, kept: Collection[int]) -> bool:
    """Whether `step` is a --save-every step the run keeps (or ranks for --keep-best) and `kept` lacks it."""
    return bool(step) and cfg.keeps() and step % cfg.save_interval == 0 and step not in kept


def steps_to_keep(losses: dict[int, float | None], last: int | None, best: bool) -> set[int]:
    """Of the steps `losses` gives eval losses of (None: not evaluated), the `last` newest (None: all) and, with
    `best`, the one of the lowest loss (the earliest of equals)."""
    steps = sorted(losses)
    held = set(steps if last is None else steps[-last:] if last else [])  # all while fewer than `last`
    ranked = [step for step in steps if losses[step] is not None]
    if best and ranked:
        held.add(min(ranked, key=lambda step: (losses[step], step)))
    return held


def _progress_line(record: dict, steps: int, elapsed: float, done: int) -> str:
    """`step 3/80 loss 7.812 lr 6.00e-04 1,024 tok/s MFU 3.1% elapsed 0:00:03 eta 0:01:17`: one step, for logs
    (MFU where the device's peak is known)."""
    eta = elapsed / done * (steps - record["step"])
    return (f"step {record['step']}/{steps} loss {record['loss']:.4f} lr {record['lr']:.2e} "
            f"{record['tokens_per_s']:,.0f} tok/s{_mfu(record)} elapsed {_clock(elapsed)} eta {_clock(eta)}")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def evaluate(s: Session, console: Console) -> float | None:
    """Mean loss per predicted token over the first --eval-batches held-out batches (`streamer eval`'s figure);
    printed with perplexity and logged."""
    if s.held_out is None:
        return None
    if s.evaluated is not None and s.evaluated[0] == s.trainer.step_count:
        return s.evaluated[1]  # --keep-best evaluated the last step already
    cfg = s.cfg
    # The trainer splits a batch over the processes, then into grad_accum micro-batches.
    split = cfg.trainer.step.grad_accum * (1 if s.parallel is None else s.parallel.world)
    loss, _ = evaluate_dataset(s.trainer, s.held_out, cfg.batch, cfg.eval_batches, split,
                               float if s.parallel is None else s.parallel.mean)
    if loss is None:
        return None
    step = s.trainer.step_count
    s.evaluated = (step, loss)
    s.log({"step": step, "eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700))})
    console.print(f"step {step}: eval loss {loss:.3f}, perplexity {math.exp(min(loss, 700)):,.1f}")
    return loss


# --- the report ----------------------------------------------------------------------------------------------
def report(s: Session, trained: int, seconds: float, learned: int, console: Console) -> None:
    """Memory table and comparison with the baseline, trace files, final eval, a sample."""
    cfg, trainer, run = s.cfg, s.trainer, s.run
    if trained and s.lead:
        last = trainer.step_count
        trace = trainer.trace
        trace.meta.update(model=cfg.from_pretrained or cfg.model, run=str(run.root), batch=cfg.batch, seq=cfg.seq,
                          grad_accum=cfg.trainer.step.grad_accum, activations=cfg.trainer.step.activations,
                          dtype=cfg.trainer.device.dtype, store=cfg.trainer.step.store.tier,
                          steps=[last - trained + 1, last])
        # Written before the final evaluation and sample, whose spans would otherwise join the last step's.
        top = trace.peak_step()  # the step `streamer trace` shows by default
        assert top is not None  # steps were trained
        run.write_trace(trace, top)
        console.print(trace.table(step=top))
        for line in memory_lines(trace, top, planned=_planned_peak(s),
                                 planned_host=planned_host(s.trainer.cfg, s.cfg, s.devices).total):
            console.print(line)
        peak = _peak_flops(s)
        mfu = ("; no MFU: no peak FLOP/s is known for this device (a --budget preset has one; `streamer calibrate` "
               "measures this cpu's)") if peak is None else \
            f", MFU {_model_flops(s, cfg.batch, cfg.seq) * trained / seconds / peak[0]:.1%} of {peak[1]}"
        console.print(f"throughput: {learned / seconds:,.0f} learned tokens/s over {trained} steps "
                      f"({seconds / trained:.2f} s/step){mfu}")
    evaluate(s, console)
    # With the state sharded a unit's weights are all-gathered: every process takes part in the (seeded) sample.
    sharded = s.parallel is not None and s.parallel.sharded
    if not s.lead and not sharded:
        return
    assert cfg.sample_prompt is not None  # a session's settings hold the prompt it derived
    prompt_ids = s.tokenizer.prompt_ids(cfg.sample_prompt) or [s.tokenizer.eos_id]
    new_tokens = min(cfg.sample_tokens, trainer.cfg.context()[0] - len(prompt_ids))
    if new_tokens > 0:
        sampling = Sampling(new_tokens, temperature=0.8, top_p=0.95, seed=cfg.trainer.seed)
        text = complete(trainer, s.tokenizer, cfg.sample_prompt, sampling)
    if not s.lead:
        return
    if new_tokens > 0:
        console.print("sample: ", end="")
        console.print(cfg.sample_prompt, style="dim", end="", markup=False, highlight=False)
        console.print(text, markup=False, highlight=False)
    if trained:
        console.print(f"trace: {run.trace_json} (Chrome/Perfetto: {run.trace_chrome}); plot: {run.plot}")
    folder = shlex.quote(str(run.root))
    _, placeholders = launcher(s.parallel)
    console.print(f"next (one command per line{f'; the last {placeholders}' if placeholders else ''}):\n" + "\n".join(
        f"  {command}" for command in (
            f"streamer generate {folder} --prompt {shell_word(cfg.sample_prompt or 'The')}",
            f"streamer export {folder} {shlex.quote(str(run.root) + '-hf')}",
            resume_command(str(run.root), s.parallel, cfg.steps * 2))), markup=False, highlight=False)


def _planned_peak(s: Session) -> int:
    """The analytic planner's peak for this run's step (memory_model.planner), to set beside the measured one."""
    return planned_peak(s.trainer.cfg, s.cfg, s.devices)
