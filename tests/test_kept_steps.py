"""Kept steps and the way back after a kill, through the `streamer` commands as a user types them: a run killed in
its last step's update is finished by the same command; `--save-every` with `--keep-last`/`--keep-best` keeps
restartable steps, `streamer export RUN --step N` exports one, and a damaged newest state falls back to the
newest intact kept step."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_lifecycle import ENV, STEPS, assert_same_run, reference, streamer, train_argv  # noqa: F401 (fixture)

# The `streamer` command, SIGKILLed at the n-th write-back of step S's update (after its journal: the step is
# committed and some units hold it, the rest still step S - 1).
KILLED_IN_UPDATE = """
import os, signal, sys
from streamer.cli.main import main
from streamer.runtime.update import Updater
from streamer.trainer import StreamingTrainer
at_step, at_call = map(int, sys.argv.pop(1).split(","))
step, write_back, now, calls = StreamingTrainer.step, Updater._write_back, [0], [0]
def counted(self, *args, **kwargs):
    now[0] = self.step_count + 1
    return step(self, *args, **kwargs)
def killing(self, *args, **kwargs):
    if now[0] == at_step:
        calls[0] += 1
        if calls[0] == at_call:
            os.kill(os.getpid(), signal.SIGKILL)
    return write_back(self, *args, **kwargs)
StreamingTrainer.step, Updater._write_back = counted, killing
sys.exit(main())
"""


def killed_in_update(argv: list[str], step: int, call: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILLED_IN_UPDATE, f"{step},{call}", *argv], env=ENV,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("again", ["the same command", "--resume"])
def test_a_run_killed_in_its_last_steps_update_is_finished_and_readable(tiny_setup, reference, tmp_path, again):
    """Killed after the last step's journal, with two of its four units written: the same command (or --resume)
    rolls the step forward, and then every reading command works on the run, bit-identical to an uninterrupted one."""
    run = tmp_path / "run"
    argv = train_argv(tiny_setup, run, "--update-timing", "after-backward", tokenizer=False)
    killed = killed_in_update(argv, STEPS, 3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (run / "store" / "journal.json").is_file()
    done = streamer(*argv) if again == "the same command" else streamer("train", "--resume", str(run))
    assert done.returncode == 0, done.stderr
    assert f"finished: nothing to train and finished step {STEPS}'s update, which a kill interrupted" in done.stdout, \
        done.stdout
    assert not (run / "store" / "journal.json").exists()
    assert_same_run(run, reference)
    exported = streamer("export", str(run), str(tmp_path / "hf"))
    assert exported.returncode == 0 and f"exported step {STEPS}" in exported.stdout, exported.stderr
    generated = streamer("generate", str(run), "--prompt", "The", "--max-new-tokens", "4")
    assert generated.returncode == 0, generated.stderr
    evaluated = streamer("eval", str(run), "--data", str(tiny_setup / "train.txt"))
    assert evaluated.returncode == 0, evaluated.stderr
