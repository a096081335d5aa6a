"""Hints and error messages through the CLI: every hint printed works when followed, and every message names the
CLI flag that fixes it (not a Python argument)."""
from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamer.cli.main import build_parser, main
from test_cli import fails, run_cli
from streamer.io.chat import render

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def train_argv(setup: Path, run: Path, data: Path, *extra: object) -> list[object]:
    return ["train", "--model", setup / "config.json", "--data", data, "--tokenizer", setup / "tok", "--run-dir", run,
            "--steps", 2, "--batch", 2, "--seq", 32, "--dtype", "fp32", "--eval-fraction", 0, *extra]


def hints(out: str) -> list[str]:
    """The commands printed under `next (one command per line):`."""
    return [line.strip() for line in out.split("next (one command per line):", 1)[1].splitlines() if line.strip()]


def words(command: str) -> list[str]:
    """The words bash makes of a command line (the hints quote a prompt's newlines as $'...')."""
    done = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, text=True, check=True)
    return done.stdout.split("\0")[:-1]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """Prompt/completion records whose prompts are short and whose first one is unlike any demo prompt."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{k}: {k} plus one?\nA:", "completion": f" {k + 1}"}) + "\n"
                            for k in range(12)))
    return path


@pytest.fixture(scope="module")
def trained(tiny_setup, tmp_path_factory, pairs) -> tuple[Path, str]:
    """A 2-step run on `pairs` with a 4-token sample; (its folder, what `streamer train` printed)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(a) for a in train_argv(tiny_setup, run, pairs, "--sample-tokens", 4)]) == 0
    return run, out.getvalue()


def test_the_hints_use_the_data_s_first_prompt_and_work(trained, pairs, capsys):
    run, out = trained
    first = json.loads(pairs.read_text().splitlines()[0])["prompt"]
    generate, export, resume = hints(out)
    assert "Once upon a time" not in out
    assert "\n" in first and words(generate) == ["streamer", "generate", str(run), "--prompt", first]
    assert "sample: " + first in out  # the end-of-run sample continues the same prompt
    rc, printed, err = run_cli(capsys, *words(generate)[1:], "--max-new-tokens", 2)
    assert rc == 0 and printed.startswith(first), err
    assert words(resume) == ["streamer", "train", "--resume", str(run), "--steps", "4"]


def test_a_chat_run_s_sample_and_hint_are_rendered_with_its_template(tiny_setup, tmp_path, capsys):
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a loop."},
                    {"role": "assistant", "content": "for"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": conversation}) + "\n" for _ in range(6)))
    rc, out, err = run_cli(capsys, *train_argv(tiny_setup, tmp_path / "run", data, "--chat-template", template,
                                               "--seq", 64, "--sample-tokens", 2))
    assert rc == 0, err
    prompt = render(CHAT_TEMPLATE, conversation[:2], {"eos_token": "", "bos_token": ""}, add_generation_prompt=True)
    assert prompt == "<system> Be brief.\n<user> Name a loop.\n<assistant>"
    assert "sample: " + prompt in out
    assert words(hints(out)[0])[3:5] == ["--prompt", prompt]


def test_a_lora_run_s_header_says_lora_its_rank_and_trainable_params(tiny_setup, pairs, tmp_path, capsys):
    rc, out, err = run_cli(capsys, *train_argv(tiny_setup, tmp_path / "run", pairs, "--lora-rank", 4,
                                               "--sample-tokens", 0, "--steps", 1))
    assert rc == 0, err
    # q_proj and v_proj of 2 blocks, each A (4 x 64) and B (64 x 4)
    assert "LoRA rank 4 on q_proj,v_proj: 2,048 trainable params, the base frozen" in " ".join(out.split())


def test_negative_numbers_in_scientific_notation_reach_the_range_check(capsys):
    for value in ("-1e-4", "-1E-4", "-.5e1", "-2e+3"):
        assert fails(capsys, "train", "--lr", value) == f"error: --lr must be a positive number, got {float(value)}"
    assert "--warmup" in fails(capsys, "train", "--warmup", "-1")


SUBCOMMANDS = {"train": [], "plan": [], "eval": ["RUN", "--data", "x.jsonl"], "generate": ["RUN", "--prompt", "x"],
               "export": ["RUN", "OUT"], "trace": ["RUN"], "devices": [], "calibrate": [], "bench": []}


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_an_unknown_flag_names_the_closest_flag_and_the_command_s_help(command, capsys):
    if command == "bench":
        flag = "--quick"
    else:
        parser = build_parser([command])
        sub = next(a.choices[command] for a in parser._actions if a.dest == "command")
        flag = next(o for a in sub._actions for o in a.option_strings if len(o) > 5 and o != "--help")
    typo = flag[:3] + flag[4] + flag[3] + flag[5:]  # two letters swapped: --steps -> --stpes
    if command == "bench":  # its own process (streamer/cli/bench.py)
        done = subprocess.run([sys.executable, "-m", "streamer", "bench", typo, "3"], capture_output=True, text=True)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        line = done.stderr.strip()
    else:
        line = fails(capsys, command, *SUBCOMMANDS[command], typo, "3")
    assert f"{typo}: did you mean {flag}?" in line and line.endswith(f"see `streamer {command} --help`"), line


def test_messages_name_cli_flags(trained, tmp_path, capsys):
    run, _ = trained
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = fails(capsys, "export", run, out)
    assert "pass --overwrite" in line and "overwrite=True" not in line
    assert (out / "keep.txt").read_text() == "mine"
    if not torch.cuda.is_available():
        line = fails(capsys, "generate", run, "--prompt", "x", "--device", "cuda")
        assert "--device cpu" in line and "device='cpu'" not in line


def test_eval_takes_seq_up_to_the_model_s_context(trained, tmp_path, capsys):
    run, _ = trained
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": " ".join(["word"] * 14), "completion": " end"}) + "\n")  # 33-64 tokens
    assert "raise --seq" in fails(capsys, "eval", run, "--data", long)  # the run's --seq is 32
    rc, out, err = run_cli(capsys, "eval", run, "--data", long, "--seq", 64)
    assert rc == 0 and "of 64 tokens" in out, err
    line = fails(capsys, "eval", run, "--data", long, "--seq", 65)
    assert "exceeds the model's context (n_positions=64); use --seq 64 or less" in line


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".txt"])
def test_utf8_data_with_a_byte_order_mark_is_read(trained, tmp_path, capsys, suffix):
    run, _ = trained
    if suffix == ".csv":
        pytest.importorskip("datasets")
    body = {".jsonl": json.dumps({"prompt": "What is 1 plus one?\nAnswer:", "completion": " 2"}) + "\n",
            ".csv": "prompt,completion\nWhat is 1 plus one? Answer:, 2\n",
            ".txt": "The for statement is used to iterate over the elements of a sequence. " * 8}[suffix]
    data = tmp_path / f"excel{suffix}"
    data.write_bytes(b"\xef\xbb\xbf" + body.encode())
    rc, out, err = run_cli(capsys, "eval", run, "--data", data)
    assert rc == 0 and "perplexity" in out, err


def test_a_json_config_with_a_byte_order_mark_is_read(tiny_setup, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_bytes(b"\xef\xbb\xbf" + (tiny_setup / "config.json").read_bytes())
    rc, out, err = run_cli(capsys, "plan", "--model", config, "--target", "cs2", "--seq", 32, "--batch", 2)
    assert rc == 0 and "peak" in out, err


def test_a_run_dir_on_a_read_only_filesystem_is_named_so(tiny_setup, tmp_path, capsys, monkeypatch):
    """A read-only mount reports no free space; `streamer train` says it is read-only and names --run-dir, not
    that the disk has 0 B free. (The mount is simulated: statvfs reports it read-only and empty.)"""
    import os
    mount = tmp_path / "mount"
    mount.mkdir()
    statvfs = os.statvfs

    def read_only(path):  # as a read-only mount reports itself: flagged ST_RDONLY, no block available
        real = statvfs(path)
        if Path(path) != mount:
            return real
        fields = list(real)
        fields[4], fields[8] = 0, real.f_flag | os.ST_RDONLY  # f_bavail, f_flag
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", read_only)
    line = fails(capsys, *train_argv(tiny_setup, mount / "run", tiny_setup / "train.txt"))
    assert line == (f"error: {mount} is on a read-only filesystem, where the run's store cannot be written; "
                    "choose a folder on a writable one with --run-dir")
    assert list(mount.iterdir()) == []


# --- every flag an error advises is one its command takes ---------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
# The data layer's errors reach every command that reads --data (train, eval), but for these, each one command's
# own: generate's --messages and chat prompt, train's resumed batch order.
ONE_COMMANDS = {"read_messages": "generate", "chat_prompt": "generate", "BatchStream": "train"}
TORCHRUN = {"--nnodes", "--nproc-per-node"}  # torchrun's own, in the torchrun command a message prints


def _advised(path: Path) -> list[tuple[str, str]]:
    """(top-level function or class, message) for each error a module raises: its string parts joined."""
    advised = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            for r in ast.walk(node):
                if isinstance(r, ast.Raise):
                    advised.append((node.name, "".join(c.value for c in ast.walk(r)
                                                       if isinstance(c, ast.Constant) and isinstance(c.value, str))))
    return advised


def test_every_flag_an_error_advises_is_one_its_command_takes():
    """Each command's module, and the data layer for every command that reads --data: a flag an error names is
    one that command's parser takes, or one of the command the message tells to run (`train with --x`)."""
    commands = build_parser()._subparsers._group_actions[0].choices

    def takes(command: str) -> set[str]:
        return {o for action in commands[command]._actions for o in action.option_strings}

    def check(command: str, module: str) -> int:
        flags = 0
        for where, message in _advised(ROOT / "streamer" / module):
            named = re.findall(r"\b(train|eval|plan|generate|export) with\b|streamer (\w+)", message)
            allowed = takes(command).union(*(takes(a or b) for a, b in named if (a or b) in commands)) | TORCHRUN
            advised = set(re.findall(r"(--[a-z][a-z-]*)", message))
            assert advised <= allowed, (command, module, where, message)
            flags += len(advised)
        return flags

    checked = 0
    for command in ("train", "plan", "eval", "generate", "export", "trace", "devices", "calibrate"):
        library = {"train": ["cli/training.py", "session.py"], "export": ["export.py"]}.get(command, [])
        checked += sum(check(command, m) for m in [f"cli/{command}.py", *library])
    for module in ("io/data.py", "io/chat.py", "io/records.py", "io/tokenizer.py"):
        for where, message in _advised(ROOT / "streamer" / module):
            readers = [ONE_COMMANDS[where]] if where in ONE_COMMANDS else ["train", "eval"]
            for command in readers:
                advised = set(re.findall(r"(--[a-z][a-z-]*)", message))
                assert advised <= takes(command), (command, module, where, message)
                checked += len(advised)
    assert checked > 20  # the messages are found


def test_eval_reads_chat_data_with_the_template_its_error_advises(capsys, tmp_path, tiny_setup):
    """A run without a chat template, evaluated on chat data: the error names --chat-template, which eval takes;
    --pack and --long-examples are eval's too, as train's."""
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, *train_argv(tiny_setup, run, tiny_setup / "train.txt", "--steps", 1))
    assert rc == 0, err
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Hi {i}"},
                                                     {"role": "assistant", "content": "Hello."}]}) + "\n"
                            for i in range(4)))
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    error = fails(capsys, "eval", run, "--data", chat)
    assert "has no chat_template; pass --chat-template FILE" in error and "--tokenizer" not in error
    rc, out, err = run_cli(capsys, "eval", run, "--data", chat, "--chat-template", template)
    assert rc == 0, err
    assert "over 4 sequences" in out
    rc, out, err = run_cli(capsys, "eval", run, "--data", chat, "--chat-template", template, "--seq", 64, "--pack",
                           "--long-examples", "drop")
    assert rc == 0, err
    assert int(re.search(r"over (\d+) sequences", out).group(1)) < 4  # conversations share sequences


def test_a_folder_of_gguf_files_is_told_they_are_not_read(capsys, tmp_path, tiny_setup):
    """--from-pretrained on a folder holding a GGUF file alone: one line saying so, and nothing written."""
    folder = tmp_path / "gguf"
    folder.mkdir()
    (folder / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    error = fails(capsys, "train", "--from-pretrained", folder, "--data", tiny_setup / "train.txt",
                  "--run-dir", tmp_path / "run")
    assert "holds GGUF files (model-Q4_K_M.gguf), which are not read yet: pass the Hugging Face folder" in error
    assert not (tmp_path / "run").exists()
