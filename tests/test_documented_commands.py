"""Every shell command the docs show a user is run here, as a subprocess, the way a user types it.

Commands come from the fenced code blocks of README.md and docs/*.md, the usage lines of examples/*.py
and the examples of every `--help`. Before running, the documented override (docs/CLI.md, "How the
documented commands are tested") fills the placeholders (RUN, HF_DIR, data files) with small stand-ins
made here and shrinks the sizes that would take minutes (steps, sequence length, tokens generated); the
flags and their combinations stay as written. A command that no rule can run fails the test: nothing
documented is skipped silently.

Figures the docs quote from a command are checked against what the command prints, at full size (see
"figures quoted from a command" below and docs/CLI.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import runpy
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import TINY_RUN_MODEL
from layers import PRESETS, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ("streamer", "torchrun", "python", "make")
SUBCOMMANDS = ("train", "plan", "eval", "generate", "export", "trace", "devices", "calibrate", "bench")
# Commands the test does not run, each with the reason; CI itself runs these two.
NOT_RUN = {"make demo": "CI runs the README's commands from a clean clone", "make test": "CI's own command",
           "streamer bench": "tests/test_bench.py runs it, at --quick, as a subprocess",
           "make bench": "the same as streamer bench"}
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


def file_commands() -> list[tuple[str, str]]:
    """(where, command) for every command in the docs' fenced blocks and the examples' usage lines."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), re.S):
            found += [(path.name, c) for c in _commands_in(block)]
    for path in sorted((ROOT / "examples").glob("*.py")):
        docstring = path.read_text().split('"""')[1]
        found += [(path.name, c) for c in _commands_in(docstring)]
    return found


def help_commands() -> list[tuple[str, str]]:
    """(where, command) for the examples of every --help (each a subprocess, so asked for only where needed)."""
    found = []
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
    """A trained run (3 steps), a Hugging Face folder and the same saved 4-bit and 8-bit, a GGUF file,
    prompt/completion data and a settings file."""
    from pydoc_data.topics import topics

    from streamer.io.tokenizer import load_tokenizer
    from tests.test_gguf import write_gguf
    from tests.test_qlora8 import write_bnb_8bit
    from tests.test_qlora_targets import write_bnb_4bit
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
    # A chat template (short: a prompt of 64 tokens at most), so that `streamer generate RUN --chat ...` runs.
    (root / "chat.jinja").write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                                     "{% if add_generation_prompt %}assistant:{% endif %}")
    done = subprocess.run([sys.executable, "-m", "streamer", "train", "--model", tiny_setup / "config.json",
                           "--data", tiny_setup / "train.txt", "--tokenizer", tiny_setup / "tok", "--run-dir", run,
                           "--steps", "3", "--batch", "4", "--seq", "64", "--dtype", "fp32", "--sample-tokens", "0",
                           "--chat-template", root / "chat.jinja"],
                          capture_output=True, text=True, env=_env(), cwd=root)
    assert done.returncode == 0, done.stderr
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Topic {k}?", "chosen": " " + " ".join(topics[k].split()[:6]),
                                         "rejected": " I do not know."}) + "\n" for k in sorted(topics)[:8]))
    return {"root": root, "hf": hf, "data": data, "toml": root / "run.toml", "run": run, "pairs": pairs,
            "gguf": write_gguf(root / "model.gguf"), "bnb4": write_bnb_4bit(hf, root / "bnb-4bit"),
            "bnb8": write_bnb_8bit(hf, root / "bnb-8bit")}


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
    run_copy = work / "run"
    if not run_copy.exists():
        shutil.copytree(stand_ins["run"], run_copy)
    files = {"train.jsonl": stand_ins["data"], "summaries.jsonl": stand_ins["data"], "FILE": stand_ins["data"],
             "run.toml": stand_ins["toml"], "MODEL.gguf": stand_ins["gguf"], "pairs.jsonl": stand_ins["pairs"],
             **{name: stand_ins[key] for name, key in (("BNB4_DIR", "bnb4"), ("BNB8_DIR", "bnb8")) if key in stand_ins}}
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
        elif before in ("--model", "--data") and (ROOT / word).is_file():
            word = str(ROOT / word)  # a config.json or data the repository ships, named from its root
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
        model = out.index("--model") + 1 if "--model" in out else None
        if model is not None and Path(out[model]).is_file():
            # A harness check of the family: its test example, as the scale run's smallest preset is (a bench of
            # the 110M-parameter file's contenders took 107 s at --quick).
            example = work / "bench-model.json"
            example.write_text(json.dumps(type(ModelConfig.named(out[model])).example().adapter().to_hf()))
            out[model] = str(example)
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


def command_groups(commands: list[tuple[str, str]]) -> dict[str, list[str]]:
    """The commands to run, by source, in order. One source's commands run in order in one folder (an example
    writes the data its shell line reads; a --run-dir is continued or read by the next line). A command shown in
    several places runs once, in its first source, unless it makes a --run-dir that a later line of its source
    reads."""
    sources: dict[str, list[str]] = {}
    for where, command in commands:
        if command not in NOT_RUN:
            sources.setdefault(where, []).append(command)

    def read_later(where: str, k: int) -> bool:
        """Whether a later line of `where` reads the --run-dir that its line k makes."""
        words = sources[where][k].split()
        run_dir = words[words.index("--run-dir") + 1] if "--run-dir" in words else None
        return run_dir is not None and any(run_dir in later for later in sources[where][k + 1:])

    groups: dict[str, list[str]] = {}
    seen = set()
    for where, lines in sources.items():
        for k, command in enumerate(lines):
            if command not in seen or read_later(where, k):
                seen.add(command)
                groups.setdefault(where, []).append(command)
    return groups


def run_group(where: str, commands: list[str], stand_ins: dict[str, Path], work: Path) -> list[str]:
    """Run one source's commands in order in `work`; what failed, one entry per command."""
    work.mkdir()
    failures = []
    launched = set()
    for command in commands:
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
        for proc, err in zip(procs, errs, strict=True):
            if proc.returncode != 0 or "Traceback" in err:
                failures.append(f"{where}: {command}\n  ran {shlex.join(argv[1:])}\n  exit {proc.returncode}: "
                                f"{err.strip()[-800:]}")
    return failures


HELP = "every --help"
# Each file's commands are a test of their own, and every --help's together, so that the test workers share them.
SOURCES = [*command_groups(file_commands()), HELP]


def test_the_data_parallel_launch_is_documented():
    assert any(c.startswith("torchrun") for _, c in file_commands())


@pytest.mark.parametrize("source", SOURCES)
def test_every_documented_command_runs(source, stand_ins, tmp_path):
    commands = file_commands() + (help_commands() if source == HELP else [])
    groups = {where: lines for where, lines in command_groups(commands).items()
              if where == source or (source == HELP and where.endswith("--help"))}
    failures = [f for where, lines in groups.items()
                for f in run_group(where, lines, stand_ins, tmp_path / re.sub(r"\W+", "-", where))]
    assert not failures, "\n".join(failures)


# --- figures quoted from a command -------------------------------------------------------------------------------
# A figure the docs quote from a command sits between `<!-- figures: COMMAND -->` (one line per command; the
# command is also shown to the reader inside the region) and `<!-- /figures -->`. The command runs as written, at
# full size, and every figure of the region must be in its output at the precision the doc prints: a number with a
# size unit (`778 MiB`, `1.83 GiB`), a number with decimals or thousands separators (`49.2`, `0.4%`, `56,142,848`,
# which also matches 56142848) and every `--flag value` quoted in backticks (advice the command prints).
FIGURES = re.compile(r"<!-- figures: (.+?) -->\n((?:[ \t]*<!-- figures: .+? -->\n)*)(.*?)<!-- /figures -->", re.S)
SIZE_UNITS = "GiB|MiB|KiB|GB|MB|kB|TB"
FIGURE = re.compile(rf"(?<![\w.,-])(?:(\d[\d,]*(?:\.\d+)?) ?({SIZE_UNITS})\b"
                    rf"|(\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?|\d+\.\d+))")
# Commands whose figures the docs quote; a paragraph naming one (and the paragraph after it, a table it introduces)
# may quote a figure only inside a region.
FIGURE_COMMANDS = re.compile(r"streamer\s+plan\s+--"
                             r"(?:model|target|config|dtype|update-on|store|activations|batch|seq)\b"
                             r"|plan_devices\.py")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _flat(text: str) -> str:
    return " ".join(text.replace("`", " ").split())


def figure_regions() -> list[tuple[str, list[str], str]]:
    """(file, commands, the region's text) for every figures region of README.md and docs/*.md."""
    regions = []
    for path in DOCS:
        for m in FIGURES.finditer(path.read_text()):
            first, more, body = m.groups()
            regions.append((path.name, [first, *re.findall(r"<!-- figures: (.+?) -->", more)], body))
    return regions


def quoted_figures(commands: list[str], body: str, flags: bool = True) -> list[str]:
    """The figures a region quotes (with `flags`, also the `--flag value`s in backticks), its commands aside."""
    advice = re.findall(r"`(--[\w-]+ [^`]*\d[^`]*)`", body) if flags else []
    text = _flat(body)
    for command in commands:
        text = text.replace(_flat(command), " ")
    figures = [f"{number} {unit}" if unit else bare for number, unit, bare in FIGURE.findall(text)]
    return figures + advice


def printed(figure: str, output: str) -> bool:
    """`figure` in `output` at the same precision: not as a part of a longer number."""
    if figure.startswith("--"):
        return _flat(figure) in output
    number, _, unit = figure.partition(" ")
    spellings = {number, number.replace(",", "")}
    tail = rf" ?{unit}\b" if unit else r"(?![\d])"
    return any(re.search(rf"(?<![\d.,]){re.escape(s)}{tail}", output) for s in spellings)


def test_figure_regions_are_well_formed_and_cover_every_figure_beside_a_planning_command():
    for path in DOCS:
        text = path.read_text()
        covered = [(m.start(), m.end()) for m in FIGURES.finditer(text)]
        assert len(covered) == text.count("<!-- /figures -->"), f"{path.name}: a figures region is not closed"
        # Prose only: code spans, code blocks and comments blanked out, each character's offset kept.
        prose = re.sub(r"```.*?```|`[^`]*`|<!--.*?-->", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
        # Paragraphs: separated by blank lines; each list item is one.
        shape = re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", "x", m.group()), text, flags=re.S)
        paragraphs = [(m.start(), m.end()) for m in
                      re.finditer(r"(?:- )?[^\n]*\S[^\n]*\n?(?:(?!- )[^\n]*\S[^\n]*\n?)*", shape)]
        for i, (start, end) in enumerate(paragraphs):
            before = text[paragraphs[i - 1][0]:paragraphs[i - 1][1]].strip() if i else ""
            # The paragraph naming the command, or the one it introduces (after a colon or a code block).
            introduced = before.endswith((":", "```")) and FIGURE_COMMANDS.search(before)
            if not (FIGURE_COMMANDS.search(text[start:end]) or introduced):
                continue
            outside = [m.group() for m in FIGURE.finditer(prose, start, end)
                       if not any(lo <= m.start() < hi for lo, hi in covered)]
            assert not outside, (f"{path.name}: {outside} are quoted beside a planning command outside a figures "
                                 f"region:\n{text[start:end][:300]}")
        for m in FIGURES.finditer(text):
            # The reader sees the command: in the region, or in the code block just before it (the region's other
            # commands may be told as changes of its flags).
            shown = _flat(re.sub(r"<!--.*?-->", " ", text[max(0, m.start() - 400):m.end()], flags=re.S))
            assert any(_flat(c) in shown for c in [m.group(1), *re.findall(r"<!-- figures: (.+?) -->", m.group(2))]), \
                f"{path.name}: the figures region of {m.group(1)!r} shows none of its commands"


@functools.cache
def printed_by(command: str) -> str:
    """What `command` prints (stdout and stderr, whitespace collapsed), run in this process: planning is cheap once
    torch is imported. Exit status 0, or 2 with one `error:` line (a refusal that names its advice)."""
    program, *args = shlex.split(command)
    # A config.json the repository ships, named from its root (as `override` does)
    args = [str(ROOT / a) if i and args[i - 1] == "--model" and (ROOT / a).is_file() else a for i, a in enumerate(args)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if program == "streamer":
            from streamer.cli.main import main
            rc = main(args)
        elif program == "python" and args[0].startswith("examples/"):
            saved = sys.argv
            sys.argv = [str(ROOT / args[0]), *args[1:]]
            try:
                runpy.run_path(sys.argv[0], run_name="__main__")
                rc = 0
            finally:
                sys.argv = saved
        else:
            raise AssertionError(f"no rule runs {command!r}")
    refused = rc == 2 and err.getvalue().startswith("error: ") and err.getvalue().count("\n") == 1
    assert rc == 0 or refused, f"{command}\n{err.getvalue()[-2000:]}"
    return _flat(out.getvalue() + " " + err.getvalue())


@pytest.mark.parametrize("where, commands, body", figure_regions(),
                         ids=[f"{w}:{c[0][:60]}" for w, c, _ in figure_regions()])
def test_every_quoted_figure_is_what_its_command_prints(where, commands, body, tmp_path, monkeypatch):
    """Each command of the region, as written and at full size (planning is cheap), prints every figure quoted."""
    monkeypatch.chdir(tmp_path)  # nothing a command might write lands in the checkout
    output = " ".join(printed_by(command) for command in commands)
    figures = quoted_figures(commands, body)
    assert figures, f"{where}: a figures region quotes no figure"
    missing = [f for f in figures if not printed(f, output)]
    assert not missing, f"{where}: {missing} are not what {commands} print"
