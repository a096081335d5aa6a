"""Hostile input through the CLI as a user types it: links planted in a run folder, sizes no machine holds, data
and templates built to exhaust memory or time, process limits. Each is refused in one line, fast, and nothing
outside the run folder is written."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamer.run_dir import RunDir
from test_cli import fails, run_cli
from test_cli_messages import train_argv

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def disk_run(tiny_setup, tmp_path_factory) -> Path:
    """A 2-step disk-tier run with its trace, plot and metrics."""
    run = tmp_path_factory.mktemp("linked") / "run"
    rc = run_cli_quiet(*train_argv(tiny_setup, run, tiny_setup / "train.txt", "--store", "disk", "--sample-tokens", 0))
    assert rc == 0
    return run


def run_cli_quiet(*argv: object) -> int:
    import contextlib
    import io

    from streamer.cli.main import main
    with contextlib.redirect_stdout(io.StringIO()):
        return main([str(a) for a in argv])


def linked_copy(run: Path, tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A copy of `run` whose file `name` is a link to a copy of that file outside it; (the copy, the outside file)."""
    copy, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(run, copy)
    (copy / name).rename(outside)
    (copy / name).symlink_to(outside)
    return copy, outside


LINKED = ["store/slabs/head.grad", "store/manifest.json", "trace.json", "trace.chrome.json", "memory.png",
          "metrics.jsonl"]


@pytest.mark.parametrize("name", LINKED)
def test_a_link_in_a_run_folder_is_refused_before_training(disk_run, tmp_path, capsys, name):
    copy, outside = linked_copy(disk_run, tmp_path, name)
    line = fails(capsys, "train", "--resume", copy, "--steps", 3)
    assert line == (f"error: {copy / name} is a symbolic link, and a run writes its files only in its own folder: "
                    "remove the link (nothing it points to was written) and run the command again")
    assert outside.read_bytes() == (disk_run / name).read_bytes() and (copy / name).is_symlink()
    if name != "store/manifest.json":
        assert RunDir(copy).committed_step() == 2


@pytest.mark.parametrize("name", ["store/slabs/head.grad", "store/manifest.json", "trace.json", "memory.png",
                                  "metrics.jsonl"])
def test_each_write_refuses_a_link_on_its_own(disk_run, tmp_path, capsys, monkeypatch, name):
    """The check before training aside (a link planted while the run trains): the write itself follows no link."""
    monkeypatch.setattr(RunDir, "refuse_links", lambda self: None)
    copy, outside = linked_copy(disk_run, tmp_path, name)
    line = fails(capsys, "train", "--resume", copy, "--steps", 3, "--sample-tokens", 0)
    assert line.startswith(f"error: {copy / name} is a symbolic link"), line
    assert outside.read_bytes() == (disk_run / name).read_bytes() and (copy / name).is_symlink()


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_export_onto_a_linked_folder_is_one_line_naming_it(disk_run, tmp_path, capsys, overwrite):
    target = tmp_path / "target"
    target.mkdir()
    (target / "kept.txt").write_text("mine")
    (tmp_path / "out").symlink_to(target)
    line = fails(capsys, "export", disk_run, tmp_path / "out", *overwrite)
    expected = (f"{tmp_path / 'out'} is a symbolic link; export to the folder it points to ({target}) or choose a "
                "new folder") if overwrite else \
        f"{tmp_path / 'out'} is not empty; choose a new folder or pass --overwrite"
    assert line == f"error: {expected}"
    assert (tmp_path / "out").is_symlink() and [p.name for p in target.iterdir()] == ["kept.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "target"]  # no partial export left beside it


# --- sizes and work no machine could hold --------------------------------------------------------------------
def refused_quickly(capsys, *argv: object) -> str:
    """The command's one-line refusal, in well under a few seconds of CPU (refused in closed form, before anything is
    built per layer, expert, record or loop iteration). CPU time rather than wall time, which on a shared machine is
    anyone's."""
    began = time.process_time()
    line = fails(capsys, *argv)
    assert time.process_time() - began < 3, line
    return line


def hostile_config(tmp_path: Path, setup: Path, **sizes: object) -> Path:
    raw = {**json.loads((setup / "config.json").read_text()), **sizes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("sizes, says", [
    ({"n_layer": 10**9}, "num_hidden_layers 1,000,000,000 is more than 2,048"),
    ({"vocab_size": 10**12}, "TiB of training state (16 B/param), more than any machine holds (256 TiB)"),
])
@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_config_no_machine_holds_is_refused_at_once(tiny_setup, tmp_path, capsys, sizes, says, command):
    config = hostile_config(tmp_path, tiny_setup, **sizes)
    where = ["--run-dir", tmp_path / "run"] if command == "train" else []
    line = refused_quickly(capsys, command, "--model", config, "--seq", 32, *where)
    assert says in line and line.endswith("check the config's sizes")
    assert not (tmp_path / "run").exists()


def test_a_billion_experts_is_refused_at_once(tmp_path, capsys):
    from layers import FAMILIES
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**FAMILIES["qwen3_moe"].example().adapter().to_hf(), "num_experts": 10**9}))
    line = refused_quickly(capsys, "plan", "--model", config, "--seq", 16)
    assert "1,000,000,000 experts per block is more than 8,192" in line


def test_deeply_nested_json_is_one_line(tiny_setup, tmp_path, capsys):
    nested = "[" * 100_000 + "]" * 100_000
    config = tmp_path / "config.json"
    config.write_text(nested)
    assert "nests its JSON deeper than Python's parser goes" in refused_quickly(capsys, "plan", "--model", config)
    data = tmp_path / "data.jsonl"
    data.write_text(nested + "\n")
    line = refused_quickly(capsys, *train_argv(tiny_setup, tmp_path / "run", data))
    assert f"{data} line 1 nests its JSON deeper" in line


def test_a_record_longer_than_the_limit_is_refused_before_it_is_read_whole(tiny_setup, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "word " * 10_000_000}) + "\n")
    line = refused_quickly(capsys, *train_argv(tiny_setup, tmp_path / "run", data))
    assert line == (f"error: {data} line 2 is longer than 4 MiB, the most one record may hold (about a million "
                    "tokens); split it into several records")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("template, says", [
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
     "more than 1,000,000 loop iterations and calls"),
    ("{% for i in range(10**8) %}{% endfor %}", "more than 1,000,000 loop iterations and calls"),
    ("{{ 'a' * 10**9 }}", "a value of more than 16,777,216 elements from `*`"),
    ("{{ 7 ** 1000000000 }}", "a value of more than 16,777,216 elements from `**`"),
])
def test_a_chat_template_that_would_hang_or_fill_memory_is_refused(tiny_setup, tmp_path, capsys, template, says):
    path = tmp_path / "chat.jinja"
    path.write_text(template + "{% for m in messages %}{{ m.content }}{% endfor %}")
    data = tmp_path / "chat.jsonl"
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data.write_text(json.dumps({"messages": conversation}) + "\n")
    line = refused_quickly(capsys, *train_argv(tiny_setup, tmp_path / "run", data, "--chat-template", path))
    assert f"the chat template went past its bounds rendering 1 message(s) ({says})" in line, line


# --- process limits ----------------------------------------------------------------------------------------------
def mid_sized(tmp_path: Path) -> Path:
    """A 300M-parameter model: its RAM-tier store needs 6.6 GiB, headroom included."""
    from layers import GPTJConfig
    path = tmp_path / "mid.json"
    path.write_text(json.dumps(GPTJConfig(n_embd=1024, n_layer=24, n_head=16, rotary_dim=64, vocab_size=512,
                                          n_positions=64).adapter().to_hf()))
    return path


def test_the_ram_check_counts_the_address_space_limit(tmp_path):
    """Under `ulimit -v` the allocator fails however much the machine has free: the check says so first."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))

    done = subprocess.run([sys.executable, "-m", "streamer", "train", "--model", str(mid_sized(tmp_path)),
                           "--store", "ram", "--seq", "32", "--steps", "1", "--run-dir", str(tmp_path / "run")],
                          preexec_fn=limit, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "GiB of RAM (--store ram; " in done.stderr
    assert "left of the process's 3.00 GiB address-space limit, ulimit -v)" in done.stderr
    assert "what would fit: --store disk" in done.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("version", [1, 2])
def test_the_ram_check_counts_the_cgroup_memory_limit(tmp_path, capsys, monkeypatch, version):
    from streamer import resources
    proc, root = tmp_path / "cgroup", tmp_path / "sys"
    group = (root / "memory" if version == 1 else root) / "jobs" / "mine"
    group.mkdir(parents=True)
    limit, usage = ("memory.limit_in_bytes", "memory.usage_in_bytes") if version == 1 else ("memory.max",
                                                                                          "memory.current")
    (group / limit).write_text(f"{4 * 2**30}\n")
    # 3 GiB used, 2 GiB of it page cache (a finished run's files) that the kernel reclaims: 3 GiB left
    (group / usage).write_text(f"{3 * 2**30}\n")
    cache = ("total_active_file", "total_inactive_file") if version == 1 else ("active_file", "inactive_file")
    (group / "memory.stat").write_text(f"anon {2**30}\n{cache[0]} {2**30}\n{cache[1]} {2**30}\n")
    (group.parent / limit).write_text("max\n" if version == 2 else f"{2**63 - 4096}\n")  # no limit above it
    (group.parent / usage).write_text(f"{2**31}\n")
    proc.write_text("4:memory:/jobs/mine\n" if version == 1 else "0::/jobs/mine\n")
    monkeypatch.setattr(resources, "CGROUP_ROOT", root)
    monkeypatch.setattr(resources, "PROC_CGROUP", proc)
    line = fails(capsys, "train", "--model", mid_sized(tmp_path), "--store", "ram", "--seq", 32, "--steps", 1,
                 "--run-dir", tmp_path / "run")
    assert "(--store ram; 3.00 GiB left of its cgroup's 4.00 GiB memory limit)" in line, line
    assert not (tmp_path / "run").exists()


# --- stopping ----------------------------------------------------------------------------------------------------
def signalled(tiny_setup: Path, run: Path, store: str, *signals: int) -> tuple[subprocess.CompletedProcess, int]:
    """A long run of `store`, saved every 2 steps, sent `signals` (a millisecond apart) once step 3 is logged;
    (what it did, the step its folder continues from)."""
    argv = train_argv(tiny_setup, run, tiny_setup / "train.txt", "--steps", 1000, "--store", store, "--save-every", 2)
    proc = subprocess.Popen([sys.executable, "-m", "streamer", *map(str, argv)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    while (not metrics.is_file() or len(metrics.read_text().splitlines()) < 3) and proc.poll() is None:
        time.sleep(0.005)
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.001)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), RunDir(run).committed_step()


@pytest.mark.parametrize("sig, said, code", [(signal.SIGTERM, "terminated", 143), (signal.SIGINT, "interrupted", 130)])
def test_a_stopped_run_says_which_step_it_continues_from(tiny_setup, tmp_path, sig, said, code):
    done, step = signalled(tiny_setup, tmp_path / "run", "disk", sig)
    assert done.returncode == code and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr == (f"{said}; continue from step {step}, the last committed step with "
                           f"`streamer train --resume {tmp_path / 'run'}`\n")


def test_a_stopped_ram_tier_run_says_its_last_save_is_where_it_continues(tiny_setup, tmp_path):
    done, step = signalled(tiny_setup, tmp_path / "run", "ram", signal.SIGINT)
    assert done.returncode == 130 and done.stderr.count("\n") == 1, done.stderr
    assert f"interrupted; continue from step {step}, the RAM-tier store's last save (--save-every 2; " in done.stderr
    assert step % 2 == 0 and f"`streamer train --resume {tmp_path / 'run'}`" in done.stderr


@pytest.mark.parametrize("signals", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT)])
def test_a_second_signal_stops_at_once_without_a_traceback(tiny_setup, tmp_path, signals):
    done, step = signalled(tiny_setup, tmp_path / "run", "disk", *signals)
    # Where the second lands: in the first one's clean-up (its own line, naming the command), after the first
    # one's line (nothing more), or, past Python's shutdown resetting the handlers, on the default action.
    assert done.returncode in (130, 143, -signal.SIGINT), done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert f"`streamer train --resume {tmp_path / 'run'}`" in done.stderr
    assert RunDir(tmp_path / "run").committed_step() == step


def test_a_killed_exports_staging_folder_goes_at_the_next_export_and_a_live_ones_stays(disk_run, tmp_path, capsys):
    import fcntl
    out = tmp_path / "hf"
    killed = subprocess.Popen([sys.executable, "-m", "streamer", "export", str(disk_run), str(out)], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while not list(tmp_path.glob(".hf.partial-*")) and killed.poll() is None:
        time.sleep(0.001)
    killed.kill()
    killed.communicate()
    left = list(tmp_path.glob(".hf.partial-*"))
    assert len(left) == 1 and not out.exists(), killed.returncode  # what a kill leaves
    live = tmp_path / ".hf.partial-live"  # another export's, in progress: it holds its folder's lock
    live.mkdir()
    lock = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        rc, _, err = run_cli(capsys, "export", disk_run, out)
    finally:
        os.close(lock)
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.partial-live", "hf"]


def test_a_chat_template_looping_without_calls_is_stopped_by_its_time_limit(tiny_setup, tmp_path, capsys, monkeypatch):
    """Nested loops over a long string make no call and no range: the render's timer stops them (shortened here)."""
    from streamer.io import chat
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    path = tmp_path / "chat.jinja"
    path.write_text("{% set s = 'a' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
                    "{% for m in messages %}{{ m.content }}{% endfor %}")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    line = refused_quickly(capsys, *train_argv(tiny_setup, tmp_path / "run", data, "--chat-template", path))
    assert "the chat template went past its bounds rendering 1 message(s) (more than 0.5 s)" in line, line
