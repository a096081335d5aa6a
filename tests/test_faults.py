"""Fault injection at tiny sizes: one changed byte in each file a run folder holds, and a filesystem that fills
during a RAM-tier save. Each damaged file is either refused in one line naming it (nothing on disk changes), gone
back from to the newest intact kept step (said in one line), named in one line and left unused (a kept step's
record), or not read at all: the run then trains to the weights of an undamaged copy, bit for bit. Never is a
damaged byte used. Kills, symbolic links and hostile sizes have their own tests (test_lifecycle.py,
test_reliability.py, test_hostile_input.py).

One tiny run of each kind (full fine-tuning, LoRA, DPO) is made once; each case damages a copy of it and continues it
(`streamer train --resume COPY --steps 3`, in this process)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamer.cli.main import main
from streamer.run_dir import RunDir
from streamer.trainer import StreamingTrainer
from test_lifecycle import (ENV, assert_same_run, fill_after_first_step, reference, small_disk,
                            streamer, train_argv)

__all__ = ["reference", "small_disk"]  # fixtures this module's tests request by name
pytestmark = pytest.mark.xdist_group("faults")  # one worker makes the runs every case copies

# Each kind's flags after the tiny run's (test_lifecycle.train_argv); DPO trains on PAIRS, written beside it.
KINDS = {"full": (), "lora": ("--lora-rank", 4), "dpo": ("--method", "dpo", "--eval-fraction", 0, "--eval-every", 0)}
PAIRS = [{"prompt": f"Question {i}: what is {i} and {i}?", "chosen": f" It is {2 * i}.", "rejected": " I do not know."}
         for i in range(8)]
REFUSED, BACK, NAMED, UNREAD = "refused in one line", "gone back from", "named, not used", "not read"
# What continuing a run does with each file of its folder, changed by one byte (`roles` finds them).
CASES = [
    ("full", "config.toml", REFUSED), ("full", "manifest.json", BACK), ("full", "kept record", NAMED),
    ("full", "state file", BACK), ("full", "tokenizer.json", REFUSED), ("full", "tokenizer_config.json", REFUSED),
    ("full", "special_tokens_map.json", REFUSED), ("full", "metrics.jsonl", UNREAD), ("full", "unread", UNREAD),
    ("lora", "lora file", BACK), ("lora", "state file", REFUSED), ("lora", "unread", UNREAD),
    ("dpo", "reference.json", REFUSED),
]
# Files continuing a run does not read (a later step overwrites them, or only going back to a kept step reads them,
# which checks them then): the store's lock, the gradients of a step no journal replays, the state and LoRA files
# only kept steps name, and the trace and plot of the last invocation, which `streamer trace` shows.
UNREAD_NAMES = ("lock", ".grad", ".state", ".safetensors", "trace.json", "trace.chrome.json", "memory.png")


def roles(run: Path) -> dict[str, list[Path]]:
    """Every file of a run folder by its role; `unread` holds the rest, each of UNREAD_NAMES' kinds."""
    store = run / "store"
    manifest = json.loads((store / "manifest.json").read_text())
    found = {
        "config.toml": [run / "config.toml"], "manifest.json": [store / "manifest.json"],
        "metrics.jsonl": [run / "metrics.jsonl"], "kept record": sorted((store / "kept").glob("*.json")),
        "state file": [store / "slabs" / f"{unit}.{g}.state" for unit, g in sorted(manifest["units"].items())],
        "lora file": [p for p in [store / f"lora-{manifest['step']:08d}.safetensors"] if p.is_file()],
        **{p.name: [p] for p in (run / "tokenizer").iterdir()},
        "reference.json": [p for p in [run / "reference.json"] if p.is_file()],
    }
    named = {p for paths in found.values() for p in paths}
    found["unread"] = sorted(p for p in run.rglob("*") if p.is_file() and p not in named)
    return found


def change(path: Path) -> None:
    """One byte of `path` changed: in a text file the digit nearest its middle (so it stays well-formed, and only
    a checksum can tell), else one bit of its middle byte (an empty file, the lock, has none)."""
    data = bytearray(path.read_bytes())
    if not data:
        return
    middle = len(data) // 2
    if path.suffix in (".json", ".jsonl", ".toml"):
        digits = [i for i, b in enumerate(data) if chr(b).isdigit()]
        if digits:
            i = min(digits, key=lambda i: abs(i - middle))
            data[i] = ord(str((int(chr(data[i])) + 1) % 10))
            path.write_bytes(data)
            return
    data[middle] ^= 0x10
    path.write_bytes(data)


def cli(*argv: object) -> tuple[int, str, str]:
    """`streamer ARGV` in this process: (status, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def weights(run: Path) -> dict[str, torch.Tensor]:
    with StreamingTrainer.open(RunDir(run).store, read_only=True) as trainer:
        assert trainer.step_count == 3
        return trainer.state_dict()


@pytest.fixture(scope="module")
def runs(tiny_setup, tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """Each kind's run at step 2 (steps 1 and 2 kept), and the weights its undamaged copy trains to at step 3."""
    made = {}
    for kind, extra in KINDS.items():
        root = tmp_path_factory.mktemp(kind)
        if kind == "dpo":
            (root / "pairs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
            extra = (*extra, "--data", root / "pairs.jsonl")
        rc, _, err = cli(*train_argv(tiny_setup, root / "run", "--steps", 2, "--eval-every", 1, "--save-every", 1,
                                     "--keep-last", 2, *extra))
        assert rc == 0, err
        continued: dict[str, torch.Tensor] = {}
        if any(k == kind and outcome != REFUSED for k, _, outcome in CASES):
            shutil.copytree(root / "run", root / "continued")
            rc, _, err = cli("train", "--resume", root / "continued", "--steps", 3)
            assert rc == 0, err
            continued = weights(root / "continued")
        made[kind] = (root / "run", continued)
    return made


@pytest.mark.parametrize("kind", KINDS)
def test_every_file_of_a_run_has_a_case(runs, kind):
    """A file a later version adds to the run folder gets a case here before it is trusted."""
    found = roles(runs[kind][0])
    assert all(p.name.endswith(UNREAD_NAMES) for p in found["unread"]), found["unread"]
    assert {role for role, paths in found.items() if paths} <= {role for _, role, _ in CASES}, found


@pytest.mark.parametrize("kind, role, outcome", CASES)
def test_a_changed_byte_in_any_file_is_refused_gone_back_from_or_unread(runs, kind, role, outcome, tmp_path):
    source, reference_weights = runs[kind]
    run = tmp_path / "run"
    shutil.copytree(source, run)
    damaged = roles(run)[role]
    assert damaged, role
    if outcome != UNREAD:
        damaged = damaged[:1]  # one file at a time: the others of its role are the same kind
    for path in damaged:
        change(path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    rc, out, err = cli("train", "--resume", run, "--steps", 3)
    said = " ".join(out.split())
    if outcome == REFUSED:
        where = damaged[0].parent if damaged[0].parent.name == "tokenizer" else damaged[0]
        assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and str(where) in err, err
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing changed
        return
    assert rc == 0, err
    if outcome == BACK:
        assert f"{damaged[0]}" in said and "so the run goes back to step" in said, out[-2000:]
    if outcome == NAMED:
        assert f"{damaged[0]}" in said and "cannot be gone back to or exported" in said, out[-2000:]
    if outcome == UNREAD:
        assert "back to step" not in said, out[-2000:]
    got = weights(run)
    assert all(torch.equal(got[k], reference_weights[k]) for k in reference_weights)
    assert [r["step"] for r in RunDir(run).read_metrics() if "loss" in r] == [1, 2, 3]


def test_a_filesystem_that_fills_during_a_ram_tier_save_keeps_the_last_save(tiny_setup, reference, small_disk):
    """The RAM tier's save at step 2 finds the disk full: one line says the run keeps its last save (step 0) and how
    to continue; with room again the same command ends bit-identical to an uninterrupted run, each step logged once."""
    run, filler = small_disk / "run", small_disk / "filler"
    argv = train_argv(tiny_setup, run, "--store", "ram", "--save-every", 2, tokenizer=False)
    proc = subprocess.Popen([sys.executable, "-m", "streamer", *argv], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    fill_after_first_step(proc, run, filler)  # before the save at step 2
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.count("\n") == 1 and err.startswith("error: disk full while writing "), err
    assert f"{run} keeps its last committed step: free space and continue with `streamer train --resume {run}`" in err
    assert RunDir(run).committed_step() == 0
    filler.unlink()
    done = streamer(*argv)
    assert done.returncode == 0, done.stderr
    assert_same_run(run, reference)
