"""`streamer train --method grpo`: the Python API's steps bit for bit, a kill during a rollout resumed as if none
came, a rollout's iterations resumed from the committed step, and bad input refused in one line."""
from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from layers import FAMILIES
from tests.conftest import PREFERENCE_CFG

CFG = PREFERENCE_CFG
PROMPTS = [{"prompt": "Say a word:", "answer": "a"}, {"prompt": "Name a color:", "answer": "red"},
           {"prompt": "Answer:", "answer": "yes"}]
REWARDS = '''import os, signal
from pathlib import Path

def lowercase(prompts, completions, **kw):
    return [sum(c.islower() or c == " " for c in t) / len(t) if t else 0.0 for t in completions]

def hits(prompts, completions, answer, **kw):
    return [float(a in c) for c, a in zip(completions, answer)]

def killing(prompts, completions, **kw):
    """SIGKILLs its process at the call the file `kill_at` names (counting in `calls`): inside a rollout."""
    calls = Path("calls")
    n = int(calls.read_text()) + 1 if calls.exists() else 1
    calls.write_text(str(n))
    if Path("kill_at").exists() and n == int(Path("kill_at").read_text()):
        os.kill(os.getpid(), signal.SIGKILL)
    return lowercase(prompts, completions)

def rank_killing(prompts, completions, **kw):
    """Under torchrun: SIGKILLs process 1 at its call the file `kill_at` names (counting in `calls.1`)."""
    if os.environ.get("RANK") == "1":
        calls = Path("calls.1")
        n = int(calls.read_text()) + 1 if calls.exists() else 1
        calls.write_text(str(n))
        if Path("kill_at").exists() and n == int(Path("kill_at").read_text()):
            os.kill(os.getpid(), signal.SIGKILL)
    return lowercase(prompts, completions)

def chat_hits(prompts, completions, answer, **kw):
    """Conversational completions: the assistant's message."""
    return [float(a in c[0]["content"]) + len(c[0]["content"]) / 10 for c, a in zip(completions, answer)]

def broken(prompts, completions, **kw):
    raise KeyError("answer")

def short(prompts, completions, **kw):
    return [1.0]
'''


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding the prompts and the reward module, the working directory (where `module:function` is
    imported from)."""
    (tmp_path / "cli_rewards.py").write_text(REWARDS)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _argv(llama_folder: Path, run: Path, *extra: object) -> list[str]:
    return [str(a) for a in ("train", "--method", "grpo", "--from-pretrained", llama_folder, "--data", "prompts.jsonl",
                             "--num-generations", 4, "--max-completion-length", 6, "--batch", 8, "--seq", 24,
                             "--dtype", "fp32", "--lr", 1e-3, "--steps", 3, "--run-dir", run, "--sample-tokens", 0,
                             *extra)]


def _logged(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_streamer_train_method_grpo_is_the_python_apis_steps(llama_folder: Path, work: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """LoRA with beta (the reference: the base with the adapters off), two iterations a rollout (the old policy's
    log-probabilities), two reward functions weighted, two micro-batches: each step's loss, rewards, advantages
    and completions are the Python API's (`GRPOLoop`), bit for bit; metrics.jsonl logs them and completions.jsonl
    holds each step's first prompt's completions."""
    from streamer import StreamingTrainer
    from streamer.grpo import GRPOLoop, GRPOSettings
    from streamer.io.tokenizer import load_tokenizer
    from streamer.rewards import Rewards
    from streamer.run_dir import RunDir
    from tests.test_cli import run_cli

    run = work / "run"
    rc, out, err = run_cli(capsys, *_argv(llama_folder, run, "--lora-rank", 4, "--beta", 0.05, "--num-iterations", 2,
                                          "--grad-accum", 2, "--reward-funcs", "cli_rewards:lowercase,cli_rewards:hits",
                                          "--reward-weights", "1,0.5", "--loss-type", "grpo"))
    assert rc == 0, err
    assert "3 train / 0 held-out prompts" in out and "reward" in out
    logged = [r for r in _logged(run) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3]
    for r in logged:
        assert len(r["completions"]) == len(r["advantages"]) == len(r["rewards"]) == 8
        assert {"reward", "reward_std", "rewards/cli_rewards:lowercase", "rewards/cli_rewards:hits"} <= r.keys()
    assert logged[0]["completions"] == logged[1]["completions"] != logged[2]["completions"]  # two iterations each
    sample = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in sample] == [1, 2, 3] and sample[2]["prompt"] == "Answer:"
    assert sample[0]["completions"] == logged[0]["completions"][:4]

    cfg = RunDir.open(run).read_config()
    objective = cfg.trainer.objective
    assert (objective.loss_type, objective.beta, objective.num_iterations) == ("grpo", 0.05, 2)
    rewards = Rewards(["cli_rewards:lowercase", "cli_rewards:hits"], [1.0, 0.5])
    with StreamingTrainer.from_pretrained(llama_folder, cfg.trainer, work / "store") as trainer:
        loop = GRPOLoop(trainer, load_tokenizer(run / "tokenizer"), PROMPTS, rewards,
                        GRPOSettings.of(objective, cfg.batch, cfg.trainer.seed))
        for r in logged:
            record = loop.step()
            assert record["loss"] == r["loss"] and trainer.grad_norm == r["grad_norm"]
            assert all(record[k] == r[k] for k in ("completions", "advantages", "rewards", "reward"))


def test_conversational_prompts_train_as_the_python_api(llama_folder: Path, work: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Prompts as conversations (TRL's conversational prompt-only format): each is rendered by the run's chat
    template with the assistant's header, and the reward functions get the assistant's messages; the steps are the
    Python API's bit for bit. A message without a role is one line naming the record and the field, and nothing is
    written."""
    from streamer import StreamingTrainer
    from streamer.grpo import GRPOLoop, GRPOSettings
    from streamer.io.records import read_prompts
    from streamer.io.tokenizer import load_tokenizer
    from streamer.rewards import Rewards
    from streamer.run_dir import RunDir
    from tests.test_cli import fails, run_cli

    chats = [{"prompt": [{"role": "user", "content": p["prompt"]}], "answer": p["answer"]} for p in PROMPTS]
    (work / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    run = work / "run"
    argv = _argv(llama_folder, run, "--reward-funcs", "cli_rewards:chat_hits")
    argv[argv.index("prompts.jsonl")] = "chats.jsonl"
    argv[argv.index("--seq") + 1], argv[argv.index("--steps") + 1] = "40", "2"
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0, err
    logged = [r for r in _logged(run) if "loss" in r]
    cfg = RunDir.open(run).read_config()
    tokenizer = load_tokenizer(run / "tokenizer")
    with StreamingTrainer.from_pretrained(llama_folder, cfg.trainer, work / "store") as trainer:
        loop = GRPOLoop(trainer, tokenizer, read_prompts("chats.jsonl"), Rewards(["cli_rewards:chat_hits"]),
                        GRPOSettings.of(cfg.trainer.objective, cfg.batch, cfg.trainer.seed))
        for r in logged:
            record = loop.step()
            assert record["loss"] == r["loss"] and record["rewards"] == r["rewards"]
            assert record["completions"] == r["completions"]
    assert loop.pending is not None
    assert tokenizer.decode(loop.pending.prompt_ids[0]).endswith(
        "Answer:<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")

    (work / "bad.jsonl").write_text(json.dumps({"prompt": [{"content": "Hi"}]}) + "\n")
    argv[argv.index("chats.jsonl")], argv[argv.index("--run-dir") + 1] = "bad.jsonl", str(work / "bad")
    message = fails(capsys, *argv)
    assert "bad.jsonl line 1: 'prompt': 'messages'[0] 'role' must be one of" in message and "Traceback" not in message
    assert not (work / "bad").exists()


def test_a_run_killed_during_a_rollout_resumes_bit_identically(llama_folder: Path, work: Path) -> None:
    """SIGKILLed while step 2's completions are scored (its rollout under way): the same command finishes the run
    as an uninterrupted one, bit for bit (the logged steps and the final weights)."""
    from streamer.run_dir import RunDir
    from streamer.session import open_trainer
    from tests.test_lifecycle import streamer

    argv = _argv(llama_folder, work / "whole", "--reward-funcs", "cli_rewards:killing")
    assert streamer(*argv).returncode == 0
    (work / "calls").unlink()
    (work / "kill_at").write_text("2")
    argv = _argv(llama_folder, work / "killed", "--reward-funcs", "cli_rewards:killing")
    killed = streamer(*argv)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [r["step"] for r in _logged(work / "killed")] == [1]
    done = streamer(*argv)
    assert done.returncode == 0, done.stderr

    def steps(run: Path) -> list[tuple[Any, ...]]:
        return [(r["step"], r["loss"], r["completions"], r["advantages"]) for r in _logged(run) if "loss" in r]
    assert steps(work / "killed") == steps(work / "whole") and len(steps(work / "whole")) == 3
    assert (work / "killed" / "completions.jsonl").read_text() == (work / "whole" / "completions.jsonl").read_text()
    with open_trainer(RunDir(work / "whole")) as a, open_trainer(RunDir(work / "killed")) as b:
        left, right = a.state_dict(), b.state_dict()
    assert all(torch.equal(left[k], right[k]) for k in left)


def test_a_rollouts_later_iterations_resume_from_the_committed_step(llama_folder: Path, work: Path) -> None:
    """With num_iterations 2, a trainer reopened from its store after step 1 steps on the same rollout (kept with
    the step) as one that went on: the same losses, bit for bit."""
    from streamer import StreamingTrainer, TrainerConfig
    from streamer.grpo import GRPOLoop, GRPOSettings
    from streamer.io.tokenizer import load_tokenizer
    from streamer.rewards import Rewards

    tokenizer, rewards = load_tokenizer(llama_folder), Rewards(["cli_rewards:lowercase"])
    settings = GRPOSettings(num_generations=4, max_completion_length=6, num_iterations=2, prompts_per_step=1)
    tc = TrainerConfig.of(dtype="fp32", lr=1e-3, store="disk")  # each step committed
    with StreamingTrainer.from_pretrained(llama_folder, tc, work / "whole") as trainer:
        loop = GRPOLoop(trainer, tokenizer, PROMPTS, rewards, settings)
        whole = [loop.step()["loss"] for _ in range(3)]
    with StreamingTrainer.from_pretrained(llama_folder, tc, work / "parted") as trainer:
        parted = [GRPOLoop(trainer, tokenizer, PROMPTS, rewards, settings).step()["loss"]]
    with StreamingTrainer.open(work / "parted") as trainer:
        assert trainer.extra_state["rollout"]["index"] == 0
        loop = GRPOLoop(trainer, tokenizer, PROMPTS, rewards, settings)
        parted.append(loop.step()["loss"])
        assert "rollout" not in trainer.extra_state  # the next step begins a rollout
        parted.append(loop.step()["loss"])
    assert parted == whole


@pytest.mark.parametrize("extra, line", [
    (("--reward-funcs", "cli_rewards:broken"), "reward function cli_rewards:broken raised KeyError: 'answer'"),
    (("--reward-funcs", "cli_rewards:short"), "reward function cli_rewards:short returned 1 rewards for 8 completions"),
    (("--reward-funcs", "cli_rewards:nothing"), "cli_rewards:nothing: cli_rewards has no function nothing"),
    ((), "--method grpo needs --reward-funcs module:function"),
    (("--reward-funcs", "cli_rewards:hits", "--reward-weights", "1,2"), "--reward-weights gives 2 weights for 1"),
    (("--reward-funcs", "cli_rewards:hits", "--num-generations", "3"),
     "--batch 8 completions do not split into groups of --num-generations 3"),
    (("--reward-funcs", "cli_rewards:hits", "--max-completion-length", "20"),
     "prompts.jsonl record 1's prompt is 8 tokens and --seq 24 leaves 4 beside --max-completion-length 20"),
    (("--reward-funcs", "cli_rewards:hits", "--loss-type", "sigmoid"),
     "--loss-type sigmoid is not one of GRPO's: dapo, grpo, dr_grpo, bnpo"),
], ids=["raises", "miscounts", "missing", "no-rewards", "weights", "groups", "long-prompt", "loss-type"])
def test_bad_grpo_input_is_one_line(llama_folder: Path, work: Path, capsys: pytest.CaptureFixture[str],
                                    extra: tuple[str, ...], line: str) -> None:
    """A reward function that raises or miscounts stops the run at that step with one line naming it (the run
    keeps its committed steps); bad settings and data are refused before anything is written."""
    from tests.test_cli import fails

    message = fails(capsys, *_argv(llama_folder, work / "run"), *extra)
    assert line in message and "Traceback" not in message
    if extra[:2] not in (("--reward-funcs", "cli_rewards:broken"), ("--reward-funcs", "cli_rewards:short")):
        assert not (work / "run").exists()


def test_the_documented_toy_command_learns(tmp_path: Path) -> None:
    """docs/CLI.md's GRPO command, as written (its run folder in tmp): the mean reward of the first 5 steps and of
    the last 5 are the figures the docs quote (measured 0.362 and 0.898), within 0.1 (another CPU's kernels
    sample other completions)."""
    import re
    import shlex
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "CLI.md").read_text()
    command = next(line for line in doc.splitlines() if line.startswith("streamer train --method grpo --model"))
    argv = shlex.split(command)[1:]
    argv[argv.index("--run-dir") + 1] = str(tmp_path / "run")
    done = subprocess.run([sys.executable, "-m", "streamer", *argv], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rewards = [r["reward"] for r in _logged(tmp_path / "run") if "reward" in r]
    assert len(rewards) == 15
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    quoted = re.search(r"rises from\s+([\d.]+) over the first 5 steps to ([\d.]+) over the last 5", doc)
    assert quoted is not None
    assert abs(first - float(quoted.group(1))) < 0.1 and abs(last - float(quoted.group(2))) < 0.1
    assert last > first + 0.3


def test_the_planner_prices_a_grpo_step_as_the_ledger_charges_it() -> None:
    """A GRPO step of rows padded to T is priced as a step of T tokens a row, plus the loss's fp32 number per
    position (layers/grpo.py): planner = ledger to the byte, LoRA or not, resident or checkpointed, with the old
    policy's and the reference's log-probabilities (forward passes before the step)."""
    from layers.grpo import GRPOLoss
    from memory_model import device_spec, plan
    from streamer import StreamingTrainer, TrainerConfig
    from streamer.grpo import completion_rows, grpo_step, token_logps

    cfg = dataclasses.replace(FAMILIES["llama"].example(), max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg.vocab_size, (10,), generator=g).tolist()] * 8
    completions = [torch.randint(1, cfg.vocab_size, (6 + i % 3,), generator=g).tolist() for i in range(8)]
    ids, labels = completion_rows(prompts, completions, 0)
    advantages = torch.randn(8, generator=g)
    for lora_rank in (0, 4):
        for activations in ("resident", "checkpoint"):
            tc = TrainerConfig.of(dtype="fp32", activations=activations, update_chunk=20_000, lora_rank=lora_rank,
                                  method="grpo", grad_accum=2)
            loss = GRPOLoss(beta=0.04 if lora_rank else 0.0, loss_type="grpo")
            with StreamingTrainer(cfg, tc) as trainer:
                old = token_logps(trainer, ids, labels)
                reference = token_logps(trainer, ids, labels, reference=True) if lora_rank else None
                grpo_step(trainer, loss, ids, labels, advantages, old, reference)
                real = trainer.ledger.peak, trainer.ledger.peak_breakdown
            predicted = plan(cfg, device_spec("h100-sxm"), tc.plan_config(8, ids.shape[1]))
            assert (predicted.peak_device_bytes, predicted.peak_breakdown) == real
            if activations == "resident":  # the 4 rows of a micro-batch, T positions of 4 bytes each, at the head
                sft = plan(cfg, device_spec("h100-sxm"), tc.replace(method="sft").plan_config(8, ids.shape[1]))
                head = [r.peak_bytes for r in predicted.rows if r.unit == "head"][0]
                assert head - [r.peak_bytes for r in sft.rows if r.unit == "head"][0] == 4 * 4 * ids.shape[1]


def test_the_planner_prices_a_rollouts_generation_as_the_ledger_charges_it() -> None:
    """A rollout's generation holds the KV cache of its prompt's rows at full length (every block's keys and
    values) beside each pass's units and hidden state: `rollout_plan`'s peak = the ledger's, to the byte, with the
    units streamed in each pass and resident from the prefill on, LoRA or not, at two prefetch depths, for Llama
    and for Gemma 3 (its own head_dim and key/value heads). Resident decoding samples the same completions bit for
    bit; `rollout` decodes resident where that peak fits the budget, else streamed."""
    from memory_model import device_spec
    from memory_model.allocator import workspace_bytes
    from memory_model.rollout import rollout_plan
    from streamer import StreamingTrainer, TrainerConfig
    from streamer.generate import Sampling, generate
    from streamer.grpo import rollout

    prompt, sampling = torch.tensor([list(range(1, 11))] * 4), Sampling(max_new_tokens=6, temperature=1.0)
    for family, lora_rank, prefetch in (("llama", 0, 1), ("llama", 4, 2), ("gemma3_text", 4, 1)):
        cfg = dataclasses.replace(FAMILIES[family].example(), max_position_embeddings=64)
        tc = TrainerConfig.of(dtype="fp32", lora_rank=lora_rank, prefetch=prefetch, method="grpo", num_generations=4,
                              max_completion_length=6)
        planned = rollout_plan(cfg, device_spec("h100-sxm"), tc.plan_config(8, 16))  # 2 prompts of 10 + 6 tokens
        with StreamingTrainer(cfg, tc) as trainer:
            outputs = []
            for resident, way in ((False, planned.streamed), (True, planned.resident)):
                trainer.ledger.reset_peak()
                outputs.append(generate(trainer, prompt, sampling, resident=resident))
                assert (way.peak_bytes, way.peak_breakdown) == (trainer.ledger.peak, trainer.ledger.peak_breakdown)
                assert trainer.ledger.live() == (3 if lora_rank else 0)  # (the adapters) nothing else is left
            assert outputs[0].shape == (4, 16) and torch.equal(outputs[0], outputs[1])
        # 4 rows of 16 positions, keys and values of fp32 per block; a decode pass's hidden state is one position
        cache = cfg.num_hidden_layers * 2 * 4 * cfg.num_key_value_heads * 16 * cfg.head_dim * 4
        assert planned.kv_cache_bytes == cache == planned.resident.peak_breakdown["activations"]
        for way in (planned.streamed, planned.resident):
            assert way.peak_bytes - way.decode_peak_bytes == 4 * 9 * cfg.hidden_size * 4
        assert planned.resident.peak_bytes > planned.streamed.peak_bytes
        assert planned.chose_resident and planned.resident.decode_s < planned.streamed.decode_s
        # On a device with room for the streamed peak alone, the plan streams.
        h100 = device_spec("h100-sxm")
        small = dataclasses.replace(h100, memory_bytes=planned.streamed.peak_bytes + h100.reserve_bytes
                                    + workspace_bytes(h100.cuda_arch))
        assert not rollout_plan(cfg, small, tc.plan_config(8, 16)).chose_resident
    # Without a budget the units stay; under one between the two peaks, they stream, and the ledger says so.
    for budget, way in ((None, planned.resident), (planned.resident.peak_bytes - 1, planned.streamed)):
        with StreamingTrainer(cfg, tc.replace(budget=budget)) as trainer:
            trainer.ledger.reset_peak()
            rollout(trainer, prompt[0].tolist(), 4, sampling, None)
            assert trainer.ledger.peak == way.peak_bytes


def test_sharded_grpo_or_a_kl_without_reference_is_refused_in_one_line(work: Path, monkeypatch: pytest.MonkeyPatch
                                                                      ) -> None:
    """Under torchrun each process samples its own rows, which a sharded store's exchanges at every unit load
    cannot follow: --data-parallel sharded GRPO is refused before it starts (replicated starts); so is --beta with
    full fine-tuning of a model initialised here (the reference is a checkpoint's)."""
    from streamer.run import RunConfig, RunError
    from streamer.session import check_startable
    cfg = RunConfig.of({"method": "grpo", "data": "prompts.jsonl", "reward_funcs": "cli_rewards:hits", "beta": 0.1})
    with pytest.raises(RunError, match="^--beta > 0 needs the reference model: with LoRA the base with the adapters "
                                       "off, with full fine-tuning the --from-pretrained checkpoint"):
        check_startable(cfg)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RunError, match="^--method grpo under torchrun samples each process's rows on its own, which "
                                       "--data-parallel sharded cannot .*; use --data-parallel replicated$"):
        check_startable(cfg.replace(beta=0.0, data_parallel="sharded"))
    check_startable(cfg.replace(beta=0.0))


def test_full_fine_tuning_grpo_with_beta_reads_the_initial_weights(llama_folder: Path, work: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Full fine-tuning with --beta: the KL's reference is the checkpoint, frozen in RUN/reference-store. A step,
    then the same command to step 2 (the reference store opened again), are the Python API's two steps
    (`frozen_reference`) bit for bit; step 2's reference log-probabilities are the initial model's, not the
    policy's."""
    from streamer import StreamingTrainer
    from streamer.grpo import GRPOLoop, GRPOSettings, completion_rows, frozen_reference, token_logps
    from streamer.io.tokenizer import load_tokenizer
    from streamer.rewards import Rewards
    from streamer.run_dir import RunDir
    from tests.test_cli import run_cli

    run = work / "run"
    argv = _argv(llama_folder, run, "--beta", 0.1, "--loss-type", "grpo", "--reward-funcs", "cli_rewards:lowercase")
    steps = argv.index("--steps") + 1
    argv[steps] = "1"
    assert run_cli(capsys, *argv)[0] == 0
    assert (run / "reference-store").is_dir()
    argv[steps] = "2"
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0, err
    logged = [r for r in _logged(run) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2]

    cfg = RunDir.open(run).read_config()
    tokenizer = load_tokenizer(run / "tokenizer")
    with StreamingTrainer.from_pretrained(llama_folder, cfg.trainer, work / "store") as trainer, \
            frozen_reference(llama_folder, cfg.trainer, work / "reference") as reference, \
            StreamingTrainer.from_pretrained(llama_folder, cfg.trainer, work / "initial") as initial:
        loop = GRPOLoop(trainer, tokenizer, PROMPTS, Rewards(["cli_rewards:lowercase"]),
                        GRPOSettings.of(cfg.trainer.objective, cfg.batch, cfg.trainer.seed), reference)
        for r in logged:
            record = loop.step()
            assert record["loss"] == r["loss"] and trainer.grad_norm == r["grad_norm"]
            assert record["completions"] == r["completions"] and record["advantages"] == r["advantages"]
        rollout = loop.pending
        assert rollout is not None and rollout.reference is not None
        ids, labels = completion_rows(rollout.prompt_ids, rollout.completion_ids, tokenizer.eos_id)
        first = token_logps(initial, ids, labels, cfg.trainer.objective.temperature)
        assert torch.equal(rollout.reference, first)
        assert not torch.equal(token_logps(trainer, ids, labels, cfg.trainer.objective.temperature), first)


def test_streamer_plan_prints_a_dpo_step_and_a_grpo_rollout_of_an_8b_on_an_h100(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`streamer plan --method dpo` prices a step of twice --batch rows; `--method grpo` also prices the rollout as
    the runtime makes it (each decode pass streams every unit), by the planner's timing model: the printed times
    are `plan`'s and `rollout_plan`'s."""
    import re
    from layers import ModelConfig
    from memory_model import device_spec, format_size, plan
    from memory_model.rollout import rollout_plan
    from streamer.run import RunConfig
    from tests.test_cli import run_cli

    shape, device = ModelConfig.named("llama-3.1-8b"), device_spec("h100-sxm")
    common = {"model": "llama-3.1-8b", "seq": 512, "lora_rank": 16, "store": "ram", "dtype": "bf16"}
    flags = [f for k, v in common.items() for f in (f"--{k.replace('_', '-')}", str(v))]
    rc, out, err = run_cli(capsys, "plan", *flags, "--target", "h100-sxm", "--method", "dpo", "--batch", "4")
    assert rc == 0, err
    dpo = plan(shape, device, RunConfig.of({**common, "method": "dpo", "batch": 4}).plan_config())
    assert f"a DPO step (4 pairs, 8 rows): {dpo.step_time_s:.3g} s" in out
    grpo = {"method": "grpo", "batch": 16, "num_generations": 8, "max_completion_length": 256, "beta": 0.04}
    rc, out, err = run_cli(capsys, "plan", *flags, "--target", "h100-sxm",
                           *[f for k, v in grpo.items() for f in (f"--{k.replace('_', '-')}", str(v))])
    assert rc == 0, err
    cfg = RunConfig.of({**common, **grpo}).plan_config()
    rollout = rollout_plan(shape, device, cfg)
    line = re.search(r"a GRPO rollout \(2 prompts of up to 256 tokens x 8 completions of 256 tokens, the units "
                     r"resident\): ([\d.]+) s \(prefill ([\d.]+) s, decode ([\d.]+) s, scoring ([\d.]+) s\)", out)
    assert line is not None, out
    assert [float(x) for x in line.groups()] == [float(f"{v:.3g}") for v in (
        rollout.total_s, rollout.prefill_s, rollout.decode_s, rollout.scoring_s)]
    assert rollout.chose_resident and rollout.decode_s == rollout.resident.decode_s
    # Streamed, each of the 2 x 255 decode passes loads the 8B base (16 GB of bf16) over the host link; resident,
    # it reads it from the device's memory: the rollout takes minutes, or seconds.
    assert rollout.streamed.decode_s > 2 * 255 * 16e9 / device.h2d.bandwidth_bytes_per_s
    assert rollout.resident.decode_s > 2 * 255 * 16e9 / device.device_mem_bandwidth
    assert rollout.total_s - rollout.decode_s + rollout.streamed.decode_s > 60 and rollout.total_s < 10
    assert rollout.scoring_s > 0 and rollout.prefill_s > 0
    # A prompt's 8 rows of 512 positions: 32 blocks' keys and values of 8 heads of 128 in bf16, 512 MiB.
    assert rollout.kv_cache_bytes == 32 * 2 * 8 * 8 * 512 * 128 * 2 == 512 * 2**20
    flat = " ".join(out.split())
    assert (f"Decoding with the units resident: {rollout.resident.decode_s:.3g} s, device peak "
            f"{format_size(rollout.resident.peak_bytes)} (") in flat
    assert (f"streamed in each pass: {rollout.streamed.decode_s:.3g} s, peak "
            f"{format_size(rollout.streamed.peak_bytes)}; a prompt's KV cache is 512 MiB.") in flat


@pytest.mark.slow
def test_grpo_under_torchrun_is_one_process_and_a_killed_run_resumes_bit_identically(llama_folder: Path,
                                                                                      work: Path) -> None:
    """`torchrun --nproc_per_node 2 -m streamer train --method grpo`, full fine-tuning with --beta (each process's
    frozen reference store): a step's one prompt has 8 completions, and each process samples the group whole (its
    seed: the same completions), keeps its 4, scores them, and gathers every reward, so the advantages read the
    whole group. The steps are one process's with --grad-accum 2: the same completions, rewards and advantages, the
    losses and weights to fp32 rounding of the all-reduce's order (measured equal on this CPU). Process 1
    SIGKILLed while it scores step 2's completions: the same command finishes the run as an uninterrupted torchrun
    run, bit for bit."""
    import subprocess
    import sys

    from streamer.run_dir import RunDir
    from streamer.session import open_trainer
    from tests.test_lifecycle import ENV, streamer

    def argv(run: str) -> list[str]:
        out = _argv(llama_folder, work / run, "--reward-funcs", "cli_rewards:rank_killing", "--beta", 0.05)
        out[out.index("--num-generations") + 1] = "8"
        return out

    def torchrun(run: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "-m", "streamer", *argv(run)], env=ENV, capture_output=True, text=True, timeout=300,
                              cwd=work)

    def steps(run: str) -> list[dict[str, Any]]:
        return [r for r in _logged(work / run) if "loss" in r]

    assert (done := torchrun("whole")).returncode == 0, done.stderr[-3000:]
    assert (done := streamer(*argv("one"), "--grad-accum", "2")).returncode == 0, done.stderr[-3000:]
    (work / "calls.1").unlink()
    (work / "kill_at").write_text("2")
    killed = torchrun("killed")
    assert killed.returncode != 0 and [r["step"] for r in steps("killed")] == [1]
    assert (done := torchrun("killed")).returncode == 0, done.stderr[-3000:]

    assert [r["step"] for r in steps("whole")] == [1, 2, 3]
    for parallel, one in zip(steps("whole"), steps("one"), strict=True):
        assert all(parallel[k] == one[k] for k in ("completions", "rewards", "advantages"))
        assert parallel["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert [(r["loss"], r["completions"]) for r in steps("killed")] == \
        [(r["loss"], r["completions"]) for r in steps("whole")]
    with open_trainer(RunDir(work / "whole")) as a, open_trainer(RunDir(work / "killed")) as b, \
            open_trainer(RunDir(work / "one")) as c:
        whole, resumed, alone = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    # A hundredth of the most three AdamW steps move a weight (3 x lr), as tests/test_dpo.py's ranks.
    assert max((whole[k] - alone[k]).abs().max().item() for k in whole) <= 0.01 * 3e-3
