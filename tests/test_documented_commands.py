"""Every shell command the docs show a user is run here, as a subprocess, the way a user types it.

Commands come from the fenced code blocks of README.md and docs/*.md, the usage lines of examples/*.py
and the examples of every `--help`. Before running, the documented override (docs/CLI.md, "How the
documented commands are tested") fills the placeholders (RUN, HF_DIR, data files) with small stand-ins
made here and shrinks the sizes that would take minutes (steps, sequence length, tokens generated); the
flags and their combinations stay as written. A command that no rule can run fails the test: nothing
documented is skipped silently.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import TINY_RUN_MODEL
from layers import PRESETS

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ("streamer", "torchrun", "python", "make")
SUBCOMMANDS = ("train", "plan", "generate", "export", "trace", "calibrate", "bench")
# Commands the test does not run, each with the reason; CI itself runs these two.
NOT_RUN = {"make demo": "CI runs the README's commands from a clean clone", "make test": "CI's own command"}
# Sizes that would take minutes are shrunk to these at most (flags keep their place and meaning).
AT_MOST = {"--steps": 2, "--warmup": 1, "--seq": 64, "--max-new-tokens": 8, "--batch": 8, "--trace-every": 1,
           "--step": 2}


# --- extraction ------------------------------------------------------------------------------------------------
def _commands_in(text: str) -> list[str]:
    """Lines that start with a program, `\\`-continuations joined, `# comments` and `[optional]` parts dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = (pending + " " + raw.strip()) if pending else raw.strip()
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        pending = ""
        line = re.sub(r"\s#\s.*$", "", line)
        line = re.sub(r"\[[^\]]*\]", "", line).strip()
        words = line.split()
        if len(words) >= 1 and words[0] in PROGRAMS:
            if words[0] == "streamer" and len(words) > 1 and words[1] not in SUBCOMMANDS \
                    and not words[1].startswith("-"):
                continue  # prose such as "streamer ──> layers"
            out.append(" ".join(words))
    return out


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every command in the docs, the examples' usage lines and every --help."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), re.S):
            found += [(path.name, c) for c in _commands_in(block)]
    for path in sorted((ROOT / "examples").glob("*.py")):
        docstring = path.read_text().split('"""')[1]
        found += [(path.name, c) for c in _commands_in(docstring)]
    for sub in ("", *SUBCOMMANDS):
        help_text = subprocess.run([sys.executable, "-m", "streamer", *sub.split(), "--help"], capture_output=True,
                                   text=True, check=True, cwd=ROOT).stdout
        examples = help_text.split("examples:", 1)[1] if "examples:" in help_text else ""
        # Columns: the command, then two or more spaces, then what it does.
        lines = [re.split(r"\s{3,}", line.strip())[0] if not line.rstrip().endswith("\\") else line
                 for line in examples.splitlines()]
        found += [(f"streamer {sub} --help".replace("  ", " "), c) for c in _commands_in("\n".join(lines))]
    return found


# --- the stand-ins -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, tiny_setup, tiny_hf_model) -> dict[str, Path]:
    """A trained run (3 steps), a Hugging Face folder, prompt/completion data and a settings file."""
    from pydoc_data.topics import topics

    from streamer.io.tokenizer import load_tokenizer
    root = tmp_path_factory.mktemp("documented")
    hf = root / "hf"
    # The default --seq (128) fits its context, as it does a real checkpoint's.
    tiny_hf_model(dataclasses.replace(TINY_RUN_MODEL, n_positions=128)).save_pretrained(hf)
    load_tokenizer(tiny_setup / "tok").save(hf)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(topics[k].split()[:8]) + "\nTopic:", "completion": f" {k}"})
                            + "\n" for k in sorted(topics)))
    (root / "run.toml").write_text(f'model = "{tiny_setup / "config.json"}"\ndata = "{tiny_setup / "train.txt"}"\n'
                                   f'tokenizer = "{tiny_setup / "tok"}"\nseq = 32\nbatch = 4\n')
    run = root / "run"
    done = subprocess.run([sys.executable, "-m", "streamer", "train", "--model", tiny_setup / "config.json",
                           "--data", tiny_setup / "train.txt", "--tokenizer", tiny_setup / "tok", "--run-dir", run,
                           "--steps", "3", "--batch", "4", "--seq", "32", "--dtype", "fp32", "--sample-tokens", "0"],
                          capture_output=True, text=True, env=_env(), cwd=root)
    assert done.returncode == 0, done.stderr
    return {"root": root, "hf": hf, "data": data, "toml": root / "run.toml", "run": run}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def override(command: str, stand_ins: dict[str, Path], work: Path) -> list[str]:
    """The documented override: placeholders -> stand-ins made by this test, big sizes -> small ones."""
    words = shlex.split(command)
    program, args = words[0], words[1:]
    if command in NOT_RUN:
        raise AssertionError(f"{command!r} is not run: {NOT_RUN[command]}")
    if program == "make" and args == ["gpu-check"]:
        program, args = "python", ["benchmarks/gpu_check.py"]
    if program == "make" and args == ["bench"]:
        program, args = "streamer", ["bench"]
    run_copy = work / "run"
    if not run_copy.exists():
        shutil.copytree(stand_ins["run"], run_copy)
    files = {"train.jsonl": stand_ins["data"], "summaries.jsonl": stand_ins["data"], "run.toml": stand_ins["toml"]}
    writes_hf = args[:1] == ["export"]
    out = []
    for i, word in enumerate(args):
        before = args[i - 1] if i else ""
        if word in ("HF_DIR", "./gptj-hf", "./gpt-j-6b", "./hf-out", "./exported-hf"):
            word = str(work / "exported" if writes_hf else stand_ins["hf"])  # export writes one, train reads one
        elif word.startswith("./gptj-hf/"):
            word = str(stand_ins["hf"] / word.removeprefix("./gptj-hf/"))
        elif word in ("RUN", "DIR") or re.fullmatch(r"runs/(NAME|demo-[\d-]+)", word):
            word = str(run_copy)
        elif word.startswith("RUN/"):
            word = str(run_copy / word.removeprefix("RUN/"))
        elif word in files:
            word = str(files[word])
        elif word.startswith(("/tmp/", "/shared/")):
            word = str(work / word.split("/", 2)[2])
        elif before in AT_MOST and word.isdigit():
            word = str(min(int(word), AT_MOST[before]))
        out.append(word)
    train = out.index("train") + 1 if "train" in out[:4] and program in ("streamer", "torchrun") else None
    if train is not None:
        model = out.index("--model") + 1 if "--model" in out else None
        if model is not None and out[model] in PRESETS and PRESETS[out[model]].num_params() > 3 * 10**8:
            out[model] = "gptj-debug"  # a measurement at scale, shown with its command: its flags still run
        if "--resume" in out or str(run_copy) in out:
            out[out.index("--steps") + 1] = "4"  # past the stand-in run's 3 steps, so there is a step to train
        out += ["--sample-tokens", "0", "--eval-every", "0"]
        if "--from-pretrained" in out or "--config" in out:
            out += ["--eval-fraction", "0"]
        if "--steps" not in out:
            out += ["--steps", str(AT_MOST["--steps"])]
    if program == "streamer" and out[:1] == ["bench"]:
        out += ["--quick", "--output", str(work / "BENCHMARKS.md")]
    if program == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *out]
    if program == "streamer":
        return [sys.executable, "-m", "streamer", *out]
    if program == "python":
        if out[:2] == ["-m", "benchmarks.soak"]:
            out += ["--warmup", "1", "--no-compare"]
        if out and out[0].endswith(".py"):
            out[0] = str(ROOT / out[0])
            if out[0].endswith(("finetune_summarization.py", "hf_roundtrip.py")):
                out += ["--steps", str(AT_MOST["--steps"])]
        return [sys.executable, *out]
    raise AssertionError(f"no rule runs the documented command {command!r}: add one to the override")


def nodes(argv: list[str]) -> list[list[str]]:
    """A launch on several machines (`torchrun --nnodes N ... --rdzv-endpoint HOST:PORT`) as its N nodes, each its
    own --node-rank, at a free port of 127.0.0.1; any other command as itself."""
    if "--nnodes" not in argv:
        return [argv]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    out = []
    for rank in range(int(argv[argv.index("--nnodes") + 1])):
        node = [endpoint if word == "HOST:PORT" else word for word in argv]
        node[node.index("--node-rank") + 1] = str(rank)
        out.append(node)
    return out


def test_every_documented_command_runs(stand_ins, tmp_path):
    commands = documented_commands()
    assert any(c.startswith("torchrun") for _, c in commands), "the data-parallel launch must be documented"
    # One source's commands run in order in one folder (an example writes the data its shell line reads; a
    # --run-dir is continued or read by the next line); sources run side by side. A command shown in several
    # places runs once, unless it makes a --run-dir that a later line of its source reads.
    groups: dict[str, list[str]] = {}
    seen = set()
    for where, command in commands:
        if command not in NOT_RUN and (command not in seen or "--run-dir" in command):
            seen.add(command)
            groups.setdefault(where, []).append(command)

    def run_group(where: str) -> list[str]:
        work = tmp_path / re.sub(r"\W+", "-", where)
        work.mkdir()
        failures = []
        launched = set()
        for command in groups[where]:
            argv = override(command, stand_ins, work)
            launch = nodes(argv)
            key = re.sub(r"--node-rank \d+", "--node-rank R", shlex.join(argv))
            if key in launched:
                continue  # another node's line of a launch that has run
            launched.add(key)
            procs = [subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                      cwd=work, stdin=subprocess.DEVNULL) for node in launch]
            try:
                errs = [proc.communicate(timeout=300)[1] for proc in procs]
            finally:  # a launch that hung: torchrun's own processes too
                for proc in procs:
                    for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
                        child.kill()
                    proc.kill()
                    proc.communicate()
            for proc, err in zip(procs, errs):
                if proc.returncode != 0 or "Traceback" in err:
                    failures.append(f"{where}: {command}\n  ran {shlex.join(argv[1:])}\n  exit {proc.returncode}: "
                                    f"{err.strip()[-800:]}")
        return failures

    with cf.ThreadPoolExecutor(2) as pool:
        failures = [f for group in pool.map(run_group, groups) for f in group]
    assert not failures, "\n".join(failures)
