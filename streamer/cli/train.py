"""`streamer train`: settings -> tokenizer and data -> streamed training under a progress bar -> memory report.

A run is resumable at every committed step: the data order's position goes into `trainer.extra_state`,
which the store commits atomically with the step, so `--resume` sees exactly the batches an uninterrupted
run would have seen.
"""
from __future__ import annotations

import argparse
import errno
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Collection, Literal, TypeVar, overload

from rich.console import Console

from layers import ModelConfig
from streamer.advice import check_fits, fit_expert_groups, ledger_advice
from streamer.cli.flags import add_config_flag, add_run_flags, declare_command, given
from streamer.cli.main import RESUME_COMMAND
from streamer.cli.training import (Session, describe, final_evaluation_missing, keep_due, report, resume_command,
                                   train)
from streamer.console import make_console
from streamer.errors import ConfigError, StreamerError
from streamer.io.data import (BatchStream, DataConfig, Dataset, demo_corpus, load_dataset, long_examples_line,
                              prompt_of, read_examples, tokenize)
from streamer.io.tokenizer import MIN_VOCAB, Tokenizer, load_tokenizer, train_bpe
from streamer.reporting import Reporters
from streamer.resources import check_host_resources
from memory_model.settings import flag, flatten
from streamer.run import (DEFAULT_PROMPT, FLAGS, RESUMABLE, RunConfig, RunError, SettingError, absolute, read_toml,
                          resolve, store_choice)
from streamer.run_dir import RunDir
from streamer.runtime.distributed import DataParallel, leave_process_group
from streamer.runtime.hardware import resolve_compute_dtype
from streamer.runtime.step import check_runnable
from streamer.errors import StoreError
from streamer.store.slabfile import DiskFull
from streamer.trainer import StreamingTrainer

T = TypeVar("T")

EXAMPLES = """\
examples:
  streamer train                                   the demo (under 2 minutes on 2 cores)
  streamer train --steps 3 --run-dir /tmp/quick    a quick look; the same command again continues it
  streamer train --steps 6 --run-dir /tmp/quick    ... to step 6 (other settings than its own are refused)
  streamer train --from-pretrained ./gptj-hf --data summaries.jsonl --seq 512 --batch 8 --grad-accum 4 \\
      --lr 1e-5 --schedule cosine --warmup 20 --steps 300 --budget 3GiB --activations checkpoint
  streamer train --from-pretrained ./gptj-hf --data train.jsonl --pack --seq 512 --batch 8 --steps 100
  streamer train --config run.toml --steps 50      a TOML file of the same settings; flags win
  streamer train --resume runs/demo-20260101-120000 --steps 120

--data: a .txt file (blank lines separate documents) or .jsonl with {"text": ...} or
{"prompt": ..., "completion": ...} records (the loss covers the completion only). --pack puts several
examples in a sequence, each attending only to itself; --pack documents does the same for text documents.
Every run writes its resolved settings to RUN/config.toml. A run killed at any point (set-up included)
continues from its last committed step when the same command is run again. The host RAM and disk the
store needs are checked before anything is written."""


def declare(parser: argparse.ArgumentParser) -> None:
    declare_command(parser, train_command, "Train with streamed layers; with no arguments, the built-in demo.",
                    EXAMPLES)
    add_config_flag(parser)
    parser.add_argument("--resume", metavar="RUN", help="continue RUN from its last committed step")
    add_run_flags(parser)


def train_command(args: argparse.Namespace) -> int:
    explicit = given(args)
    console = make_console()
    session = resume(args.resume, explicit, args.config, console) if args.resume else \
        start(explicit, args.config, console)
    if session is None:  # the run is already at --steps: nothing was changed
        return 0
    session.trainer.ledger.hint_context["advise"] = ledger_advice(session.trainer.cfg, session.cfg, session.devices)
    RESUME_COMMAND[:] = [resume_command(str(session.run.root), session.parallel)]
    try:
        with session.trainer:
            if session.lead:
                session.reporters = Reporters(session.cfg.report, session.run.root,
                                              session.cfg.flat(),
                                              session.trainer.step_count)
            console.print(f"run [bold]{session.run.root}[/]: {describe(session)}")
            trained, seconds, learned = train(session, console)
            report(session, trained, seconds, learned, console)
        if session.parallel is not None:
            leave_process_group()
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM; main() prints these
        # main() reads these off the interrupt (a builtin exception, whose type declares neither) to say how to
        # continue
        vars(exc).update(resume_command=resume_command(str(session.run.root), session.parallel),
                         resumes_from=_resumes_from(session))
        raise
    except (DiskFull, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        root = session.run.root
        raise RunError(f"disk full while writing {exc.path if isinstance(exc, DiskFull) else exc.filename}; "
                       f"{root} keeps its last committed step: free space and continue with "
                       f"`{resume_command(str(root), session.parallel)}` (or the same command again)") from None
    finally:
        if session.reporters is not None:
            session.reporters.close()
    return 0


def _resumes_from(session: Session) -> str:
    """The step a stopped run continues from, as the interrupted line says it: the RAM tier's is its last save."""
    try:
        committed = session.run.committed_step()
    except StreamerError:  # the line still names the command that continues the run, which says what is wrong
        return "the last committed step"
    if session.cfg.trainer.step.store.tier != "ram":
        return f"step {committed}, the last committed step"
    lost = session.trainer.step_count - committed
    since = f"; the {lost} step(s) trained since are not kept" if lost > 0 else ""
    return f"step {committed}, the RAM-tier store's last save (--save-every {session.cfg.save_every}{since})"


# --- setting up ------------------------------------------------------------------------------------------------
def start(explicit: dict, config_file: str | None, console: Console) -> Session | None:
    """A new run: resolve the settings, build the tokenizer and data, create the store, write config.toml.

    A --run-dir that already holds a run with these settings is continued instead (rerunning a command after a
    kill continues it). Set-up marks the folder (RunDir.SETUP_MARK) until config.toml is written, so a rerun
    knows a set-up that was killed part-way for its own and starts it again.
    """
    cfg = resolve(explicit, config_file).with_absolute_paths()  # a relative --run-dir names the run it holds
    check_runnable(cfg.trainer.step)
    if cfg.trainer.objective.preference:
        raise RunError("--method dpo trains through the Python API for now (StreamingTrainer.reference_logps, then "
                       "step(..., reference=...)); `streamer train` reads no preference pairs yet: use --method sft")
    cfg.report.check_installed()
    if cfg.run_dir is not None and RunDir.is_run(cfg.run_dir):
        return _rerun(cfg, explicit, config_file, console)
    parallel = _join(cfg, console)
    cfg = cfg.replace(dtype=_compute_dtype(cfg, parallel, console))  # config.toml records it: resume keeps it
    console.print(store_choice(cfg, explicit, config_file), markup=False, highlight=False)
    cfg = cfg.replace(run_dir=cfg.run_dir or _default_run_dir(cfg))
    cfg = cfg.with_absolute_paths()
    model_cfg = fit_vocabulary(cfg, cfg.model_config())
    _check_seq(cfg, model_cfg)
    cfg.check_lora_targets(model_cfg)
    cfg.check_expert_groups(model_cfg, 1 if parallel is None else parallel.world)
    cfg, changed = check_host_resources(cfg, model_cfg)  # config.toml records a change: resume keeps it
    if changed is not None:
        console.print(changed, markup=False, highlight=False)
    cfg, grouped = fit_expert_groups(model_cfg, cfg, 1 if parallel is None else parallel.world)
    if grouped is not None:  # config.toml records it: resume keeps it
        console.print(grouped, markup=False, highlight=False)
    check_fits(model_cfg, cfg, 1 if parallel is None else parallel.world)
    assert cfg.run_dir is not None  # resolved before a run starts
    run, lead = RunDir(Path(cfg.run_dir)), parallel is None or parallel.rank == 0

    def first_files() -> tuple[Tokenizer, Dataset]:
        """Tokenizer and data are checked before the run directory exists, so a bad input leaves nothing."""
        tokenizer = _tokenizer(cfg, model_cfg)
        dataset = _dataset(cfg.data, tokenizer, cfg.seq)
        _check_held_out(cfg, dataset, tokenizer, 1 if parallel is None else parallel.world)
        RunDir.create(run.root)
        try:
            tokenizer.save(run.tokenizer)
        except BaseException:
            _discard(run)
            raise
        return tokenizer, dataset

    with console.status("tokenizer and data"):
        made = _together(parallel, first_files, everyone=False)
    # Only the lead made them (made is None elsewhere): every process reads the lead's tokenizer.
    tokenizer = made[0] if made is not None else load_tokenizer(run.tokenizer)
    dataset = made[1] if made is not None else _dataset(cfg.data, tokenizer, cfg.seq)
    train_set, held_out = _split(cfg, dataset, tokenizer)
    _say_long_examples(cfg, dataset, held_out, console)
    # config.toml records both: the steps --epochs gives and the sample prompt derived from the data.
    cfg = _epoch_steps(cfg, len(train_set)).replace(sample_prompt=_sample_prompt(cfg, tokenizer))
    trainer = None
    try:
        tc = cfg.trainer
        with console.status("importing the checkpoint" if cfg.from_pretrained else "initialising the store"):
            trainer = _together(parallel, lambda: (
                StreamingTrainer.from_pretrained(cfg.from_pretrained, tc, run.store) if cfg.from_pretrained
                else StreamingTrainer(model_cfg, tc, run.store)), undo=StreamingTrainer.close)
            if cfg.trainer.step.store.tier == "ram":
                # Step 0 on disk in every process before config.toml exists: what a RAM-tier run killed
                # before its first --save-every save resumes from.
                _together(parallel, trainer.save)
        if lead:
            run.write_config(cfg)  # the run exists from here on
            run.finish_setup()
    except BaseException:
        if trainer is not None:
            trainer.close()
        if lead:
            _discard(run)  # a run that never started would otherwise block its --run-dir name
        raise
    stream = BatchStream(train_set, cfg.batch, cfg.trainer.seed)
    return Session(cfg, run, trainer, tokenizer, stream, held_out, parallel)


def resume(path: str, explicit: dict, config_file: str | None, console: Console) -> Session | None:
    """Continue a run from its last committed step, with the data order where that step left it."""
    if config_file is not None or "run_dir" in explicit:
        raise RunError("--resume continues RUN with its own config.toml; drop --config and --run-dir "
                       "(flags such as --steps still apply)")
    run = RunDir.open(absolute(path))
    saved = run.read_config()
    cfg = saved.replace(**_length(explicit, explicit), run_dir=str(run.root)).with_absolute_paths()
    now, before = cfg.flat(), saved.flat()
    fixed = [k for k in explicit if k not in RESUMABLE and now[k] != before[k]]
    if fixed:
        flags = ", ".join(f"{flag(k)} {_shown(now[k])} (the run's: {_shown(before[k])})" for k in fixed)
        raise RunError(f"{flags} cannot change when resuming {path} (the model, data order and store depend on "
                       f"them); only {', '.join(flag(k) for k in RESUMABLE)} can, "
                       "or start a new --run-dir")
    return _continue(run, cfg, console)


def _rerun(cfg: RunConfig, explicit: dict, config_file: str | None, console: Console) -> Session | None:
    """`--run-dir DIR` naming an existing run: continue it if the settings are its own (but for RESUMABLE ones)."""
    assert cfg.run_dir is not None  # only a --run-dir naming a run is rerun
    run = RunDir.open(cfg.run_dir)
    saved = run.read_config()
    # Resolved as if the RESUMABLE settings were the run's own, so that a default derived from one of them
    # (the demo's warmup from --steps) does not count as a change.
    before = saved.flat()
    # The run's length is the command's if it names one, else the run's own --steps or --epochs.
    length = ("steps", "epochs") if {"steps", "epochs"} & set(explicit) else \
        ("steps",) if before["epochs"] is not None else ()
    same = resolve({**explicit, **{k: before[k] for k in RESUMABLE if k not in length}},
                   config_file).with_absolute_paths()
    if same.trainer.device.dtype == "auto":  # the run recorded what auto chose when it started
        same = same.replace(dtype=saved.trainer.device.dtype)
    now = same.flat()
    changed = [f"{flag(k)} {_shown(before[k])} there, {_shown(now[k])} here" for k in now
               if k not in RESUMABLE and now[k] != before[k]]
    if changed:
        raise RunError(f"--run-dir {run.root} holds a run with other settings ({'; '.join(changed)}); nothing was "
                       f"changed: continue it with `streamer train --resume {run.root}` or choose a new --run-dir")
    # As with --resume: the RESUMABLE settings this command names apply; the others stay the run's own (the
    # sample prompt derived from the data, say).
    named = set(explicit) | (set(read_toml(config_file)) if config_file is not None else set())
    changes = _length({k: cfg.flat()[k] for k in RESUMABLE if k in named}, named)
    return _continue(run, saved.replace(**changes, run_dir=os.path.abspath(run.root)), console, rerun=True)


def _shown(value: object) -> str:
    """A setting's value as its flag takes it: `--betas 0.9 0.95`."""
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _length(changes: dict, named: Collection[str]) -> dict:
    """The RESUMABLE `changes` a continued run takes: --steps named without --epochs ends its --epochs, and
    both named at once is an error (as for a new run)."""
    if {"steps", "epochs"} <= set(named):
        raise RunError("--epochs conflicts with --steps: both set the run's length; give one of them")
    return {**changes, "epochs": None} if "steps" in named else changes


def _continue(run: RunDir, cfg: RunConfig, console: Console, rerun: bool = False) -> Session | None:
    """Open the run at its last committed step; None (and nothing written) if it is already at --steps."""
    cfg.report.check_installed()
    run.refuse_links()
    parallel = _join(cfg, console)
    # The run's own dtype; say so where it is emulated.
    dtype = resolve_compute_dtype(cfg.trainer.device.device, cfg.trainer.device.dtype)
    if dtype.emulated:
        console.print(dtype.reason, markup=False, highlight=False)
    world = 1 if parallel is None else parallel.world
    if run.processes() != world:
        raise RunError(f"{run.root} was trained by {run.processes()} process(es) and this is {world}; resume it "
                       f"with the same number (for more than one: torchrun with --nnodes x --nproc-per-node = "
                       f"{run.processes()})")
    done = run.committed_step()
    _check_committed(run, cfg)
    tokenizer, dataset, split = None, None, None
    if cfg.epochs is not None:  # the steps follow from the data
        tokenizer = load_tokenizer(run.tokenizer)
        dataset = _dataset(cfg.data, tokenizer, cfg.seq)
        split = _split(cfg, dataset, tokenizer)
        cfg = _epoch_steps(cfg, len(split[0]))
    past = f"past --steps {cfg.steps}" if done > cfg.steps else "finished"
    interrupted = run.update_interrupted()
    if done >= cfg.steps and not interrupted and not keep_due(cfg, done, run.kept()) \
            and not final_evaluation_missing(cfg, run, done):
        console.print(f"{run.root} is at step {done}, {past}: nothing to train and nothing was changed; "
                      "raise --steps to continue it", markup=False, highlight=False)
        return None
    lead = parallel is None or parallel.rank == 0
    # Opening rolls forward a step a kill interrupted (a reading command refuses the run until then), or goes
    # back to the newest intact kept step where the last commit is damaged.
    trainer = _together(parallel, lambda: _open(run, cfg), undo=StreamingTrainer.close)
    try:
        for line in (trainer.writing.kept_damage, trainer.writing.fell_back):
            if line is not None:
                console.print(line, markup=False, highlight=False)
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
            console.print(f"{run.root} is at step {done}, {past}: nothing to train and finished step {done}'s "
                          "update, which a kill interrupted; raise --steps to continue it", markup=False,
                          highlight=False)
            return None
        if keeping:  # the session only keeps it (`train`'s keep_missed)
            console.print(f"{run.root} is at step {done}, {past}: nothing to train, but a kill came before step "
                          f"{done} was kept; keeping it", markup=False, highlight=False)
        if evaluating:  # the session only makes its closing report
            what = f"finished step {done}'s update, which a kill interrupted, and" if interrupted else \
                "a kill came before its closing evaluation:"
            console.print(f"{run.root} is at step {trainer.step_count}, finished: {what} evaluating it", markup=False,
                          highlight=False)
        if rerun and not finished:
            console.print(f"{run.root} holds this run at step {trainer.step_count}: continuing it to step "
                          f"{cfg.steps}", markup=False, highlight=False)
        tokenizer = tokenizer or load_tokenizer(run.tokenizer)
        cfg = cfg.replace(sample_prompt=_sample_prompt(cfg, tokenizer))
        dataset = _dataset(cfg.data, tokenizer, cfg.seq) if dataset is None else dataset
        train_set, held_out = split or _split(cfg, dataset, tokenizer)
        _say_long_examples(cfg, dataset, held_out, console)
        stream = BatchStream(train_set, cfg.batch, cfg.trainer.seed)
        if "data" in trainer.extra_state:
            stream.load_state_dict(trainer.extra_state["data"])
        elif trainer.step_count:
            raise RunError(f"{run.store} holds no data position (it was not written by `streamer train`); "
                           "start a new run with --from-pretrained after exporting it")
        if lead:
            run.write_config(cfg)
            run.finish_setup()  # a set-up killed after writing config.toml left its mark
    except BaseException:
        trainer.close()
        raise
    return Session(cfg, run, trainer, tokenizer, stream, held_out, parallel)


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
    changed = [f"{flag(k)} {_shown(now[k])} (the store's: {_shown(before[k])})" for k in now
               if k in FLAGS and k not in RESUMABLE and now[k] != before[k]]
    if changed:
        raise RunError(f"{run.config} says {', '.join(changed)}, which cannot change when resuming; restore it from "
                       "a backup, or start a new --run-dir")


def _join(cfg: RunConfig, console: Console) -> DataParallel | None:
    """Under torchrun (WORLD_SIZE > 1): this process's place in the group; only rank 0 prints."""
    tc = cfg.trainer
    parallel = DataParallel.from_environment(tc.device.device, sharded=tc.step.data_parallel == "sharded",
                                             timeout_s=cfg.dist_timeout)
    if parallel is None:
        return None
    console.quiet = parallel.rank != 0
    if cfg.run_dir is None:
        raise RunError("under torchrun every process must use the same run directory: pass --run-dir DIR")
    if cfg.batch % (parallel.world * tc.step.grad_accum):
        raise RunError(f"--batch {cfg.batch} does not split over {parallel.world} processes x --grad-accum "
                       f"{tc.step.grad_accum}; use a multiple of {parallel.world * tc.step.grad_accum}")
    return parallel


def _compute_dtype(cfg: RunConfig, parallel: DataParallel | None, console: Console) -> str:
    """--dtype on this hardware (auto: bf16 where it is native and fast, else fp32), printed with its reason.
    Every process takes the lead's choice: their stores and gradient all-reduces must agree."""
    choice = resolve_compute_dtype(cfg.trainer.device.device, cfg.trainer.device.dtype)
    console.print(choice.reason, markup=False, highlight=False)
    return choice.dtype if parallel is None else parallel.gather(choice.dtype)[0]


@overload
def _together(parallel: DataParallel | None, work: Callable[[], T], everyone: Literal[True] = True,
              undo: Callable[[T], None] | None = None) -> T: ...
@overload
def _together(parallel: DataParallel | None, work: Callable[[], T], everyone: bool,
              undo: Callable[[T], None] | None = None) -> T | None: ...
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
    context, why = model_cfg.context()
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
    if source is not None:
        tokenizer = load_tokenizer(source)
    else:
        vocab = data.vocab_size or model_cfg.vocab_size
        if vocab < MIN_VOCAB:
            raise RunError(f"the model's vocab_size {model_cfg.vocab_size} cannot hold a byte-level BPE "
                           f"(>= {MIN_VOCAB} ids); pass --tokenizer or choose a model with a larger vocabulary")
        tokenizer = train_bpe(_texts(data), min(vocab, model_cfg.vocab_size))
    if data.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(data.chat_template)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise RunError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                       f"{model_cfg.vocab_size}; use a tokenizer made for this model or --vocab-size "
                       f"{model_cfg.vocab_size} or less")
    return tokenizer


def _texts(data: DataConfig) -> list[str]:
    if data.data is None:
        return demo_corpus()
    return [text for e in read_examples(data.data) for text in (e.text, e.completion) if text]


def _dataset(data: DataConfig, tokenizer: Tokenizer, seq: int) -> Dataset:
    if data.data is None:
        return tokenize(demo_corpus(), tokenizer, seq)
    return load_dataset(data.data, tokenizer, seq, pack=data.pack, long_examples=data.long_examples)


def _split(cfg: RunConfig, dataset: Dataset, tokenizer: Tokenizer) -> tuple[Dataset, Dataset | None]:
    """(train, held-out): all of --data and --eval-data when it is given, else --eval-fraction of --data."""
    if cfg.data.eval_data is not None:
        return dataset, load_dataset(cfg.data.eval_data, tokenizer, cfg.seq, pack=cfg.data.pack,
                                     long_examples=cfg.data.long_examples)
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


def _say_long_examples(cfg: RunConfig, dataset: Dataset, held_out: Dataset | None, console: Console) -> None:
    """One line per data file whose examples longer than --seq were truncated or dropped."""
    files = ((cfg.data.data, dataset), (cfg.data.eval_data, held_out if cfg.data.eval_data else None))
    for name, data in files:
        line = None if data is None else long_examples_line(data, cfg.seq, cfg.data.long_examples)
        if line is not None:
            console.print(f"{name}: {line}", markup=False, highlight=False)


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
    first = next(iter(read_examples(cfg.data.data)), None)
    return "" if first is None else prompt_of(first, tokenizer)
