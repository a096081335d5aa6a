"""`streamer train`: flags -> `streamer.session` (start or resume a run, train it) -> progress and a report printed.

A run is resumable at every committed step: `streamer.session` says how.
"""
from __future__ import annotations

import argparse
import errno
import os

from memory_model.settings import flag
from streamer.cli.flags import add_config_flag, add_run_flags, declare_command, given
from streamer.cli.main import RESUME_COMMAND
from streamer.cli.training import Printer, describe, report, resume_command, train
from streamer.console import make_console
from streamer.errors import StreamerError
from streamer.run import RESUMABLE, RunConfig, RunError, read_toml, resolve, store_choice
from streamer.run_dir import RunDir
from streamer.session import Session, check_startable, continue_run, run_length, shown
from streamer import session as lifecycle
from streamer.store.slabfile import DiskFull

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
    printer = Printer(console)
    with printer:
        session = resume(args.resume, explicit, args.config, printer) if args.resume else \
            start(explicit, args.config, printer)
    if session is None:  # the run is already at --steps: nothing was changed
        return 0
    RESUME_COMMAND[:] = [resume_command(str(session.run.root), session.parallel)]
    try:
        with session:
            console.print(f"run [bold]{session.run.root}[/]: {describe(session)}")
            trained = train(session, printer)
            report(session, trained, printer)
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
    return 0


def _resumes_from(session: Session) -> str:
    """The step a stopped run continues from, as the interrupted line says it: the RAM tier's is its last save."""
    try:
        committed = session.run.committed_step()
    except StreamerError:  # the line still names the command that continues the run, which says what is wrong
        return "the last committed step"
    if session.cfg.trainer.step.store.state.durable:
        return f"step {committed}, the last committed step"
    lost = session.trainer.step_count - committed
    since = f"; the {lost} step(s) trained since are not kept" if lost > 0 else ""
    return f"step {committed}, the RAM-tier store's last save (--save-every {session.cfg.save_every}{since})"


# --- setting up ------------------------------------------------------------------------------------------------
def start(explicit: dict, config_file: str | None, printer: Printer) -> Session | None:
    """A new run of the settings the flags and --config give (`streamer.session.start`). A --run-dir that already
    holds a run with these settings is continued instead (rerunning a command after a kill continues it)."""
    cfg = resolve(explicit, config_file).with_absolute_paths()  # a relative --run-dir names the run it holds
    check_startable(cfg)
    if cfg.run_dir is not None and RunDir.is_run(cfg.run_dir):
        return _rerun(cfg, explicit, config_file, printer)
    return lifecycle.start(cfg, printer, store_choice(cfg, explicit, config_file))


def resume(path: str, explicit: dict, config_file: str | None, printer: Printer) -> Session | None:
    """Continue a run from its last committed step (`streamer.session.resume`), with the flags it may change."""
    if config_file is not None or "run_dir" in explicit:
        raise RunError("--resume continues RUN with its own config.toml; drop --config and --run-dir "
                       "(flags such as --steps still apply)")
    return lifecycle.resume(path, printer, **explicit)


def _rerun(cfg: RunConfig, explicit: dict, config_file: str | None, printer: Printer) -> Session | None:
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
    if same.trainer.step.precision.compute == "auto":  # the run recorded what auto chose when it started
        same = same.replace(dtype=saved.trainer.step.precision.compute)
    now = same.flat()
    changed = [f"{flag(k)} {shown(before[k])} there, {shown(now[k])} here" for k in now
               if k not in RESUMABLE and now[k] != before[k]]
    if changed:
        raise RunError(f"--run-dir {run.root} holds a run with other settings ({'; '.join(changed)}); nothing was "
                       f"changed: continue it with `streamer train --resume {run.root}` or choose a new --run-dir")
    # As with --resume: the RESUMABLE settings this command names apply; the others stay the run's own (the
    # sample prompt derived from the data, say).
    named = set(explicit) | (set(read_toml(config_file)) if config_file is not None else set())
    changes = run_length({k: cfg.flat()[k] for k in RESUMABLE if k in named}, named)
    return continue_run(run, saved.replace(**changes, run_dir=os.path.abspath(run.root)), printer, rerun=True)
