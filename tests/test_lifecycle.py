"""A run's life through the `streamer train` command, each test a subprocess as a user runs it: killed at any
instant (set-up included) and rerun, interrupted, resumed with fewer steps, launched by torchrun, and refused
before writing anything when the host cannot hold its store."""
from __future__ import annotations

import json
import os
import random
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import TINY_RUN_MODEL as TINY
from layers import GPTJConfig
from streamer.cli.generate import open_trainer
from streamer.run import resolve
from streamer.run_dir import SETUP_MARK, RunDir
from streamer.trainer import StreamingTrainer

STEPS = 4
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads in every run: bit-identical results
# A suite started in the background (a non-interactive shell's `&`) inherits SIGINT ignored, and so would the
# commands these tests interrupt with it. Handled here, it is back to its default in every command started.
signal.signal(signal.SIGINT, signal.default_int_handler)


def train_argv(setup: Path, run: Path, *extra: object, tokenizer: bool = True) -> list[str]:
    argv = ["train", "--model", setup / "config.json", "--data", setup / "train.txt", "--run-dir", run,
            "--steps", STEPS, "--batch", 4, "--seq", 32, "--dtype", "fp32", "--lr", 3e-3, "--sample-tokens", 0,
            "--eval-every", 2, *(("--tokenizer", setup / "tok") if tokenizer else ()), *extra]
    return [str(a) for a in argv]


def streamer(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamer", *argv], env=ENV, capture_output=True, text=True,
                          timeout=120)


def kill_when(argv: list[str], ready: Callable[[], bool], sig: int = signal.SIGKILL,
              program: tuple[str, ...] = ("-m", "streamer")) -> subprocess.CompletedProcess:
    """Start the command (`python PROGRAM ARGV`), send `sig` as soon as `ready()` (a file the stage writes
    appeared), wait for it."""
    proc = subprocess.Popen([sys.executable, *program, *map(str, argv)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while not ready() and proc.poll() is None:
        time.sleep(0.001)
    assert proc.poll() is None, f"the run ended before the stage to interrupt: {proc.communicate()}"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def metric_lines(run: Path) -> int:
    return len(RunDir(run).metrics.read_text().splitlines()) if RunDir(run).metrics.is_file() else 0


def weights(run: Path) -> dict[str, torch.Tensor]:
    with open_trainer(RunDir(run)) as trainer:
        assert trainer.step_count == STEPS
        return trainer.state_dict()


def assert_same_run(run: Path, reference: Path) -> None:
    """Bit-identical weights, and every step logged exactly once, with the uninterrupted run's loss."""
    a, b = weights(run), weights(reference)
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = {r["step"]: r["loss"] for r in RunDir(reference).read_metrics() if "loss" in r}
    steps = [r["step"] for r in RunDir(run).read_metrics() if "loss" in r]
    assert steps == list(range(1, STEPS + 1))
    assert {r["step"]: r["loss"] for r in RunDir(run).read_metrics() if "loss" in r} == losses


@pytest.fixture(scope="module")
def reference(tiny_setup, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    began = time.perf_counter()
    done = streamer(*train_argv(tiny_setup, run, tokenizer=False))
    assert done.returncode == 0, done.stderr
    (run.parent / "wall_seconds").write_text(str(time.perf_counter() - began))  # the span random kills draw from
    return run


def files_of(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_killed_at_every_stage_the_same_command_finishes_the_same_run(tiny_setup, reference, tmp_path):
    run = tmp_path / "run"
    argv = train_argv(tiny_setup, run, tokenizer=False)  # the tokenizer is trained and written by set-up, too

    def fresh(path: Path) -> Callable[[], Callable[[], bool]]:
        """A condition, made as an attempt starts: `path` was (re)written by that attempt, not left by the one
        killed before it (set-up clears those and writes them again)."""
        def made() -> Callable[[], bool]:
            started = time.time_ns()
            return lambda: path.exists() and path.stat().st_mtime_ns > started
        return made

    stages = {
        "set-up marked the folder": lambda: lambda: (run / SETUP_MARK).exists(),  # the first attempt: no folder yet
        "tokenizer written": fresh(run / "tokenizer"),
        "store being created": fresh(run / "store" / "slabs"),
        "store initialised": fresh(run / "store" / "manifest.json"),
        "config.toml written": lambda: lambda: RunDir.is_run(run),
        "mid-run, after step 1's record": lambda: lambda: metric_lines(run) >= 1,
        "mid-run, after step 3's record": lambda: lambda: metric_lines(run) >= 4,  # steps 1, 2, the eval at 2, 3
    }
    for stage, condition in stages.items():
        killed = kill_when(argv, condition())
        assert killed.returncode == -signal.SIGKILL, (stage, killed.stderr)
    done = streamer(*argv)
    assert done.returncode == 0, done.stderr
    assert "continuing it to step" in done.stdout
    assert_same_run(run, reference)
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == \
        (reference / "tokenizer" / "tokenizer.json").read_bytes()
    assert not (run / SETUP_MARK).exists()


# The `streamer` command, paused before step N + 1 until a signal comes: a Ctrl-C sent once step N is logged lands
# in the run, however late a loaded machine lets the test send it (a run of tiny steps could otherwise finish first).
PAUSED_STREAMER = """
import sys, time
from streamer.cli.launch import main
from streamer.trainer import StreamingTrainer
after, step = int(sys.argv.pop(1)), StreamingTrainer.step
def paused(self, *args, **kwargs):
    if self.step_count == after:
        time.sleep(120)
    return step(self, *args, **kwargs)
StreamingTrainer.step = paused
sys.exit(main())
"""


@pytest.mark.slow
def test_ctrl_c_names_the_folder_and_resume_logs_every_step_once(tiny_setup, reference, tmp_path):
    run = tmp_path / "run"
    argv = train_argv(tiny_setup, run, tokenizer=False)
    # Step 2 logged: the run waits before step 3.
    stopped = kill_when(argv, lambda: metric_lines(run) >= 2, signal.SIGINT, program=("-c", PAUSED_STREAMER, "2"))
    assert stopped.returncode == 130, stopped.stderr
    assert f"`streamer train --resume {run}`" in stopped.stderr.strip().splitlines()[-1]
    done = streamer("train", "--resume", str(run))
    assert done.returncode == 0, done.stderr
    assert_same_run(run, reference)

    before = files_of(run)
    fewer = streamer("train", "--resume", str(run), "--steps", "2")
    assert fewer.returncode == 0 and f"is at step {STEPS}, past --steps 2" in fewer.stdout, fewer
    assert streamer(*train_argv(tiny_setup, run, tokenizer=False)).returncode == 0  # the same command: finished
    other = streamer(*train_argv(tiny_setup, run, "--seq", 16, tokenizer=False))
    assert other.returncode == 2 and other.stderr.count("\n") == 1 and "--seq 32 there, 16 here" in other.stderr
    assert files_of(run) == before  # none of the three changed a byte or a timestamp


@pytest.mark.slow
def test_a_ram_tier_run_killed_mid_run_continues_from_its_last_save(tiny_setup, reference, tmp_path):
    """The RAM tier is durable at --save-every saves: steps after the last one are trained again, logged once."""
    run = tmp_path / "run"
    argv = train_argv(tiny_setup, run, "--store", "ram", "--save-every", 2, tokenizer=False)
    killed = kill_when(argv, lambda: metric_lines(run) >= 4)  # step 3 logged; the last save was step 2's
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = streamer(*argv)
    assert done.returncode == 0, done.stderr
    assert "holds this run at step 2: continuing it to step 4" in done.stdout
    assert_same_run(run, reference)  # and bit-identical to the disk tier's run


@pytest.mark.slow
@pytest.mark.parametrize("sig, seed", [(signal.SIGKILL, 2201), (signal.SIGINT, 2202)])
def test_killed_at_random_instants_the_same_command_logs_every_step_once(tiny_setup, reference, tmp_path, sig, seed):
    """Twice per trial the command is signalled after a delay drawn from a seeded RNG within an uninterrupted
    run's wall time (interpreter start, set-up and training alike), then rerun to the end."""
    rng = random.Random(seed)
    span = float((reference.parent / "wall_seconds").read_text())
    for trial in range(2):
        run = tmp_path / f"run{trial}"
        argv = train_argv(tiny_setup, run, tokenizer=False)
        delays = [rng.uniform(0, span) for _ in range(2)]
        where = f"seed {seed}, trial {trial}, {signal.Signals(sig).name} after {[round(d, 3) for d in delays]} s"
        for delay in delays:
            proc = subprocess.Popen([sys.executable, "-m", "streamer", *argv], env=ENV, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            time.sleep(delay)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=120)
            # 0: it finished first; -SIGINT: interrupted before Python's own handler was in place.
            assert proc.returncode in (0, -sig, 130), (where, proc.returncode, err)
        done = streamer(*argv)
        assert done.returncode == 0, (where, done.stderr)
        try:
            assert_same_run(run, reference)
        except AssertionError as failed:
            raise AssertionError(f"{where}: {failed}") from None


def test_ctrl_c_while_the_libraries_load_stops_the_command_cleanly():
    """A Ctrl-C inside numpy's import (delivered as `streamer` starts importing it) exits 130 saying so, where
    Python's own handler could leave numpy half-loaded and fail with an unrelated ImportError (exit 1)."""
    interrupt_at_numpy = (
        "import builtins, os, signal, sys\n"
        "real_import = builtins.__import__\n"
        "def interrupting(name, *args, **kwargs):\n"
        "    if name == 'numpy' and 'numpy' not in sys.modules:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real_import(name, *args, **kwargs)\n"
        "builtins.__import__ = interrupting\n"
        "from streamer.cli.launch import main\n"
        "sys.exit(main())\n")
    done = subprocess.run([sys.executable, "-c", interrupt_at_numpy, "--help"], env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stderr.strip()) == (130, "interrupted")


@pytest.mark.parametrize("given,used", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_command_lets_waiting_threads_sleep_before_torch_loads(given, used):
    """OMP_WAIT_POLICY is read once, as torch's OpenMP library loads: the command sets it before torch's import,
    and a user's own setting wins."""
    watch_torch = (
        "import builtins, os, sys\n"
        "real_import, seen = builtins.__import__, []\n"
        "def watching(name, *args, **kwargs):\n"
        "    if name == 'torch' and 'torch' not in sys.modules and not seen:\n"
        "        seen.append(os.environ.get('OMP_WAIT_POLICY'))\n"
        "    return real_import(name, *args, **kwargs)\n"
        "builtins.__import__ = watching\n"
        "from streamer.cli.launch import main\n"
        "try:\n"
        "    main()\n"
        "finally:\n"
        "    print('torch saw', seen)\n")
    env = {k: v for k, v in ENV.items() if k != "OMP_WAIT_POLICY"} | ({} if given is None else
                                                                        {"OMP_WAIT_POLICY": given})
    done = subprocess.run([sys.executable, "-c", watch_torch, "plan", "--help"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip().endswith(f"torch saw [{used!r}]"), done.stdout[-500:] + done.stderr[-2000:]


def test_a_killed_step_between_commit_and_record_is_logged_once(tiny_setup, reference, tmp_path):
    """The committed step is the truth: a record past it goes, a committed step without one gets it back."""
    run = tmp_path / "run"
    assert streamer(*train_argv(tiny_setup, run, "--steps", 3, tokenizer=False)).returncode == 0
    lines = RunDir(run).metrics.read_text().splitlines()
    step3 = next(i for i, line in enumerate(lines) if json.loads(line).get("step") == 3)
    # As if killed after step 3 committed but before its record, and during a later record's write.
    RunDir(run).metrics.write_text("\n".join(lines[:step3]) + '\n{"step": 4, "loss": 1.0}\n{"step": 5, "lo')
    done = streamer(*train_argv(tiny_setup, run, tokenizer=False))
    assert done.returncode == 0, done.stderr
    assert_same_run(run, reference)
    restored = next(r for r in RunDir(run).read_metrics() if r["step"] == 3 and "loss" in r)
    assert "step_s" not in restored  # rebuilt from the store's losses, which keep no timings


# The `streamer` command with the gradient of its n-th step attempts poisoned (inf in block.0's first gradient):
# the runtime's own non-finite check fires, as a real overflow would, with no hook in the product.
POISONED_STREAMER = """
import sys
from streamer.cli.main import main
from streamer.store.host import HostStore
from streamer.trainer import StreamingTrainer
poisoned, attempts = {int(n) for n in sys.argv.pop(1).split(",")}, [0]
step, accumulate = StreamingTrainer.step, HostStore.accumulate_grad
def counted(self, *args, **kwargs):
    attempts[0] += 1
    return step(self, *args, **kwargs)
def poison(self, unit, grads, *args, **kwargs):
    if attempts[0] in poisoned and unit == "block.0":
        grads = [g.clone() for g in grads]
        grads[0].view(-1)[0] = float("inf")
    return accumulate(self, unit, grads, *args, **kwargs)
StreamingTrainer.step, HostStore.accumulate_grad = counted, poison
sys.exit(main())
"""


def test_nonfinite_skip_logs_each_attempt_under_its_step(tiny_setup, tmp_path):
    """Attempts 2 and 3 are both step 2 (the first was skipped), attempt 5 is step 3: each is logged as a
    skipped step 2, 2, 3 before that step's own record, and every step has exactly one record with a loss."""
    run = tmp_path / "run"
    argv = train_argv(tiny_setup, run, "--nonfinite", "skip", "--eval-every", 0)
    done = subprocess.run([sys.executable, "-c", POISONED_STREAMER, "2,3,5", *argv], env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.count("skipped: non-finite loss or gradient") == 3, done.stdout
    records = [r for r in RunDir(run).read_metrics() if "eval_loss" not in r]  # the end-of-run evaluation's
    assert [(r["step"], r.get("skipped", False)) for r in records] == \
        [(1, False), (2, True), (2, True), (2, False), (3, True), (3, False), (4, False)]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert not any("loss" in r for r in records if r.get("skipped"))
    with open_trainer(RunDir(run)) as trainer:
        assert trainer.step_count == STEPS


def test_nonfinite_skip_stops_when_every_batch_is_non_finite(tiny_setup, tmp_path):
    """Step 2 is non-finite on every batch: the run stops after MAX_SKIPPED_ATTEMPTS attempts with one line,
    keeping step 1, instead of retrying forever."""
    from streamer.session import MAX_SKIPPED_ATTEMPTS
    run = tmp_path / "run"
    argv = train_argv(tiny_setup, run, "--nonfinite", "skip", "--eval-every", 0)
    attempts = ",".join(str(n) for n in range(2, 2 + 2 * MAX_SKIPPED_ATTEMPTS))
    done = subprocess.run([sys.executable, "-c", POISONED_STREAMER, attempts, *argv], env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"step 2 was non-finite on {MAX_SKIPPED_ATTEMPTS} batches in a row" in done.stderr, done.stderr
    records = [r for r in RunDir(run).read_metrics() if "eval_loss" not in r]
    assert [(r["step"], r.get("skipped", False)) for r in records] == [(1, False)] + [(2, True)] * MAX_SKIPPED_ATTEMPTS
    with open_trainer(RunDir(run)) as trainer:
        assert trainer.step_count == 1


@pytest.fixture
def small_disk(tmp_path):
    """A 96 MiB tmpfs (mounting one needs root; elsewhere the test is skipped)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96M", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill_after_first_step(proc: subprocess.Popen, run: Path, filler: Path) -> None:
    """Once `proc` (a run into `run`) logs its first step, fill the disk `filler` is on, every free byte, while the
    run is stopped: otherwise a fast machine can reach its next writes first."""
    while metric_lines(run) < 1 and proc.poll() is None:
        time.sleep(0.001)
    proc.send_signal(signal.SIGSTOP)
    with filler.open("wb") as out:
        try:
            while True:
                out.write(b"\0" * 2**16)
                out.flush()
        except OSError:
            pass
    proc.send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_keeps_the_last_step_and_says_how_to_continue(tiny_setup, reference, small_disk):
    run, filler = small_disk / "run", small_disk / "filler"
    argv = train_argv(tiny_setup, run, tokenizer=False)
    proc = subprocess.Popen([sys.executable, "-m", "streamer", *argv], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    fill_after_first_step(proc, run, filler)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert f"free space and continue with `streamer train --resume {run}`" in err
    filler.unlink()
    done = streamer(*argv)
    assert done.returncode == 0, done.stderr
    assert_same_run(run, reference)


# --- torchrun ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_torchrun_run_dir_equals_one_process_and_reruns(tiny_setup, tmp_path, capsys, monkeypatch):
    """`torchrun --nproc_per_node 2 -m streamer train --run-dir D`: 2 rows per process make the same steps as one
    process with 2 micro-batches of 2 rows; rerunning the command with more --steps continues D; `streamer plan
    --compare D` plans each process on its half of the batch."""
    parallel, single = tmp_path / "parallel", tmp_path / "single"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "streamer"]
    for steps in (2, 3):
        done = subprocess.run([*torchrun, *train_argv(tiny_setup, parallel, "--steps", steps)], env=ENV,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "holds this run at step 2: continuing it to step 3" in done.stdout
    assert streamer(*train_argv(tiny_setup, single, "--steps", 3, "--grad-accum", 2)).returncode == 0
    assert RunDir(parallel).processes() == 2
    _compare_plans_each_process(parallel, capsys, monkeypatch)
    with open_trainer(RunDir(parallel)) as a, open_trainer(RunDir(single)) as b:
        assert a.step_count == b.step_count == 3
        sa, sb = a.state_dict(), b.state_dict()
        # Measured max |difference| 0.0 (fp32, gloo): the two ranks' halves are summed in the same order as the
        # single process's two micro-batches, so the weights are bit-identical (the brief's bound was 1e-5).
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    logged = [r["step"] for r in RunDir(parallel).read_metrics() if "loss" in r]
    assert logged == [1, 2, 3]  # rank 0 alone logs
    alone = streamer("train", "--resume", str(parallel), "--steps", "4")
    assert alone.returncode == 2 and "trained by 2 process(es) and this is 1" in alone.stderr
    # The hint printed at the end is the torchrun command, and it continues the run.
    hint = next(line.strip() for line in done.stdout.splitlines() if "--resume" in line)
    assert hint == f"torchrun --standalone --nproc-per-node 2 -m streamer train --resume {parallel} --steps 6"
    resumed = subprocess.run([sys.executable, "-m", "torch.distributed.run", *shlex.split(hint)[1:]], env=ENV,
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in RunDir(parallel).read_metrics() if "loss" in r] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_torchrun_goes_back_to_the_newest_step_intact_in_every_process(tiny_setup, tmp_path):
    """Rank 1's state file of step 2 damaged and rank 0's manifest gone: every process goes back to step 1, the
    newest step intact in both stores (rank 0's intact step 2 too), says so in one line naming both stores, and
    trains on to the weights of the run continued from a backup; where no step is intact in every store, every
    process refuses in one line saying to restore the run (it used to tell the healthy rank to start again, which
    failed the same way)."""
    run = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run([*torchrun, "-m", "streamer", *train_argv(tiny_setup, run, "--steps", 2, "--eval-every", 0,
                                                                "--save-every", 1, "--keep-last", 2)],
                          env=ENV, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.copytree(run, tmp_path / "backup")
    stores = [run / "store" / f"rank{rank}" for rank in (0, 1)]

    def damage(store: Path, step: int) -> Path:
        record = json.loads((store / "kept" / f"{step}.json").read_text())
        path = store / "slabs" / f"block.0.{record['units']['block.0']}.state"
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF
        path.write_bytes(data)
        return path

    damaged = damage(stores[1], 2)
    (stores[0] / "manifest.json").unlink()
    resume = ["-m", "streamer", "train", "--resume", str(run), "--steps", "3"]
    # Rank 0's output alone: the two ranks' lines may interleave.
    went_back = subprocess.run([*torchrun, "--local-ranks-filter", "0", *resume], env=ENV, capture_output=True,
                               text=True, timeout=180)
    assert went_back.returncode == 0, went_back.stderr[-3000:]
    said = f"rank 0's store: {stores[0] / 'manifest.json'} is missing; rank 1's store: unit block.0: checksum " \
        f"mismatch in {damaged}, so the run goes back to step 1, the newest step intact in every process's store " \
        "(the steps after it are trained again)"
    assert said in " ".join(went_back.stdout.split()), went_back.stdout[-3000:]
    assert [r["step"] for r in RunDir(run).read_metrics() if "loss" in r] == [1, 2, 3]
    again = subprocess.run([*torchrun, *resume[:4], str(tmp_path / "backup"), *resume[5:]], env=ENV,
                           capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    for rank in (0, 1):
        with (StreamingTrainer.open(stores[rank], read_only=True) as a,
              StreamingTrainer.open(tmp_path / "backup" / "store" / f"rank{rank}", read_only=True) as b):
            assert a.step_count == b.step_count == 3
            assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    # No step intact in both: rank 1's newest (3) damaged, and rank 0's other kept step (2).
    damaged = damage(stores[1], 3)
    damage(stores[0], 2)
    refused = subprocess.run([*torchrun, "--local-ranks-filter", "0", *resume[:-1], "4"], env=ENV,
                             capture_output=True, text=True, timeout=180)
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert refused.returncode != 0 and lines == [
        f"error: rank 1's store: unit block.0: checksum mismatch in {damaged}: no step is intact in every process's "
        "store; restore the run directory from a backup, or start a new run"], refused.stderr[-3000:]


def test_a_process_that_dies_stops_the_others_in_one_line(tiny_setup, tmp_path):
    """Rank 1 of two aborts (SIGABRT) mid-run: rank 0 stops within seconds, never hangs, with one line, no traceback
    and exit status 2 (a process stopping on an error used to abort at exit after its line, now and then); the same
    torchrun command then finishes the run, each step logged once. The two processes are started as torchrun starts
    them but without its agent, which would stop rank 0 itself."""
    import socket

    run = tmp_path / "run"
    argv = train_argv(tiny_setup, run, "--steps", 40, "--eval-every", 0)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-m", "streamer", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                              "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                              "LOCAL_WORLD_SIZE": "2"}) for rank in (0, 1)]
    try:
        while metric_lines(run) < 2 and all(p.poll() is None for p in ranks):
            time.sleep(0.005)
        assert ranks[1].poll() is None, ranks[1].communicate()
        ranks[1].send_signal(signal.SIGABRT)
        sent = time.monotonic()
        _, err = ranks[0].communicate(timeout=60)
        waited = time.monotonic() - sent
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
    lines = [line for line in err.splitlines() if line.strip()]
    assert ranks[0].returncode == 2 and waited < 30 and len(lines) == 1, (ranks[0].returncode, waited, err[-3000:])
    assert lines[0].startswith("error: another process of this run stopped answering") and \
        "the run keeps its last committed step: start the same torchrun command again" in lines[0], err
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run([*torchrun, "-m", "streamer", *argv], env=ENV, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in RunDir(run).read_metrics() if "loss" in r] == list(range(1, 41))


def _compare_plans_each_process(run: Path, capsys, monkeypatch) -> None:
    """The planned peak is the one each process's ledger measured (planning the whole batch on one device put
    the demo's 72% above it)."""
    import streamer.calibration.calibrate as calibrate
    from test_cli import run_cli
    from test_devices import TINY

    monkeypatch.setattr(calibrate, "DEFAULT_SIZES", TINY)  # the step time is not checked here
    monkeypatch.chdir(run.parent)  # the calibration is cached in ./runs
    rc, out, err = run_cli(capsys, "plan", "--compare", run, "--json")
    assert rc == 0, err
    result = json.loads(out)
    # As test_planner_matches_dry_run: the planner within 1% of the runtime's ledger.
    assert result["processes"] == 2
    assert result["predicted_peak_bytes"] == pytest.approx(result["measured_peak_bytes"], rel=0.01)
    rc, out, err = run_cli(capsys, "plan", "--config", run / "config.toml", "--target", "local", "--json")
    assert rc == 0 and json.loads(out)["peak_device_bytes"] > result["predicted_peak_bytes"]  # the whole batch


# --- host resources ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("store, short", [("disk", "of disk"), ("ram", "of RAM")])
def test_a_store_the_host_cannot_hold_is_refused_before_writing(tmp_path, store, short):
    huge = tmp_path / "huge.json"  # about 400 billion parameters: more than any test machine holds
    huge.write_text(json.dumps(GPTJConfig(n_embd=4096, n_layer=2000, n_head=16, rotary_dim=64).adapter().to_hf()))
    run = tmp_path / "run"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = streamer("train", "--model", str(huge), "--run-dir", str(run), "--store", store, "--steps", "1")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: the run's host store needs ") and short in done.stderr
    assert "a smaller model (--model gptj-" in done.stderr
    # CPU seconds rather than wall time, which on a shared machine is anyone's: measured 2.2 to 2.4 s of CPU,
    # mostly importing torch (sizing each of the 2000 blocks' state files anew took 4.0 to 5.2 s).
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert cpu < 5, cpu
    assert not run.exists() and list(tmp_path.iterdir()) == [huge]


def test_the_disk_need_is_what_a_store_writes(tmp_path):
    """host_bytes' disk figure is the files of a committed step plus one more state generation (a commit's)."""
    from streamer import StreamingTrainer, TrainerConfig
    tc = TrainerConfig.of(dtype="fp32", store="disk", update_chunk=5_000)
    with StreamingTrainer(TINY, tc, store_dir=tmp_path / "store") as trainer:
        trainer.step(torch.randint(0, TINY.vocab_size, (2, 16)))
        slabs = {p.name: p.stat().st_size for p in (tmp_path / "store" / "slabs").iterdir()}
    ram, disk = tc.store_spec(TINY).host_bytes()
    states = sum(size for name, size in slabs.items() if name.endswith(".state"))
    assert ram == 0 and disk == sum(slabs.values()) + states


def test_what_would_fit_names_the_change(tmp_path):
    from streamer.resources import shortfall
    cfg = resolve({"model": "gptj-1.3b", "store": "ram", "run_dir": str(tmp_path / "r")})
    model_cfg = cfg.model_config()
    gib = 2**30
    assert shortfall(cfg, model_cfg, 64 * gib, 64 * gib, tmp_path) is None
    ram_short = shortfall(cfg, model_cfg, 8 * gib, 64 * gib, tmp_path)
    assert "of RAM (--store ram; 8.00 GiB available)" in ram_short and "what would fit: --store disk" in ram_short
    disk_short = shortfall(cfg.replace(store="disk"), model_cfg, 64 * gib, 24 * gib, tmp_path)  # fused 38 GiB; 22
    assert f"of disk in {tmp_path}" in disk_short and "what would fit: --update-timing after-backward" in disk_short
    journaled = cfg.replace(store="disk", update_timing="after-backward")
    disk_short = shortfall(journaled, model_cfg, 64 * gib, 18 * gib, tmp_path)  # 22 GiB; 16 with bf16 moments
    assert "what would fit: --moment-dtype bf16" in disk_short
    assert "a --run-dir on a filesystem with more free space" in disk_short


def test_auto_runs_the_update_after_the_backward_where_a_fused_steps_second_generation_does_not_fit(tmp_path):
    """A fused step keeps every unit's previous state until it commits; a journaled one only one unit's. On a disk
    between the two needs, --update-timing auto runs after the backward (and says so); an explicit fused is
    refused with the flag that would fit; a disk short of both is refused."""
    from streamer.resources import fit_host_resources, shortfall
    from streamer.run import RunError
    cfg = resolve({"model": "gptj-1.3b", "store": "disk", "moment_dtype": "bf16", "run_dir": str(tmp_path / "r")})
    model_cfg = cfg.model_config()
    spec = cfg.trainer.store_spec(model_cfg)
    fused_disk, journaled_disk = spec.host_bytes()[1], spec.host_bytes(every_unit_twice=False)[1]
    state = spec.state_bytes(model_cfg.params().own("block.0"))
    assert fused_disk - journaled_disk > 20 * state  # the second generation of every unit, not of one
    ram, between = 64 * 2**30, (fused_disk + journaled_disk) // 2
    assert fit_host_resources(cfg, model_cfg, ram, 2 * fused_disk, tmp_path) == (cfg, None)
    fitted, said = fit_host_resources(cfg, model_cfg, ram, between, tmp_path)
    assert fitted == cfg.replace(update_timing="after-backward")
    assert said.startswith("--update-timing auto: a fused step keeps every unit's previous state")
    assert "after the backward" in said
    explicit = cfg.replace(update_timing="fused")
    message = shortfall(explicit, model_cfg, ram, between, tmp_path)
    assert "every unit's state twice while a step commits" in message
    assert "what would fit: --update-timing after-backward" in message
    with pytest.raises(RunError, match="one unit's state twice"):
        fit_host_resources(cfg, model_cfg, ram, journaled_disk // 2, tmp_path)
    # Norm-first makes a clipping step fused: a step that is never fused leaves it for auto.
    norm_first = cfg.replace(clipped_steps="norm-first")
    assert fit_host_resources(norm_first, model_cfg, ram, between, tmp_path)[0] == fitted
    assert "what would fit: --update-timing after-backward" in shortfall(
        norm_first.replace(update_timing="fused"), model_cfg, ram, between, tmp_path)


# The `streamer` command killed once step N is journaled, before any unit's update: the next open rolls it forward.
KILLED_AFTER_JOURNAL = """
import os, signal, sys
from streamer.cli.main import main
from streamer.store.host import HostStore
after, begin_step = int(sys.argv.pop(1)), HostStore.begin_step
def journaled(self, step, record):
    begin_step(self, step, record)
    if step == after:
        os.kill(os.getpid(), signal.SIGKILL)
HostStore.begin_step = journaled
sys.exit(main())
"""


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    """One field changed in place, the record's checksum left as it was: a digit changed on the disk."""
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


def test_a_changed_digit_in_any_record_is_refused_naming_the_file(tiny_setup, tmp_path, capsys):
    """journal.json's lr, clip coefficient and data position, manifest.json's step and data position and
    config.toml's betas: each record carries a checksum, so the same command refuses the run in one line naming
    the file, and changes nothing, where it would have trained on with the changed value. A damaged journal is
    named too, and the step it journaled is dropped: the run goes back to its last commit and trains that step
    again."""
    from streamer.cli.main import main
    run = tmp_path / "run"
    argv = train_argv(tiny_setup, run, "--update-timing", "after-backward", "--eval-every", 0)
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_JOURNAL, "3", *argv], env=ENV, capture_output=True,
                            text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL and (run / "store" / "journal.json").is_file(), killed.stderr

    def position(record: dict) -> None:
        record["trainer"]["extra"]["data"]["position"] += 1

    damages = {
        "journal lr": ("store/journal.json", lambda r: r.update(lr=r["lr"] * 2)),
        "journal clip_coef": ("store/journal.json", lambda r: r.update(clip_coef=r["clip_coef"] / 2)),
        "journal data position": ("store/journal.json", position),
        "manifest step": ("store/manifest.json", lambda r: r.update(step=r["step"] - 1)),
        "manifest data position": ("store/manifest.json", position),
    }
    # config.toml without its checksum line, as written before it had one: its settings against the store's.
    configs = {"config.toml betas": ("checksum", True),
               "an older config.toml's betas": ("the store's: 0.9 0.95", False)}
    for what, (name, edit) in [*damages.items(), *((what, ("config.toml", None)) for what in configs)]:
        damaged = tmp_path / what.replace(" ", "-").replace("'", "") / "run"
        shutil.copytree(run, damaged)
        expected = "checksum"
        if edit is None:
            config = damaged / "config.toml"
            expected, sealed = configs[what]
            lines = config.read_text().replace("betas = [0.9, 0.95]", "betas = [0.9, 0.96]").splitlines(True)
            config.write_text("".join(lines if sealed else lines[:-1]))
        else:
            _edit_json(damaged / name, edit)
        before = files_of(damaged)
        # --resume takes config.toml's settings as they are: the older file's betas are caught by the store's.
        rc = main(["train", "--resume", str(damaged)] if what in configs else
                  [*argv[:argv.index("--run-dir") + 1], str(damaged), *argv[argv.index("--run-dir") + 2:]])
        out, err = capsys.readouterr()
        if name.endswith("journal.json"):  # the step it journaled is dropped: the run goes back to its last commit
            line = next((line for line in out.splitlines() if str(damaged / name) in line), "")
            assert rc == 0 and expected in line and "goes back to step 2" in line, (what, out, err)
            continue
        err = err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and str(damaged / name) in err, (what, err)
        assert expected in err and "Traceback" not in err, (what, err)
        assert files_of(damaged) == before, what
    done = streamer(*argv)  # the undamaged run rolls step 3 forward and trains on
    assert done.returncode == 0 and "continuing it to step 4" in done.stdout, done.stderr


# The `streamer` command SIGKILLed right after an event: `eval:N` once step N's evaluation is logged, `commit:N`
# once step N is committed (before anything else of the step: its record, its evaluation).
KILLED_AT = """
import os, signal, sys
from streamer.cli.main import main
from streamer.run_dir import RunDir
from streamer.store.host import HostStore
kind, at = sys.argv.pop(1).split(":")
append, finish = RunDir.append_metrics, HostStore.finish_step
def appended(self, record):
    append(self, record)
    if kind == "eval" and record.get("step") == int(at) and "eval_loss" in record:
        os.kill(os.getpid(), signal.SIGKILL)
def finished(self, step, state):
    finish(self, step, state)
    if kind == "commit" and step == int(at):
        os.kill(os.getpid(), signal.SIGKILL)
RunDir.append_metrics, HostStore.finish_step = appended, finished
sys.exit(main())
"""


@pytest.mark.slow
def test_killed_around_its_evaluations_the_same_command_logs_each_once(tiny_setup, tmp_path):
    """Killed right after step 0's evaluation, right after step 3 (an --eval-every step) commits and right after
    the last step commits: the same command logs every evaluation once, as an uninterrupted run does."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert streamer(*train_argv(tiny_setup, reference, "--eval-every", 3)).returncode == 0
    argv = train_argv(tiny_setup, run, "--eval-every", 3)
    for where in ("eval:0", "commit:3", f"commit:{STEPS}"):
        killed = subprocess.run([sys.executable, "-c", KILLED_AT, where, *argv], env=ENV, capture_output=True,
                                text=True, timeout=120)
        assert killed.returncode == -signal.SIGKILL, (where, killed.stderr)
    done = streamer(*argv)
    assert done.returncode == 0, done.stderr
    assert "a kill came before its closing evaluation: evaluating it" in done.stdout, done.stderr

    def evaluations(folder: Path) -> list[tuple[int, float]]:
        return [(r["step"], r["eval_loss"]) for r in RunDir(folder).read_metrics() if "eval_loss" in r]
    assert [step for step, _ in evaluations(reference)] == [0, 3, STEPS]
    assert evaluations(run) == evaluations(reference)
    assert [r["step"] for r in RunDir(run).read_metrics() if "loss" in r] == list(range(1, STEPS + 1))
    again = streamer(*argv)
    assert again.returncode == 0 and "nothing to train and nothing was changed" in again.stdout, again.stderr
