"""A run folder nobody may write (archived, shared, on a read-only mount) serves generate, eval, export and trace,
and they leave it as it was.

The tests run as root, which permission bits do not stop: the commands then run as `nobody` (setpriv), so the
folder is read-only for them as it is on a read-only mount. They run in one process, through the CLI's entry
point, since each process spends seconds importing torch.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from test_cli import run_cli, tiny_args

AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
# Each command line through `streamer.cli.main.main`, with its exit status and output.
DRIVER = """
import contextlib, io, json, sys
from streamer.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    results.append({"argv": argv, "rc": rc, "out": out.getvalue(), "err": err.getvalue()})
print(json.dumps(results))
"""


def _chmod_tree(root: Path, writable: bool) -> None:
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder every user may enter (pytest's own are the owner's alone), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="read-only-run-"))
    root.chmod(0o755)
    yield root
    _chmod_tree(root, writable=True)
    shutil.rmtree(root)


def _run_read_only(folder: Path, run: Path, argvs: list[list[str]]) -> list[dict[str, Any]]:
    """Run the command lines where `run` cannot be written: as this user if it is not root, else as nobody;
    skipped, saying why, where nothing here makes the folder read-only for the commands."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root, which ignores permission bits, and setpriv is missing to drop to nobody")
        prefix = AS_NOBODY
    # The commands' user must read the checkout (a clone in a `mktemp -d` folder is its owner's alone).
    probe = subprocess.run([*prefix, sys.executable, "-c", f"import streamer; open({str(run / 'probe')!r}, 'w')"],
                           cwd=folder, capture_output=True, text=True, timeout=60)
    if probe.returncode == 0:
        (run / "probe").unlink()
        pytest.skip(f"{'nobody' if prefix else 'this user'} can still write a folder with no write permission")
    if "PermissionError" not in probe.stderr:
        pytest.skip(f"the commands cannot run as nobody here: {probe.stderr.strip().splitlines()[-1]}")
    env = {**os.environ, "HOME": str(folder / "home"), "MPLCONFIGDIR": str(folder / "home" / "mpl")}
    done = subprocess.run([*prefix, sys.executable, "-c", DRIVER, json.dumps(argvs)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _state(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry of the folder with its size, modification time and mode."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_mode)
            for p in [root, *root.rglob("*")]}


def test_a_read_only_run_serves_every_reading_command(capsys, tiny_setup, shared_folder):
    run, out, setup = shared_folder / "run", shared_folder / "out", shared_folder / "setup"
    shutil.copytree(tiny_setup, setup)  # the model's config.json, which the run names, and the data
    for path in [setup, *setup.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # readable by the commands' user
    assert run_cli(capsys, *tiny_args(setup, run, 2))[0] == 0
    data = setup / "held-out.txt"
    data.write_text((setup / "train.txt").read_text()[:2000])
    data.chmod(0o644)
    for path in (out, shared_folder / "home"):
        path.mkdir()
        path.chmod(0o777)  # the commands' own user writes its exports, plots and caches here
    bare = shared_folder / "archived"  # an archive without the lock file: reading must not need to create it
    shutil.copytree(run, bare)
    (bare / "store" / "lock").unlink()
    for folder in (run, bare):
        _chmod_tree(folder, writable=False)
    before = _state(run), _state(bare)
    results = _run_read_only(shared_folder, run, [
        ["generate", str(run), "--prompt", "The for statement", "--max-new-tokens", "4"],
        ["eval", str(run), "--data", str(data)],
        ["export", str(run), str(out / "hf")],
        ["trace", str(run)],
        ["trace", str(run), "--out", str(out / "memory.png")],
        ["generate", str(bare), "--prompt", "The for statement", "--max-new-tokens", "4"],
    ])
    for result in results:
        assert result["rc"] == 0 and result["err"] == "", result
    generate, evaluated, exported, trace, plotted, archived = (r["out"] for r in results)
    assert "tokens in" in generate and archived.splitlines()[0] == generate.splitlines()[0]  # the same text
    assert "perplexity" in evaluated and "exported step 2" in exported
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "model.safetensors").is_file()
    assert f"plot: not written ({run} is read-only); pass --out FILE.png" in trace
    assert f"plot: {out / 'memory.png'}" in plotted and (out / "memory.png").stat().st_size > 10_000
    assert (_state(run), _state(bare)) == before  # nothing created, changed or removed in the run folders
