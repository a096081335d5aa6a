"""A run's lifecycle as a library: start one from a `RunConfig` or resume one from its folder, train it (epochs,
evaluations, kept steps, saves, a stop asked for), evaluate it and generate its sample, reporting progress to a
listener as `Event`s. `streamer train` is this module with flags and printing (streamer/cli/train.py).

    session = start(RunConfig.of({"steps": 6, "run_dir": "runs/a"}), listener=print)
    with session:
        session.train()
        session.finish()

A run is resumable at every committed step: the data order's position goes into `trainer.extra_state`, which
the store commits atomically with the step, so `resume` sees exactly the batches an uninterrupted run would have
seen.

Long because it is one concern from set-up to the closing sample: a new run's set-up and its checks, a resumed
run's, and the loop with its evaluations and kept steps share the session's state.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, TypeVar

import torch

from layers import IGNORE_INDEX, ModelConfig, learned_tokens
from layers.config import read_hf_json
from memory_model.settings import flag, flatten
from memory_model.shapes import step_model_flops
from memory_model.trace import resident_set
from streamer.advice import check_fits, fit_expert_groups, ledger_advice
from streamer import cpu_cache
from streamer.calibration.calibrate import cached_local_spec
from streamer.errors import ConfigError, StoreError, StreamerError
from streamer.generate import Sampling, complete
from streamer.grpo import GRPOLoop, GRPOSettings, frozen_reference, prompt_tokens
from streamer.io.data import (BatchStream, DataConfig, Dataset, chat_prompt, demo_corpus, load_dataset,
                              long_examples_line, prompt_of, read_examples, tokenize)
from streamer.io.preference import pair_rows, tokenize_pairs
from streamer.io.records import Pair, read_pairs, read_prompts
from streamer.io.gguf import gguf_tokenizer, is_gguf
from streamer.io.tokenizer import MIN_VOCAB, Tokenizer, load_tokenizer, train_bpe
from streamer.reporting import Reporters
from streamer.rewards import Rewards
from streamer.resources import check_host_resources, check_keep_room
from streamer.run import DEFAULT_PROMPT, FLAGS, RESUMABLE, RunConfig, RunError, SettingError, absolute
from streamer.run_dir import RunDir
from streamer.runtime.distributed import DataParallel, leave_process_group
from streamer.runtime.hardware import resolve_compute_dtype
from streamer.runtime.step import check_runnable
from streamer.store.layout import dtype_name
from streamer.trainer import StreamingTrainer

T = TypeVar("T")

# --nonfinite skip moves on to the next batch, which gets past a few bad batches; a model whose every step is
# non-finite (a diverged run, an lr far too high) would otherwise retry the same step forever.
MAX_SKIPPED_ATTEMPTS = 10


# --- events ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    """One thing a run reports, in the lead process only (rank 0 under torchrun).

    kind: `note` (a line for a person), `phase` (set-up work that takes a while begins, `line` names it; the next
    event ends it), `step` (a step's metrics.jsonl record; `skipped` in it where --nonfinite skip skipped it),
    `evaluated` (the record of an evaluation: eval_loss, eval_perplexity), `kept` (a step kept).
    """

    kind: str
    line: str = ""
    step: int | None = None
    record: Mapping[str, Any] = field(default_factory=dict)


Listener = Callable[[Event], None]


class Events:
    """Where a run's events go: the listener, unless this process is not the lead (`quiet`)."""

    def __init__(self, listener: Listener | None = None) -> None:
        self.listener, self.quiet = listener, False

    def __call__(self, kind: str, line: str = "", step: int | None = None,
                 record: Mapping[str, Any] | None = None) -> None:
        if self.listener is not None and not self.quiet:
            self.listener(Event(kind, line, step, {} if record is None else record))


@dataclass(frozen=True)
class Trained:
    """What `Session.train` did: steps trained, seconds spent in them, tokens learned in them, and the step of the
    trace written to the run folder (its step of the highest device peak; None where nothing was trained)."""

    steps: int
    seconds: float
    learned: int
    trace_step: int | None


# --- the session -------------------------------------------------------------------------------------------------
@dataclass
class Session:
    """An open run: its settings, folder, trainer, tokenizer and data. `start` or `resume` makes one; use it in a
    `with` block, which closes the trainer."""

    cfg: RunConfig
    run: RunDir
    trainer: StreamingTrainer
    tokenizer: Tokenizer
    stream: BatchStream | None  # None for --method grpo, whose loop picks its prompts (`grpo`)
    held_out: Dataset | None
    parallel: DataParallel | None = None
    events: Events = field(default_factory=Events)
    reporters: Reporters | None = None  # --report-to, in the lead process only
    evaluated: tuple[int, float] | None = None  # the last evaluation's (step, loss): a step is evaluated once
    logged: int | None = None  # the step whose evaluation metrics.jsonl holds already (not logged again)
    tokenizer_checksum: int = 0  # of the tokenizer folder's files, committed with each step
    stopping: bool = False  # `stop` asked for: training ends after the step under way
    # --method dpo: each pair row's reference log-probabilities (chosen, rejected), by the row's tokens
    references: dict[bytes, torch.Tensor] = field(default_factory=dict)
    grpo: GRPOLoop | None = None  # --method grpo: rollouts, rewards and steps

    def __post_init__(self) -> None:
        step = self.trainer.step_count
        if any(r.get("step") == step and "eval_loss" in r for r in self.run.read_metrics()):
            self.logged = step  # a kill came after this step's evaluation was logged: it is not logged again
        self.tokenizer_checksum = self.run.tokenizer_checksum()
        if self.trainer.tc.device.device == "cpu":  # the target --clipped-steps auto prices on, where calibrated
            self.trainer.local_target = cached_local_spec(Path("runs"), self.trainer.cfg,
                                                          dtype_name(self.trainer.tc.compute_dtype))
        self.trainer.ledger.hint_context["advise"] = ledger_advice(self.trainer.cfg, self.cfg, self.devices)

    def __enter__(self) -> Session:
        try:
            if self.lead:
                self.reporters = Reporters(self.cfg.report, self.run.root, self.cfg.flat(), self.trainer.step_count)
        except BaseException:
            self.trainer.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.close()
        if kind is None and self.parallel is not None:
            leave_process_group()

    def close(self) -> None:
        """Close the trainer (the store's files) and the reporters."""
        try:
            self.trainer.close()
            if self.grpo is not None and self.grpo.reference is not None:
                self.grpo.reference.close()
        finally:
            if self.reporters is not None:
                self.reporters.close()
                self.reporters = None

    @property
    def lead(self) -> bool:
        """The process that reports, logs and writes the run's files (rank 0 under torchrun)."""
        return self.parallel is None or self.parallel.rank == 0

    @property
    def devices(self) -> int:
        """Data-parallel processes, one device each."""
        return 1 if self.parallel is None else self.parallel.world

    def log(self, record: dict) -> None:
        """One record into RUN/metrics.jsonl and to --report-to's reporters (the lead process only)."""
        if not self.lead:
            return
        self.run.append_metrics(record)
        if self.reporters is not None:
            self.reporters.log(record["step"], record)

    def stop(self) -> None:
        """End `train` after the step under way is committed (a RAM-tier store is saved then): a listener may
        call it. `resume` continues the run from there."""
        self.stopping = True

    # --- training ------------------------------------------------------------------------------------------------
    def train(self) -> Trained:
        """Steps until --steps (or `stop`), evaluating every --eval-every steps and keeping every --save-every
        step; then the run's trace is written to its folder. The closing evaluation and sample are `finish`'s."""
        cfg, trainer = self.cfg, self.trainer
        first = trainer.step_count
        seconds, learned, rss_peak = 0.0, 0, 0
        peak = self.peak_flops()
        attempts = 0  # consecutive skipped attempts at the same step
        if evaluation_due(cfg, first):  # step 0's: the baseline every later evaluation is read against
            self.evaluate()  # (or the committed step's, where a kill came before it was logged)
        self._keep_missed()
        cpu_cache.trim()  # what set-up freed leaves the process: the steps' resident set is theirs
        self.stopping = False
        while trainer.step_count < cfg.steps and not self.stopping:
            # Committed with this step: the tokenizer's files (checked on resume) and where the data order is (GRPO's
            # loop adds its rollout).
            trainer.extra_state = {"tokenizer": self.tokenizer_checksum}
            if self.stream is not None:
                ids, labels, positions, mask = next(self.stream)
                trainer.extra_state["data"] = self.stream.state_dict()
            begin = time.perf_counter()
            step = trainer.step_count + 1
            window = trainer.ledger.open_window()  # this step's own peak, as the trace's spans of it record it
            if cfg.trainer.objective.preference:  # a row of the stream is a pair: chosen and rejected, side by side
                reference = self.reference_of(ids, labels)
                ids, labels = pair_rows_of(ids), pair_rows_of(labels)
            rollout: dict[str, Any] = {}
            try:
                if self.grpo is not None:  # the rollout is timed and charged with its step
                    rollout = self.grpo.step()
                    assert self.grpo.rows is not None  # the step's rows
                    loss, (ids, labels) = rollout.pop("loss"), self.grpo.rows
                else:
                    loss = trainer.step(ids, labels, positions, mask) if not cfg.trainer.objective.preference else \
                        trainer.step(ids, labels, reference=reference)
            finally:
                step_peak = trainer.ledger.close_window(window).peak
            elapsed = time.perf_counter() - begin
            seconds += elapsed
            rss, mark = resident_set()
            # The kernel's mark is its per-CPU estimate: where kept buffers hold the resident set at its peak, a
            # later read can fall a few pages below an earlier one. The run's peak so far does not fall.
            rss_peak = max(rss_peak, mark)
            skipped = trainer.step_count < step  # --nonfinite skip: nothing committed, the next batch tries step again
            # A skipped attempt is logged under the step it tried, without its non-finite loss (not valid JSON).
            outcome = {"skipped": True} if skipped else {"loss": loss, "grad_norm": trainer.grad_norm,
                                                         "schedule": trainer.last_schedule,
                                                         "redone": trainer.last_redone, **trainer.metrics}
            # Learned tokens (what the loss covers), not padding or prompts; MFU counts every position computed.
            tokens = learned_tokens(labels)
            record = {"step": step, **outcome,
                      "lr": trainer.tc.schedule.lr_at(step, trainer.tc.optimizer.lr),
                      "tokens_per_s": tokens / elapsed, "step_s": elapsed,
                      **({} if peak is None else {"mfu": self.model_flops(*ids.shape) / elapsed / peak[0]}),
                      "device_peak_bytes": step_peak, "host_rss_bytes": rss, "host_rss_peak_bytes": rss_peak,
                      **{k: v for k, v in rollout.items() if k != "step"}}
            self.log(record)
            if self.grpo is not None and self.lead and not skipped:  # a sample: the first prompt's completions
                self.run.append_completions({"step": step, **self.grpo.sample()})
            attempts = attempts + 1 if skipped else 0
            if attempts == MAX_SKIPPED_ATTEMPTS:
                raise StreamerError(f"step {step} was non-finite on {attempts} batches in a row, so --nonfinite skip "
                                    f"cannot make progress; the run keeps step {step - 1}: lower --lr or check the "
                                    "data, then run the same command again")
            self.events("step", step=step, record=record)
            if skipped:
                self.events("note", f"step {step} skipped: non-finite loss or gradient (--nonfinite skip); the next "
                                    "batch tries it again", step)
                continue
            learned += tokens
            if not cfg.trainer.step.store.state.durable and (step % cfg.save_interval == 0 or step == cfg.steps
                                                             or self.stopping):
                trainer.save()  # the RAM tier is durable only when saved
            kept = cfg.keeps() and step % cfg.save_interval == 0
            eval_loss = None
            if (cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps) or (kept and cfg.keep_best):
                eval_loss = self.evaluate()
            if kept:
                keep(self, eval_loss)
        trained = trainer.step_count - first
        return Trained(trained, seconds, learned, self._write_trace(trained) if trained else None)

    def _write_trace(self, trained: int) -> int | None:
        """The trace of this session's steps into the run folder (before the closing evaluation and sample, whose
        spans would otherwise join the last step's); its step of the highest device peak."""
        if not self.lead:
            return None
        cfg, last, trace = self.cfg, self.trainer.step_count, self.trainer.trace
        trace.meta.update(model=cfg.from_pretrained or cfg.model, run=str(self.run.root), batch=cfg.batch,
                          seq=cfg.seq, grad_accum=cfg.trainer.step.grad_accum, activations=cfg.trainer.step.activations,
                          dtype=cfg.trainer.step.precision.compute, store=cfg.trainer.step.store.tier,
                          steps=[last - trained + 1, last])
        top = trace.peak_step()  # the step `streamer trace` shows by default
        assert top is not None  # steps were trained
        self.run.write_trace(trace, top)
        return top

    def finish(self) -> str | None:
        """The closing evaluation (logged once) and the sample of --sample-tokens after --sample-prompt: its text,
        in the lead process (None without one)."""
        self.evaluate()
        cfg = self.cfg
        # With the state sharded a unit's weights are all-gathered: every process takes part in the (seeded) sample.
        sharded = self.parallel is not None and self.parallel.sharded
        if not self.lead and not sharded:
            return None
        prompt = cfg.sample_prompt or ""  # start and resume set it
        prompt_ids = self.tokenizer.prompt_ids(prompt) or [self.tokenizer.eos_id]
        new_tokens = min(cfg.sample_tokens, self.trainer.cfg.attention().context()[0] - len(prompt_ids))
        if new_tokens <= 0:
            return None
        text = self.generate(prompt, Sampling(new_tokens, temperature=0.8, top_p=0.95,
                                                               seed=cfg.trainer.seed))
        return text if self.lead else None

    def generate(self, prompt: str, sampling: Sampling | None = None) -> str:
        """The text the model generates after `prompt` (default sampling: greedy, 40 tokens)."""
        return complete(self.trainer, self.tokenizer, prompt, sampling or Sampling())

    def evaluate(self) -> float | None:
        """Mean loss per predicted token over the first --eval-batches held-out batches (`streamer eval`'s figure),
        logged with perplexity; None without held-out data."""
        if self.held_out is None:
            return None
        if self.evaluated is not None and self.evaluated[0] == self.trainer.step_count:
            return self.evaluated[1]  # --keep-best evaluated the last step already
        cfg = self.cfg
        # The trainer splits a batch over the processes, then into grad_accum micro-batches.
        split = cfg.trainer.step.grad_accum * self.devices
        reduce = float if self.parallel is None else self.parallel.mean
        step = self.trainer.step_count
        if cfg.trainer.objective.preference:
            loss, metrics = self._evaluate_pairs(split, reduce)
            record = {"step": step, "eval_loss": loss, **{f"eval_{k}": v for k, v in metrics.items()}}
            line = f"step {step}: eval loss {loss:.3f}, rewards/accuracies {metrics['rewards/accuracies']:.2f}"
        else:
            mean, _ = evaluate_dataset(self.trainer, self.held_out, cfg.batch, cfg.eval_batches, split, reduce)
            if mean is None:
                return None
            loss = mean
            record = {"step": step, "eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700))}
            line = f"step {step}: eval loss {loss:.3f}, perplexity {record['eval_perplexity']:,.1f}"
        self.evaluated = (step, loss)
        if self.logged != step:  # evaluated again (its loss ranks --keep-best), not read back from the log
            self.log(record)
            self.events("evaluated", line, step, record)
        return loss

    def _evaluate_pairs(self, split: int, reduce: Callable[[float], float]) -> tuple[float, dict[str, float]]:
        """DPO's mean loss and TRL's metrics (rewards/*, logps/*) over the pairs of the first --eval-batches
        held-out batches, each cut to a multiple of `split` pairs (`_check_held_out` leaves at least one)."""
        assert self.held_out is not None
        total, sums, pairs = 0.0, dict[str, float](), 0
        for i, (ids, labels, _, _) in enumerate(self.held_out.batches(self.cfg.batch)):
            usable = ids.shape[0] - ids.shape[0] % split
            if i == self.cfg.eval_batches or usable == 0:
                break
            ids, labels = ids[:usable], labels[:usable]
            loss = self.trainer.evaluate(pair_rows_of(ids), pair_rows_of(labels),
                                         reference=self.reference_of(ids, labels))
            total += reduce(loss) * usable
            for name, value in self.trainer.eval_metrics.items():
                sums[name] = sums.get(name, 0.0) + value * usable
            pairs += usable
        return total / pairs, {name: value / pairs for name, value in sums.items()}

    def reference_of(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """The reference log-probabilities of a batch of pair rows (`pair_dataset`'s): every chosen row's, then
        every rejected row's, as `StreamingTrainer.step` takes them; None where the step computes them (LoRA)."""
        if not _precomputes_reference(self.cfg):
            return None
        found = torch.stack([self.references[row_key(i, lab)]  # (pairs, 2)
                             for i, lab in zip(ids, labels, strict=True)])
        return torch.cat([found[:, 0], found[:, 1]])

    def _keep_missed(self) -> None:
        """Keep the step the run continues from where a kill came between its commit and its keep (a --save-every
        step not kept): the same decision, on the same kept steps and eval loss, as the uninterrupted run's."""
        cfg, step = self.cfg, self.trainer.step_count
        if not keep_due(cfg, step, self.trainer.kept()):
            return
        # Its evaluation is logged once: one a kill left logged is the session's own (`Session.evaluated`).
        keep(self, self.evaluate() if cfg.keep_best else None)

    def peak_flops(self) -> tuple[float, str] | None:
        """(FLOP/s, what it is): one device's dense peak in the run's compute dtype that MFU is read against, the
        run's target's (the --price-on preset, else this cpu's matmul rate measured by its calibration); None where
        none is known."""
        target = self.trainer.target()
        dtype = dtype_name(self.trainer.tc.compute_dtype)
        if target is None or dtype not in target.flops:
            return None
        return target.flops_for(dtype), f"{target.name}'s {dtype} peak {target.flops_for(dtype) / 1e9:,.1f} GFLOP/s"

    def model_flops(self, batch: int, seq: int) -> int:
        """One device's model FLOPs in a step of `batch` rows (the global batch, split over the processes)."""
        return step_model_flops(self.trainer.cfg, batch // self.devices, seq)


def keep(s: Session, eval_loss: float | None) -> None:
    """Keep the step `s` just committed (a --save-every step) and let go of the kept steps that --keep-last and
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
    s.events("kept", f"step {step} kept (kept steps: {', '.join(map(str, sorted(held)))})", step)


def evaluation_due(cfg: RunConfig, step: int) -> bool:
    """Whether a run evaluates at `step` before training on: before the first step, every --eval-every steps, and
    at each --save-every step --keep-best ranks (the last step's evaluation is the closing one, `finish`'s)."""
    if step >= cfg.steps:
        return False
    if step == 0:
        return cfg.eval_every > 0
    return (cfg.eval_every > 0 and step % cfg.eval_every == 0) or (cfg.keep_best and step % cfg.save_interval == 0)


def final_evaluation_missing(cfg: RunConfig, run: RunDir, step: int) -> bool:
    """Whether a run at its last step, with held-out data, has no evaluation of it logged: a kill came between
    the step's commit and the closing evaluation."""
    held_out = cfg.data.eval_data is not None or cfg.data.eval_fraction > 0
    return held_out and step == cfg.steps and not any(
        r.get("step") == step and "eval_loss" in r for r in run.read_metrics())


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


# --- preference pairs (--method dpo) ------------------------------------------------------------------------
def pair_dataset(path: str, tokenizer: Tokenizer, seq: int, data: DataConfig | None = None) -> Dataset:
    """TRL-format preference pairs (prompt/chosen/rejected, conversational, or an implicit prompt) as a Dataset of
    one row per pair: its chosen row and its rejected row side by side, (pairs, 2 x seq), each as TRL's collator
    makes it (`streamer.io.preference`: cut to --max-length, default --seq, as --truncation-mode says; a prompt
    over --max-prompt-length), padded to --seq. So BatchStream orders, splits and resumes pairs as it does
    sequences; `pair_rows_of` makes a batch of them the trainer's rows. Under keep_start a pair whose prompt fills
    --max-length is dropped, as TRL drops it."""
    data = data or DataConfig()
    max_length = data.max_length or seq
    pairs = read_pairs(path)
    tokenized = tokenize_pairs(pairs, tokenizer, max_length, data.truncation_mode, data.max_prompt_length)
    if not tokenized:
        raise RunError(f"every pair's prompt in {path} fills --max-length {max_length} tokens, leaving no "
                       "completion; raise --max-length (and --seq), or cut prompts with --truncation-mode keep_end")
    ids, labels = pair_rows(tokenized, tokenizer.eos_id, max_length, seq, data.truncation_mode)
    return Dataset(torch.cat(ids.chunk(2), dim=1), torch.cat(labels.chunk(2), dim=1),
                   dropped=len(pairs) - len(tokenized))


def _precomputes_reference(cfg: RunConfig) -> bool:
    """--method dpo with full fine-tuning: the reference log-probabilities come from one pass before step 1, kept
    in the run folder (TRL's precompute_ref_log_probs). With LoRA each step computes its own on the units it loads
    (ObjectiveConfig.reference_in_step)."""
    objective = cfg.trainer.objective
    return objective.preference and not objective.reference_in_step(cfg.trainer.lora.enabled)


def pair_rows_of(rows: torch.Tensor) -> torch.Tensor:
    """A batch of `pair_dataset` rows (pairs, 2 x seq) as the trainer's DPO rows: every chosen row, then every
    rejected row (2 x pairs, seq)."""
    return torch.cat(rows.chunk(2, dim=1))


def row_key(ids: torch.Tensor, labels: torch.Tensor) -> bytes:
    """A pair row's identity: its tokens and labels (equal rows have equal reference log-probabilities)."""
    return ids.numpy().tobytes() + labels.numpy().tobytes()


def reference_pass(trainer: StreamingTrainer, data: Dataset, batch: int) -> torch.Tensor:
    """Each pair's reference log-probabilities (chosen, rejected), (pairs, 2) fp32: forward passes of `batch` pairs
    at a time, the step's own micro-batches (`StreamingTrainer.reference_logps`: LoRA's base with the adapters
    off, else the weights before the first step, as TRL's precompute_ref_log_probs). The last batch is filled up
    from the first pairs, so every pass splits as a step does."""
    out = []
    for start in range(0, len(data), batch):
        index = torch.arange(start, start + batch) % len(data)
        ids, labels = data.input_ids[index], data.labels[index]
        rows = trainer.reference_logps(pair_rows_of(ids), pair_rows_of(labels))
        out.append(torch.stack(rows.chunk(2), dim=1)[:min(batch, len(data) - start)])
    return torch.cat(out)


def _pair_texts(pair: Pair) -> list[str]:
    """The text of a pair's fields, each message's content for a conversation (what a BPE trained here learns)."""
    fields = (pair.prompt, pair.chosen, pair.rejected)
    if not pair.conversational:
        return [text for text in fields if isinstance(text, str)]
    return [message["content"] for messages in fields if not isinstance(messages, str) for message in messages]


def evaluate_dataset(trainer: StreamingTrainer, dataset: Dataset, batch: int, batches: int | None = None,
                     split: int = 1, reduce: Callable[[float], float] = float) -> tuple[float | None, int]:
    """(mean loss per predicted token or None where none is predicted, predicted tokens) over the first `batches`
    batches of `dataset` (default: all), each cut to a multiple of `split` rows (the processes x micro-batches the
    trainer splits it into); `reduce` gives the global batch's loss from this process's (data parallel).

    Each batch's mean is weighted by the tokens it predicts, so the result does not depend on the batch size or
    on a short last batch (a prompt/completion sequence predicts only its completion).
    """
    total, tokens = 0.0, 0
    for i, (ids, labels, positions, mask) in enumerate(dataset.batches(batch)):
        usable = ids.shape[0] - ids.shape[0] % split
        if i == batches or usable == 0:
            break
        count = learned_tokens(labels[:usable])
        if count:
            loss = trainer.evaluate(ids[:usable], labels[:usable], None if positions is None else positions[:usable],
                                    None if mask is None else mask[:usable])
            total += reduce(loss) * count
            tokens += count
    return (total / tokens if tokens else None), tokens


def open_trainer(run: RunDir, overrides: dict[str, Any] | None = None, step: int | None = None) -> StreamingTrainer:
    """The run's trainer at its last committed step, or at the kept `step`, for reading (the folder may be
    read-only): to evaluate, generate or export; `overrides` replace trainer settings (device, budget)."""
    cfg, overrides = run.read_config(), overrides or {}
    device = str(overrides.get("device", cfg.trainer.device.device))
    if device.startswith("cuda") and not torch.cuda.is_available():
        which = f"--device {device}" if "device" in overrides else f"{run.root} trained on {device}, and"
        raise RunError(f"{which} but torch sees no CUDA GPU here; pass --device cpu")
    saved = cfg.replace(device=device).trainer.to_dict()
    return StreamingTrainer.open(run.store_to_read(), overrides={**saved, **overrides}, read_only=True, step=step)


# --- starting a run ----------------------------------------------------------------------------------------------
def start(cfg: RunConfig, listener: Listener | None = None, store_line: str | None = None) -> Session:
    """A new run of `cfg`: build the tokenizer and data, create the store in --run-dir (default:
    runs/<name>-<time>), write config.toml. `store_line` says why the store is where it is (default: its tier).

    Set-up marks the folder (RunDir.SETUP_MARK) until config.toml is written, so a rerun knows a set-up that was
    killed part-way for its own and starts it again. A --run-dir holding a run already is `continue_run`'s.
    """
    events = Events(listener)
    cfg = cfg.with_absolute_paths()  # a relative --run-dir names the run it holds
    check_startable(cfg)
    if cfg.run_dir is not None and RunDir.is_run(cfg.run_dir):
        raise RunError(f"--run-dir {cfg.run_dir} holds a run already; continue it with `streamer train --resume "
                       f"{cfg.run_dir}` or choose a new --run-dir")
    parallel = _join(cfg, events)
    cfg = cfg.replace(dtype=_compute_dtype(cfg, parallel, events))  # config.toml records it: resume keeps it
    events("note", store_line or f"store: {cfg.trainer.step.store.tier}")
    cfg = cfg.replace(run_dir=cfg.run_dir or _default_run_dir(cfg))
    cfg = cfg.with_absolute_paths()
    world = 1 if parallel is None else parallel.world
    model_cfg = fit_vocabulary(cfg, cfg.model_config())
    _check_seq(cfg, model_cfg)
    cfg.check_lora_targets(model_cfg)
    cfg.check_expert_groups(model_cfg, world)
    cfg, changed = check_host_resources(cfg, model_cfg)  # config.toml records a change: resume keeps it
    if changed is not None:
        events("note", changed)
    cfg, grouped = fit_expert_groups(model_cfg, cfg, world)
    if grouped is not None:  # config.toml records it: resume keeps it
        events("note", grouped)
    check_fits(model_cfg, cfg, world)
    assert cfg.run_dir is not None  # resolved before a run starts
    run, lead = RunDir(Path(cfg.run_dir)), parallel is None or parallel.rank == 0

    def first_files() -> tuple[Tokenizer, Dataset]:
        """Tokenizer and data are checked before the run directory exists, so a bad input leaves nothing."""
        tokenizer = _tokenizer(cfg, model_cfg)
        dataset = _dataset(cfg, tokenizer)
        _check_held_out(cfg, dataset, tokenizer, world)
        if cfg.trainer.objective.grpo:
            _check_prompts(cfg, tokenizer)
        RunDir.create(run.root)
        try:
            tokenizer.save(run.tokenizer)
        except BaseException:
            _discard(run)
            raise
        return tokenizer, dataset

    events("phase", "tokenizer and data")
    made = _together(parallel, first_files, everyone=False)
    tokenizer = made[0] if made is not None else load_tokenizer(run.tokenizer)  # the others read the lead's
    dataset = made[1] if made is not None else _dataset(cfg, tokenizer)
    train_set, held_out = _split(cfg, dataset, tokenizer)
    _say_long_examples(cfg, dataset, held_out, events)
    # config.toml records both: the steps --epochs gives and the sample prompt derived from the data.
    cfg = _epoch_steps(cfg, len(train_set)).replace(sample_prompt=_sample_prompt(cfg, tokenizer))
    trainer, grpo = None, None
    try:
        tc = cfg.trainer
        events("phase", "importing the checkpoint" if cfg.from_pretrained else "initialising the store")
        trainer = _together(parallel, lambda: (
            StreamingTrainer.from_pretrained(cfg.from_pretrained, tc, run.store) if cfg.from_pretrained
            else StreamingTrainer(model_cfg, tc, run.store)), undo=StreamingTrainer.close)
        assert trainer is not None  # every process builds it
        if not cfg.trainer.step.store.state.durable:
            # Step 0 on disk in every process before config.toml exists: what a RAM-tier run killed
            # before its first --save-every save resumes from.
            _together(parallel, trainer.save)
        reference = None
        if _precomputes_reference(cfg):  # before step 1, and kept: a killed run resumes with the same ones
            events("phase", "the reference's log-probabilities")
            reference = {name: reference_pass(trainer, data, cfg.batch).tolist()
                         for name, data in (("train", train_set), ("held_out", held_out)) if data is not None}
            if lead:
                run.write_reference(reference)
        grpo = _grpo_loop(cfg, run, trainer, tokenizer, new=True)
        if lead and cfg.from_pretrained and not is_gguf(cfg.from_pretrained):
            run.write_source_config(read_hf_json(Path(cfg.from_pretrained)))  # what its export carries
        if lead:
            run.write_config(cfg)  # the run exists from here on
            run.finish_setup()
    except BaseException:
        if trainer is not None:
            trainer.close()
        if grpo is not None and grpo.reference is not None:
            grpo.reference.close()
        if lead:
            _discard(run)  # a run that never started would otherwise block its --run-dir name
        raise
    stream = None if cfg.trainer.objective.grpo else BatchStream(train_set, cfg.batch, cfg.trainer.seed)
    return Session(cfg, run, trainer, tokenizer, stream, held_out, parallel, events,
                   references=_references(cfg, run, train_set, held_out, reference), grpo=grpo)


def check_startable(cfg: RunConfig) -> None:
    """What refuses `cfg` before anything else is looked at: a step the runtime cannot make, a method `streamer
    train` does not run, a --report-to whose package is missing."""
    check_runnable(cfg.trainer.step)
    if cfg.trainer.objective.preference and cfg.data.data is None:
        raise RunError("--method dpo trains on preference pairs; pass --data FILE of prompt/chosen/rejected records "
                       "(TRL's format)")
    if cfg.trainer.objective.preference and cfg.data.pack:
        raise RunError("--method dpo reads one pair a row; drop --pack")
    if cfg.trainer.objective.grpo:
        _check_grpo(cfg)
    data = cfg.data
    if cfg.trainer.objective.preference and (data.max_length or 0) > cfg.seq:
        raise RunError(f"--max-length {data.max_length} is over --seq {cfg.seq}, the length every row is padded "
                       "to; lower --max-length or raise --seq")
    dpo_only = [f for f, given in (("--max-length", data.max_length is not None),
                                   ("--truncation-mode", data.truncation_mode != "keep_start"),
                                   ("--max-prompt-length", data.max_prompt_length is not None)) if given]
    if dpo_only and not cfg.trainer.objective.preference:
        raise RunError(f"{dpo_only[0]} cuts DPO's pairs, read with --method dpo only; drop it (--seq cuts examples)")
    cfg.report.check_installed()


def resume(path: str | Path, listener: Listener | None = None, **changes: Any) -> Session | None:
    """Continue the run in folder `path` from its last committed step, with the data order where that step left
    it; `changes` are settings by flat name that may change on a resume (`RESUMABLE`: steps, epochs, lr, ...).
    None (and nothing written) where the run is already at --steps."""
    run = RunDir.open(absolute(str(path)))
    saved = run.read_config()
    cfg = saved.replace(**run_length(changes, changes), run_dir=str(run.root)).with_absolute_paths()
    now, before = cfg.flat(), saved.flat()
    fixed = [k for k in changes if k not in RESUMABLE and now[k] != before[k]]
    if fixed:
        flags = ", ".join(f"{flag(k)} {shown(now[k])} (the run's: {shown(before[k])})" for k in fixed)
        raise RunError(f"{flags} cannot change when resuming {path} (the model, data order and store depend on "
                       f"them); only {', '.join(flag(k) for k in RESUMABLE)} can, "
                       "or start a new --run-dir")
    return continue_run(run, cfg, listener)


def shown(value: object) -> str:
    """A setting's value as its flag takes it: `--betas 0.9 0.95`."""
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def run_length(changes: dict, named: Collection[str]) -> dict:
    """The RESUMABLE `changes` a continued run takes: --steps named without --epochs ends its --epochs, and
    both named at once is an error (as for a new run)."""
    if {"steps", "epochs"} <= set(named):
        raise RunError("--epochs conflicts with --steps: both set the run's length; give one of them")
    return {**changes, "epochs": None} if "steps" in named else changes


def continue_run(run: RunDir, cfg: RunConfig, listener: Listener | None = None,
                 rerun: bool = False) -> Session | None:
    """Open `run` at its last committed step with settings `cfg` (its own, but for RESUMABLE ones); None (and
    nothing written) if it is already at --steps. `rerun`: the run was named by --run-dir, not --resume."""
    events = Events(listener)
    cfg.report.check_installed()
    run.refuse_links()
    parallel = _join(cfg, events)
    # The run's own dtype; say so where it is emulated.
    dtype = resolve_compute_dtype(cfg.trainer.device.device, cfg.trainer.step.precision.compute)
    if dtype.emulated:
        events("note", dtype.reason)
    world = 1 if parallel is None else parallel.world
    if run.processes() != world:
        raise RunError(f"{run.root} was trained by {run.processes()} process(es) and this is {world}; resume it "
                       f"with the same number (for more than one: torchrun with --nnodes x --nproc-per-node = "
                       f"{run.processes()})")
    done = run.committed_step()
    _check_committed(run, cfg)
    tokenizer = run.load_tokenizer()  # its files checked before anything is written
    dataset, split, grpo = None, None, None
    if cfg.epochs is not None:  # the steps follow from the data
        dataset = _dataset(cfg, tokenizer)
        split = _split(cfg, dataset, tokenizer)
        cfg = _epoch_steps(cfg, len(split[0]))
    past = f"past --steps {cfg.steps}" if done > cfg.steps else "finished"
    interrupted = run.update_interrupted()
    if done >= cfg.steps and not interrupted and not keep_due(cfg, done, run.kept()) \
            and not final_evaluation_missing(cfg, run, done):
        events("note", f"{run.root} is at step {done}, {past}: nothing to train and nothing was changed; "
                       "raise --steps to continue it")
        return None
    lead = parallel is None or parallel.rank == 0
    # Opening rolls forward a step a kill interrupted (a reading command refuses the run until then), or goes
    # back to the newest intact kept step where the last commit is damaged.
    trainer = _together(parallel, lambda: _open(run, cfg), undo=StreamingTrainer.close)
    assert trainer is not None  # every process opens it
    try:
        for line in (trainer.writing.kept_damage, trainer.writing.fell_back):
            if line is not None:
                events("note", line)
        if lead:
            run.keep_metrics_through(trainer.step_count, trainer.losses, trainer.tc)
        finished = trainer.step_count >= cfg.steps
        if finished and interrupted and lead:  # the trace of this invocation, which `streamer trace` reads
            trace = trainer.trace
            trace.meta.update(run=str(run.root), steps=[done, done], rolled_forward=True)
            run.write_trace(trace, done)
        keeping = finished and keep_due(cfg, trainer.step_count, trainer.kept())
        evaluating = finished and final_evaluation_missing(cfg, run, trainer.step_count)
        if finished and not (keeping or evaluating):
            trainer.close()
            events("note", f"{run.root} is at step {done}, {past}: nothing to train and finished step {done}'s "
                           "update, which a kill interrupted; raise --steps to continue it")
            return None
        if keeping:  # the session only keeps it (`Session.train`'s keep of a missed step)
            events("note", f"{run.root} is at step {done}, {past}: nothing to train, but a kill came before step "
                           f"{done} was kept; keeping it")
        if evaluating:  # the session only makes its closing evaluation
            what = f"finished step {done}'s update, which a kill interrupted, and" if interrupted else \
                "a kill came before its closing evaluation:"
            events("note", f"{run.root} is at step {trainer.step_count}, finished: {what} evaluating it")
        if rerun and not finished:
            events("note", f"{run.root} holds this run at step {trainer.step_count}: continuing it to step "
                           f"{cfg.steps}")
        cfg = cfg.replace(sample_prompt=_sample_prompt(cfg, tokenizer))
        dataset = _dataset(cfg, tokenizer) if dataset is None else dataset
        train_set, held_out = split or _split(cfg, dataset, tokenizer)
        _say_long_examples(cfg, dataset, held_out, events)
        grpo = _grpo_loop(cfg, run, trainer, tokenizer)  # its prompts follow from the step
        stream = None if grpo is not None else BatchStream(train_set, cfg.batch, cfg.trainer.seed)
        if stream is None:
            if lead:
                run.keep_completions_through(trainer.step_count)
        elif "data" in trainer.extra_state:
            stream.load_state_dict(trainer.extra_state["data"])
        elif trainer.step_count:
            raise RunError(f"{run.store} holds no data position (it was not written by `streamer train`); "
                           "start a new run with --from-pretrained after exporting it")
        references = _references(cfg, run, train_set, held_out)
        if lead:
            run.write_config(cfg)
            run.finish_setup()  # a set-up killed after writing config.toml left its mark
    except BaseException:
        trainer.close()
        if grpo is not None and grpo.reference is not None:
            grpo.reference.close()
        raise
    return Session(cfg, run, trainer, tokenizer, stream, held_out, parallel, events, references=references,
                   grpo=grpo)


def _references(cfg: RunConfig, run: RunDir, train_set: Dataset, held_out: Dataset | None,
                kept: dict[str, Any] | None = None) -> dict[bytes, torch.Tensor]:
    """--method dpo: each pair row's reference log-probabilities, `kept` (a new run's, which every process
    computed) or as the run folder keeps them, by the row's tokens (`Session.reference_of`); none for sft, nor
    for LoRA, whose steps compute their reference themselves."""
    if not _precomputes_reference(cfg):
        return {}
    kept = run.read_reference() if kept is None else kept
    found: dict[bytes, torch.Tensor] = {}
    for name, data in (("train", train_set), ("held_out", held_out)):
        if data is None:
            continue
        values = torch.tensor(kept.get(name, []), dtype=torch.float32)
        if values.shape != (len(data), 2):
            raise RunError(f"{run.reference} holds the reference log-probabilities of other data than --data's "
                           f"{name.replace('_', '-')} pairs ({len(data)}); start a new run")
        found.update((row_key(ids, labels), value) for ids, labels, value in
                     zip(data.input_ids, data.labels, values, strict=True))
    return found


def _open(run: RunDir, cfg: RunConfig) -> StreamingTrainer:
    """The run's trainer with this command's settings; a setting the trainer refuses (--expert-group-size, which
    only the store's model can check) is said under its flag, as a new run says it."""
    try:
        return StreamingTrainer.open(run.store, overrides=cfg.trainer.to_dict())
    except ConfigError as exc:
        if exc.key is None or exc.problem is None:
            raise
        raise SettingError(exc.key, exc.problem) from None


def _check_committed(run: RunDir, cfg: RunConfig) -> None:
    """The settings a resume may not change are the ones the store was trained with: config.toml could say
    otherwise (edited, or written by another run) and would change training silently."""
    try:
        committed = run.committed_settings()
    except StoreError:
        return  # opening the store says what is damaged (or goes back to a kept step)
    if committed is None:
        return
    before, now = flatten(committed), flatten(cfg.trainer)
    changed = [f"{flag(k)} {shown(now[k])} (the store's: {shown(before[k])})" for k in now
               if k in FLAGS and k not in RESUMABLE and now[k] != before[k]]
    if changed:
        raise RunError(f"{run.config} says {', '.join(changed)}, which cannot change when resuming; restore it from "
                       "a backup, or start a new --run-dir")


def _join(cfg: RunConfig, events: Events) -> DataParallel | None:
    """Under torchrun (WORLD_SIZE > 1): this process's place in the group; only rank 0 reports."""
    tc = cfg.trainer
    parallel = DataParallel.from_environment(tc.device.device, sharded=tc.step.data_parallel == "sharded",
                                             timeout_s=cfg.dist_timeout)
    if parallel is None:
        return None
    events.quiet = parallel.rank != 0
    if cfg.run_dir is None:
        raise RunError("under torchrun every process must use the same run directory: pass --run-dir DIR")
    if cfg.batch % (parallel.world * tc.step.grad_accum):
        raise RunError(f"--batch {cfg.batch} does not split over {parallel.world} processes x --grad-accum "
                       f"{tc.step.grad_accum}; use a multiple of {parallel.world * tc.step.grad_accum}")
    return parallel


def _compute_dtype(cfg: RunConfig, parallel: DataParallel | None, events: Events) -> str:
    """--dtype on this hardware (auto: bf16 where it is native and fast, else fp32), reported with its reason.
    Every process takes the lead's choice: their stores and gradient all-reduces must agree."""
    choice = resolve_compute_dtype(cfg.trainer.device.device, cfg.trainer.step.precision.compute)
    events("note", choice.reason)
    return choice.dtype if parallel is None else parallel.gather(choice.dtype)[0]


def _together(parallel: DataParallel | None, work: Callable[[], T], everyone: bool = True,
              undo: Callable[[T], None] | None = None) -> T | None:
    """Run `work` in every process (or only rank 0); if it fails in any, it fails in all, with one message.

    Without this a process whose setup failed would leave the others waiting for it in the first step.
    """
    if parallel is None:
        return work()
    result, error = None, None
    if everyone or parallel.rank == 0:
        try:
            result = work()
        except Exception as exc:  # every process must reach the gather below
            error = exc
    messages = parallel.gather(None if error is None else " ".join(str(error).split()))
    if error is not None:
        raise error
    failed = next((m for m in messages if m), None)
    if failed is not None:
        if undo is not None and result is not None:
            undo(result)
        raise RunError(f"another process failed: {failed}")
    return result


def _default_run_dir(cfg: RunConfig) -> str:
    base = Path("runs") / f"{cfg.name()}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)


def _discard(run: RunDir) -> None:
    """Remove what this invocation wrote into the run directory (it was new or empty)."""
    shutil.rmtree(run.root, ignore_errors=True)
    run.finish_setup()  # lets go of the set-up mark's lock


def _check_seq(cfg: RunConfig, model_cfg: ModelConfig) -> None:
    context, why = model_cfg.attention().context()
    if cfg.seq > context:
        raise RunError(f"--seq {cfg.seq} exceeds the model's context ({why}); use --seq {context} or less")


def fit_vocabulary(cfg: RunConfig, model_cfg: ModelConfig) -> ModelConfig:
    """The model to initialise: a model trained from scratch on a BPE trained here gets at least the MIN_VOCAB ids
    a byte-level BPE needs (gptj-debug's 256 embeddings cannot hold 256 bytes plus end-of-text)."""
    if cfg.from_pretrained is None and cfg.data.tokenizer is None and model_cfg.vocab_size < MIN_VOCAB:
        return replace(model_cfg, vocab_size=MIN_VOCAB)
    return model_cfg


def _tokenizer(cfg: RunConfig, model_cfg: ModelConfig) -> Tokenizer:
    """--tokenizer, else the --from-pretrained folder's, else a byte-level BPE trained on the data."""
    data = cfg.data
    source = data.tokenizer or cfg.from_pretrained
    if source is not None and is_gguf(source):
        tokenizer = gguf_tokenizer(source)  # the tokenizer transformers builds from the file
    elif source is not None:
        tokenizer = load_tokenizer(source)
    else:
        vocab = data.vocab_size or model_cfg.vocab_size
        if vocab < MIN_VOCAB:
            raise RunError(f"the model's vocab_size {model_cfg.vocab_size} cannot hold a byte-level BPE "
                           f"(>= {MIN_VOCAB} ids); pass --tokenizer or choose a model with a larger vocabulary")
        tokenizer = train_bpe(_texts(cfg), min(vocab, model_cfg.vocab_size))
    if data.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(data.chat_template)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise RunError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                       f"{model_cfg.vocab_size}; use a tokenizer made for this model or --vocab-size "
                       f"{model_cfg.vocab_size} or less")
    return tokenizer


def _texts(cfg: RunConfig) -> list[str]:
    data = cfg.data
    if data.data is None:
        return demo_corpus()
    if cfg.trainer.objective.preference:
        return [text for pair in read_pairs(data.data) for text in _pair_texts(pair) if text]
    if cfg.trainer.objective.grpo:
        return [record["prompt"] for record in read_prompts(data.data) if record["prompt"]]
    return [text for e in read_examples(data.data) for text in (e.text, e.completion) if text]


def _dataset(cfg: RunConfig, tokenizer: Tokenizer, path: str | None = None) -> Dataset:
    """--data (or the data file `path`) read at --seq: sequences, or with --method dpo pairs (`pair_dataset`)."""
    data, path = cfg.data, path or cfg.data.data
    if path is None:
        return tokenize(demo_corpus(), tokenizer, cfg.seq)
    if cfg.trainer.objective.preference:
        return pair_dataset(path, tokenizer, cfg.seq, data)
    if cfg.trainer.objective.grpo:  # nothing but the prompts: the rows are sampled in the loop (`_grpo_loop`)
        return prompt_dataset(path, tokenizer, cfg.seq)
    return load_dataset(path, tokenizer, cfg.seq, pack=data.pack, long_examples=data.long_examples)


def _split(cfg: RunConfig, dataset: Dataset, tokenizer: Tokenizer) -> tuple[Dataset, Dataset | None]:
    """(train, held-out): all of --data and --eval-data when it is given, else --eval-fraction of --data."""
    if cfg.data.eval_data is not None:
        return dataset, _dataset(cfg, tokenizer, cfg.data.eval_data)
    return dataset.split(cfg.data.eval_fraction, cfg.trainer.seed)


def _epoch_steps(cfg: RunConfig, sequences: int) -> RunConfig:
    """With --epochs N, --steps is N passes over the `sequences` of training data in global batches, rounded up:
    the last step takes the rows it lacks from the next epoch's order, as BatchStream crosses epochs."""
    if cfg.epochs is None:
        return cfg
    steps = -(-cfg.epochs * sequences // cfg.batch)
    try:
        return cfg.replace(steps=steps)
    except SettingError as exc:
        raise RunError(f"--epochs {cfg.epochs} of {sequences} sequences in batches of {cfg.batch} is {steps} "
                       f"steps, and with that {flag(exc.key)} {exc.problem}") from None


def _say_long_examples(cfg: RunConfig, dataset: Dataset, held_out: Dataset | None, events: Events) -> None:
    """One line per data file whose examples longer than --seq were truncated or dropped."""
    files = ((cfg.data.data, dataset), (cfg.data.eval_data, held_out if cfg.data.eval_data else None))
    for name, data in files:
        line = None if data is None else long_examples_line(data, cfg.seq, cfg.data.long_examples)
        if line is not None:
            events("note", f"{name}: {line}")


def _check_held_out(cfg: RunConfig, dataset: Dataset, tokenizer: Tokenizer, world: int) -> None:
    """Held-out data with fewer sequences than one evaluation batch needs is an error, not a run that silently
    never evaluates."""
    if cfg.data.eval_fraction == 0 and cfg.data.eval_data is None:
        return
    _, held_out = _split(cfg, dataset, tokenizer)
    needed = cfg.trainer.step.grad_accum * world  # an evaluation batch splits like a training batch
    got = 0 if held_out is None else len(held_out)
    if got < needed and cfg.data.eval_data is not None:
        raise RunError(f"--eval-data {cfg.data.eval_data} holds {got} sequences of --seq {cfg.seq} tokens and an "
                       f"evaluation needs {needed}; add held-out data or lower --seq")
    if got < needed:
        fix = (f"raise --eval-fraction to {min(0.5, needed / len(dataset)):.2g} or more, or pass"
               if len(dataset) > needed else "add data, lower --seq, or pass")
        raise RunError(f"--eval-fraction {cfg.data.eval_fraction} holds out {got} of the data's {len(dataset)} "
                       f"sequences of --seq {cfg.seq} tokens and an evaluation needs {needed}; {fix} "
                       "--eval-fraction 0 to train without evaluation")


def _sample_prompt(cfg: RunConfig, tokenizer: Tokenizer) -> str:
    """--sample-prompt, else the data's first prompt (a conversation's rendered by the chat template, or a
    document's first words): the demo's prompt fits only the demo."""
    if cfg.sample_prompt is not None:
        return cfg.sample_prompt
    if cfg.data.data is None:
        return DEFAULT_PROMPT
    if cfg.trainer.objective.grpo:
        prompt = read_prompts(cfg.data.data)[0]["prompt"]
        return prompt if isinstance(prompt, str) else chat_prompt(prompt, tokenizer, "the first prompt")
    if cfg.trainer.objective.preference:
        pair = read_pairs(cfg.data.data)[0]
        return pair.prompt if isinstance(pair.prompt, str) else chat_prompt(list(pair.prompt), tokenizer, pair.where)
    first = next(iter(read_examples(cfg.data.data)), None)
    return "" if first is None else prompt_of(first, tokenizer)


# --- GRPO (--method grpo) ----------------------------------------------------------------------------------------
def _check_grpo(cfg: RunConfig) -> None:
    """What a GRPO run needs beyond its settings' own checks: prompts, reward functions that load, and a step that
    holds whole groups; no held-out loss (its rows are sampled)."""
    objective = cfg.trainer.objective
    if cfg.data.data is None:
        raise RunError("--method grpo samples completions of prompts; pass --data FILE of records with a 'prompt' "
                       "field (TRL's prompt-only format)")
    if not objective.reward_specs():
        raise RunError("--method grpo needs --reward-funcs module:function (TRL's signature: f(prompts, "
                       "completions, **columns) -> one float per completion)")
    for name, given in (("pack", cfg.data.pack), ("epochs", cfg.epochs), ("eval_data", cfg.data.eval_data)):
        if given:
            raise RunError(f"--method grpo samples its rows, so {flag(name)} does not apply; drop it")
    if cfg.data.eval_fraction:
        raise RunError("--method grpo has no held-out loss (its rows are sampled): pass --eval-fraction 0")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and cfg.trainer.step.data_parallel == "sharded":
        # A sharded unit loads by an exchange, so every process would have to decode as many passes as the others.
        raise RunError("--method grpo under torchrun samples each process's rows on its own, which --data-parallel "
                       "sharded cannot (its units load by an exchange); use --data-parallel replicated")
    if objective.beta and not cfg.trainer.lora.enabled and cfg.from_pretrained is None:
        raise RunError("--beta > 0 needs the reference model: with LoRA the base with the adapters off, with full "
                       "fine-tuning the --from-pretrained checkpoint; pass --lora-rank, --from-pretrained or --beta 0")
    GRPOSettings.of(objective, cfg.batch, cfg.trainer.seed)
    _rewards(cfg)


def _rewards(cfg: RunConfig) -> Rewards:
    objective = cfg.trainer.objective
    return Rewards(objective.reward_specs(), objective.reward_weight_values())


def _check_prompts(cfg: RunConfig, tokenizer: Tokenizer) -> None:
    """Each prompt and its longest completion fit --seq (the rows the plan prices); else one line naming it."""
    room = cfg.seq - cfg.trainer.objective.max_completion_length
    assert cfg.data.data is not None
    for number, record in enumerate(read_prompts(cfg.data.data), start=1):
        length = len(prompt_tokens(tokenizer, record["prompt"], f"{cfg.data.data} record {number}"))
        if length > room:
            raise RunError(f"{cfg.data.data} record {number}'s prompt is {length} tokens and --seq {cfg.seq} leaves "
                           f"{room} beside --max-completion-length {cfg.trainer.objective.max_completion_length}; "
                           "raise --seq or shorten the prompt")


def _grpo_loop(cfg: RunConfig, run: RunDir, trainer: StreamingTrainer, tokenizer: Tokenizer,
               new: bool = False) -> GRPOLoop | None:
    """--method grpo's loop: --data's records, --reward-funcs, the settings, and with full fine-tuning and --beta
    the frozen reference in RUN/reference-store (made from --from-pretrained by a `new` run, else opened); None for
    the other methods."""
    if not cfg.trainer.objective.grpo:
        return None
    assert cfg.data.data is not None
    reference = None
    if cfg.trainer.objective.beta and not cfg.trainer.lora.enabled:
        assert cfg.from_pretrained is not None  # _check_grpo
        reference = frozen_reference(cfg.from_pretrained, cfg.trainer, run.reference_store) if new else \
            StreamingTrainer.open(run.reference_store, read_only=True)
    try:
        return GRPOLoop(trainer, tokenizer, read_prompts(cfg.data.data), _rewards(cfg),
                        GRPOSettings.of(cfg.trainer.objective, cfg.batch, cfg.trainer.seed), reference)
    except BaseException:
        if reference is not None:
            reference.close()
        raise


def prompt_dataset(path: str, tokenizer: Tokenizer, seq: int) -> Dataset:
    """GRPO's prompts as rows of --seq tokens, nothing learned in them: what the run's common set-up (the split, the
    long-example notes) reads; the steps' rows are sampled (`_grpo_loop`)."""
    prompts = [prompt_tokens(tokenizer, record["prompt"])[:seq] for record in read_prompts(path)]
    ids = torch.full((len(prompts), seq), tokenizer.eos_id, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    return Dataset(ids, torch.full_like(ids, IGNORE_INDEX))
