"""Kept steps and the way back after a kill, through the `streamer` commands as a user types them: a run killed in
its last step's update is finished by the same command; `--save-every` with `--keep-last`/`--keep-best` keeps
restartable steps, `streamer export RUN --step N` exports one, and a damaged newest state falls back to the
newest intact kept step."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from layers import GPTJConfig
from streamer import Placement, StreamingTrainer, TrainerConfig
from streamer.cli.generate import open_trainer
from streamer.session import steps_to_keep
from streamer.resources import DISK_HEADROOM, HostNeed, check_keep_room
from streamer.run import RunError, resolve
from streamer.run_dir import RunDir
from test_lifecycle import (  # noqa: F401 (fixtures)
    ENV, STEPS, assert_same_run, reference, small_disk, streamer, train_argv,
)

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
    assert f"finished: finished step {STEPS}'s update, which a kill interrupted, and evaluating it" in \
        done.stdout, done.stdout
    assert not (run / "store" / "journal.json").exists()
    assert_same_run(run, reference)
    if again == "--resume":
        return  # the same store as the same command leaves: read once, below
    exported = streamer("export", str(run), str(tmp_path / "hf"))
    assert exported.returncode == 0 and f"exported step {STEPS}" in exported.stdout, exported.stderr
    generated = streamer("generate", str(run), "--prompt", "The", "--max-new-tokens", "4")
    assert generated.returncode == 0, generated.stderr
    evaluated = streamer("eval", str(run), "--data", str(tiny_setup / "train.txt"))
    assert evaluated.returncode == 0, evaluated.stderr
    traced = streamer("trace", str(run))  # the invocation that rolled the update forward wrote it
    assert traced.returncode == 0 and f"at step {STEPS}" in traced.stdout, traced.stderr


def exported(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def flip_a_byte(run: Path, unit: str) -> Path:
    """Damage the unit's state file of the last commit (one byte of its data), as a disk error would."""
    manifest = json.loads((run / "store" / "manifest.json").read_text())
    path = run / "store" / "slabs" / f"{unit}.{manifest['units'][unit]}.state"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(data)
    return path


def flip_a_kept_byte(run: Path, step: int, unit: str) -> Path:
    """Damage the unit's state file of kept `step` (one byte of its data)."""
    kept = json.loads((run / "store" / "kept" / f"{step}.json").read_text())
    path = run / "store" / "slabs" / f"{unit}.{kept['units'][unit]}.state"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(data)
    return path


def test_readers_offer_only_the_intact_kept_steps(tiny_setup, tmp_path):
    """The last commit (step 6) and kept step 4 damaged: a reader names --step 2 alone, the one that reads, with
    its manifest or without; with every kept step damaged it says no step is intact and what is left to do."""
    run = tmp_path / "run"
    done = streamer(*train_argv(tiny_setup, run, "--steps", 6, "--eval-every", 0, "--save-every", 2,
                                "--keep-last", 3, tokenizer=False))
    assert done.returncode == 0 and "step 6 kept (kept steps: 2, 4, 6)" in done.stdout, done.stderr
    flip_a_byte(run, "block.0")
    flip_a_kept_byte(run, 4, "block.0")

    def refusal(*argv: object) -> str:
        refused = streamer(*map(str, argv))
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        return refused.stderr

    said = refusal("export", run, tmp_path / "out")
    assert "step 6 is damaged, as is kept step(s) 4; the run keeps intact step(s) 2: `streamer export` with " \
        "--step 2 exports the newest" in said, said
    (run / "store" / "manifest.json").unlink()
    said = refusal("export", run, tmp_path / "out")
    assert "manifest.json" in said and ", as are kept step(s) 4, 6; the run keeps intact step(s) 2: `streamer " \
        "export` with --step 2" in said, said
    flip_a_kept_byte(run, 2, "block.0")
    said = refusal("generate", run, "--prompt", "The", "--max-new-tokens", 1)
    assert f"as are its kept step(s) 2, 4, 6: no step of the run is intact; restore {run / 'store'} from a backup, " \
        "or start a new run" in said and "--step" not in said, said
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_kept_steps_are_exported_and_a_damaged_state_goes_back_to_the_newest_intact_one(tiny_setup, reference,
                                                                                        tmp_path):
    run = tmp_path / "run"
    keeping = ("--save-every", 2, "--keep-last", 2)
    first = streamer(*train_argv(tiny_setup, run, "--steps", 2, *keeping, tokenizer=False))
    assert first.returncode == 0 and "step 2 kept (kept steps: 2)" in first.stdout, first.stderr
    assert streamer("export", str(run), str(tmp_path / "at-2")).returncode == 0
    more = streamer("train", "--resume", str(run), "--steps", str(STEPS))
    assert more.returncode == 0 and "step 4 kept (kept steps: 2, 4)" in more.stdout, more.stderr
    # A kept step holds every unit's state file, what the set-up's disk check counts for it.
    kept = json.loads((run / "store" / "kept" / "2.json").read_text())
    files = [run / "store" / "slabs" / f"{unit}.{g}.state" for unit, g in kept["units"].items()]
    with open_trainer(RunDir(run)) as trainer:
        assert sum(f.stat().st_size for f in files) == trainer.store.spec.kept_bytes()

    damaged = flip_a_byte(run, "block.0")
    refused = streamer("export", str(run), str(tmp_path / "out"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"checksum mismatch in {damaged}: step 4 is damaged; the run keeps intact step(s) 2: `streamer export` " \
        "with --step 2" in refused.stderr
    not_kept = streamer("export", str(run), str(tmp_path / "out"), "--step", "3")
    assert not_kept.returncode == 2 and not_kept.stderr.count("\n") == 1, not_kept.stderr
    assert "step 3 of" in not_kept.stderr and "was not kept (kept steps: 2, 4)" in not_kept.stderr
    again = streamer("export", str(run), str(tmp_path / "kept-2"), "--step", "2")
    assert again.returncode == 0 and "exported step 2" in again.stdout, again.stderr
    at_2, kept_2 = exported(tmp_path / "at-2"), exported(tmp_path / "kept-2")
    assert at_2.keys() == kept_2.keys() and all(torch.equal(at_2[k], kept_2[k]) for k in at_2)

    on = streamer("train", "--resume", str(run), "--steps", "6")
    assert on.returncode == 0, on.stderr
    assert f"unit block.0: checksum mismatch in {damaged}: step 4 is damaged, so the run goes back to step 2, the " \
           "newest intact kept step" in on.stdout, on.stdout
    assert [r["step"] for r in RunDir(run).read_metrics() if "loss" in r] == list(range(1, 7))
    assert "step 6 kept (kept steps: 4, 6)" in on.stdout
    # Step 4 trained again from step 2 is the uninterrupted run's step 4, bit for bit.
    with open_trainer(RunDir(run), step=4) as trainer:
        again_4 = trainer.state_dict()
    with open_trainer(RunDir(reference)) as trainer:
        assert trainer.step_count == STEPS
        assert all(torch.equal(again_4[k], t) for k, t in trainer.state_dict().items())


@pytest.mark.slow
def test_the_ram_tier_keeps_its_saves_the_last_and_the_best(tiny_setup, tmp_path):
    """RAM tier: a kept step is its --save-every save, left on disk; --keep-best evaluates each one."""
    run = tmp_path / "run"
    done = streamer(*train_argv(tiny_setup, run, "--store", "ram", "--steps", 6, "--eval-every", 0,
                                "--save-every", 2, "--keep-last", 1, "--keep-best", tokenizer=False))
    assert done.returncode == 0, done.stderr
    evals = {r["step"]: r["eval_loss"] for r in RunDir(run).read_metrics() if "eval_loss" in r}
    assert list(evals) == [2, 4, 6]  # each save evaluated once (the closing evaluation is step 6's)
    best = min(evals, key=lambda step: (evals[step], step))
    store = run / "store"
    assert sorted(int(p.stem) for p in (store / "kept").iterdir()) == sorted({6, best})
    names = {f"{u}.{g}.state" for step in {6, best}
             for u, g in json.loads((store / "kept" / f"{step}.json").read_text())["units"].items()}
    assert {p.name for p in (store / "slabs").iterdir()} == names  # the other saves' files are gone
    out = streamer("export", str(run), str(tmp_path / "best"), "--step", str(best))
    assert out.returncode == 0 and f"exported step {best}" in out.stdout, out.stderr


def test_keep_best_without_held_out_data_is_one_line(tiny_setup, tmp_path):
    done = streamer(*train_argv(tiny_setup, tmp_path / "run", "--keep-best", "--eval-fraction", 0))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--keep-best" in done.stderr and "--eval-fraction 0" in done.stderr
    assert not (tmp_path / "run").exists()


def test_the_kept_steps_are_in_the_disk_need(tmp_path):
    model = GPTJConfig(n_embd=4096, n_layer=2000, n_head=16, rotary_dim=64)  # far more than any disk holds
    tc = resolve({"model": "gptj-debug"}).trainer
    spec = tc.store_spec(model, 1)
    assert HostNeed.of(model, tc, 1, 1, kept=2).disk - HostNeed.of(model, tc, 1, 1).disk == \
        pytest.approx(2 * spec.kept_bytes() * (1 + DISK_HEADROOM[1]), rel=1e-6)
    with pytest.raises(RunError, match="^keeping step 7 needs .* lower --keep-last"):
        check_keep_room(tmp_path, spec, 7)
    assert steps_to_keep({2: 3.0, 4: 1.0, 6: 2.0, 8: None}, 2, True) == {4, 6, 8}
    assert steps_to_keep({2: 1.0, 4: 1.0}, 0, True) == {2}
    assert steps_to_keep({2: None, 4: None}, 1, True) == {4}
    assert steps_to_keep({2: None, 4: None}, 3, False) == {2, 4}  # fewer than --keep-last: every one
    assert steps_to_keep({2: None, 4: None, 6: None}, None, False) == {2, 4, 6}  # --save-every alone


@pytest.mark.parametrize("tier", ["disk", "ram"])
def test_a_lora_runs_kept_step_keeps_its_adapters(tmp_path, tier):
    """A LoRA run's base is never rewritten; a kept step is its adapters' file, which later commits leave."""
    cfg = GPTJConfig.preset("gptj-debug")
    tc = TrainerConfig.of(store=Placement.of(tier), dtype="fp32", lr=3e-2, lora_rank=2)
    data = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    with StreamingTrainer(cfg, tc, tmp_path / "store") as trainer:
        for _ in range(4):
            trainer.step(data)
            trainer.save()
            if trainer.step_count == 2:
                trainer.keep()
                at_2 = trainer.state_dict()
        at_4 = trainer.state_dict()
    assert sorted(p.name for p in (tmp_path / "store").glob("lora-*")) == ["lora-00000002.safetensors",
                                                                          "lora-00000004.safetensors"]
    with StreamingTrainer.open(tmp_path / "store", read_only=True, step=2) as trainer:
        kept = trainer.state_dict()
    assert all(torch.equal(kept[k], at_2[k]) for k in kept)
    assert not all(torch.equal(kept[k], at_4[k]) for k in kept)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["disk", "ram"])
def test_keep_last_keeps_k_steps_and_a_damaged_newest_goes_back_to_the_one_before(tiny_setup, tmp_path, tier):
    """--keep-last 3 over saves at 2, 4 and 6 keeps all three in one uninterrupted run (each keep used to drop the
    one before); on the disk tier step 4 exports, and a damaged step 6 goes back to it."""
    run = tmp_path / "run"
    done = streamer(*train_argv(tiny_setup, run, "--store", tier, "--steps", 6, "--eval-every", 0,
                                "--save-every", 2, "--keep-last", 3, tokenizer=False))
    assert done.returncode == 0, done.stderr
    for line in ("step 2 kept (kept steps: 2)", "step 4 kept (kept steps: 2, 4)", "step 6 kept (kept steps: 2, 4, 6)"):
        assert line in done.stdout, done.stdout
    if tier == "ram":
        return  # its keeps are what this tests; reading and falling back to one are the disk tier's below
    out = streamer("export", str(run), str(tmp_path / "at-4"), "--step", "4")
    assert out.returncode == 0 and "exported step 4" in out.stdout, out.stderr
    damaged = flip_a_byte(run, "block.0")
    on = streamer("train", "--resume", str(run), "--steps", "8")
    assert on.returncode == 0, on.stderr
    assert f"checksum mismatch in {damaged}: step 6 is damaged, so the run goes back to step 4" in on.stdout, on.stdout
    assert "step 8 kept (kept steps: 4, 6, 8)" in on.stdout, on.stdout


# The `streamer` command, SIGKILLed as it is about to keep step S: the step is committed, its keep not written.
KILLED_BEFORE_KEEP = """
import os, signal, sys
from streamer import session
from streamer.cli.main import main
at_step, keep = int(sys.argv.pop(1)), session.keep
def killing(s, *args, **kwargs):
    if s.trainer.step_count == at_step:
        os.kill(os.getpid(), signal.SIGKILL)
    return keep(s, *args, **kwargs)
session.keep = killing
sys.exit(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("at", [4, 6])
def test_a_kill_between_a_steps_commit_and_its_keep_keeps_it_on_the_rerun(tiny_setup, tmp_path, at):
    """Killed after step 4 (or the last step, 6) committed and before it was kept: the same command keeps it
    first, so the run keeps 4 and 6 (not 2 and 6), and the step's evaluation is logged once."""
    run = tmp_path / "run"
    argv = train_argv(tiny_setup, run, "--steps", 6, "--save-every", 2, "--keep-last", 2, "--keep-best",
                      tokenizer=False)
    killed = subprocess.run([sys.executable, "-c", KILLED_BEFORE_KEEP, str(at), *argv], env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert at not in [int(p.stem) for p in (run / "store" / "kept").iterdir()]
    done = streamer(*argv)
    assert done.returncode == 0, done.stderr
    first = "step 4 kept (kept steps: 2, 4)" if at == 4 else \
        "nothing to train, but a kill came before step 6 was kept; keeping it"
    assert first in done.stdout, done.stdout
    kept = sorted(int(p.stem) for p in (run / "store" / "kept").iterdir())
    assert kept[-2:] == [4, 6] and "step 6 kept (kept steps: " in done.stdout, done.stdout
    assert [r["step"] for r in RunDir(run).read_metrics() if "eval_loss" in r].count(at) == 1


@pytest.fixture(scope="module")
def kept_run(tiny_setup, tmp_path_factory) -> Path:
    """A finished run of 4 steps that keeps steps 2 and 4; a test damages a copy of it."""
    run = tmp_path_factory.mktemp("kept") / "run"
    done = streamer(*train_argv(tiny_setup, run, "--eval-every", 0, "--save-every", 2, "--keep-last", 2,
                                tokenizer=False))
    assert done.returncode == 0 and "step 4 kept (kept steps: 2, 4)" in done.stdout, done.stderr
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def logged_steps(run: Path) -> list[int]:
    return [r["step"] for r in RunDir(run).read_metrics() if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["manifest damaged", "manifest deleted", "journal damaged"])
def test_a_damaged_manifest_or_journal_goes_back_to_an_intact_step(kept_run, tmp_path, damage):
    """A manifest that cannot be read goes back to the newest intact kept step (reading commands name it and
    --step); a journal that cannot be read goes back to the manifest's own step, whose files are intact."""
    run = copy_of(kept_run, tmp_path)
    store = run / "store"
    if damage == "manifest deleted":
        (store / "manifest.json").unlink()
    else:
        (store / ("manifest.json" if damage == "manifest damaged" else "journal.json")).write_text('{"step": ')
    if damage != "journal damaged":
        refused = streamer("export", str(run), str(tmp_path / "out"))
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert "manifest.json" in refused.stderr and "--step 4" in refused.stderr, refused.stderr
        assert "delete the folder" not in refused.stderr
        kept = streamer("export", str(run), str(tmp_path / "kept-4"), "--step", "4")
        assert kept.returncode == 0 and "exported step 4" in kept.stdout, kept.stderr
    on = streamer("train", "--resume", str(run), "--steps", "6")
    assert on.returncode == 0, on.stderr
    went_back = "its last commit" if damage == "journal damaged" else "the newest intact kept step"
    assert f"so the run goes back to step 4, {went_back}" in on.stdout, on.stdout
    assert "step 6 kept (kept steps: 4, 6)" in on.stdout, on.stdout
    assert logged_steps(run) == list(range(1, 7))


@pytest.mark.slow
def test_a_damaged_journal_of_a_half_updated_step_goes_back_to_a_kept_step(tiny_setup, tmp_path):
    """Killed in step 4's update (two units at step 4, the rest at 3) and its journal damaged: the updated units'
    step 3 files are gone, so the run goes back to the kept step 2 and trains on."""
    run = tmp_path / "run"
    argv = train_argv(tiny_setup, run, "--update-timing", "after-backward", "--eval-every", 0, "--save-every", 2,
                      "--keep-last", 2, tokenizer=False)
    killed = killed_in_update(argv, STEPS, 3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (run / "store" / "journal.json").write_text("not json{")
    done = streamer(*argv)
    assert done.returncode == 0, done.stderr
    assert "journal.json cannot be read" in done.stdout and "step 3 is damaged, so the run goes back to step 2, the " \
        "newest intact kept step" in done.stdout, done.stdout
    assert logged_steps(run) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_damaged_kept_record_is_named_and_its_files_stay(kept_run, tmp_path):
    """kept/2.json cannot be read: the run says so in one line and deletes none of step 2's state files, so the
    record restored makes step 2 readable again."""
    run = copy_of(kept_run, tmp_path)
    record = run / "store" / "kept" / "2.json"
    intact = record.read_text()
    files = [run / "store" / "slabs" / f"{u}.{g}.state" for u, g in json.loads(intact)["units"].items()]
    record.write_text(intact[:50])
    on = streamer("train", "--resume", str(run), "--steps", "6")
    assert on.returncode == 0, on.stderr
    assert f"{record} cannot be read" in on.stdout and "kept step(s) 2 cannot be gone back to or exported, and no " \
        "state file is deleted" in on.stdout, on.stdout
    assert all(f.is_file() for f in files)
    record.write_text(intact)
    out = streamer("export", str(run), str(tmp_path / "at-2"), "--step", "2")
    assert out.returncode == 0 and "exported step 2" in out.stdout, out.stderr


def test_save_every_alone_keeps_every_save_as_transformers_save_steps(tiny_setup, tmp_path):
    """--save-every without --keep-last keeps every save, as transformers' Trainer keeps every save_steps
    checkpoint unless save_total_limit is set."""
    run = tmp_path / "run"
    done = streamer(*train_argv(tiny_setup, run, "--steps", 6, "--eval-every", 0, "--save-every", 2, tokenizer=False))
    assert done.returncode == 0, done.stderr
    assert "step 6 kept (kept steps: 2, 4, 6)" in done.stdout, done.stdout
    assert sorted(int(p.stem) for p in (run / "store" / "kept").iterdir()) == [2, 4, 6]


def test_the_disk_check_counts_every_step_save_every_keeps(tiny_setup, small_disk):
    """On a 96 MiB disk the store fits, and 200 kept copies of its state do not: refused before writing,
    naming the flag that bounds them."""
    run = small_disk / "run"
    done = streamer(*train_argv(tiny_setup, run, "--steps", 200, "--save-every", 1, tokenizer=False))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "and 200 kept step(s): --save-every, --keep-last" in done.stderr, done.stderr
    assert not run.exists()
