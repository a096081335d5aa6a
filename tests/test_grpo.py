"""GRPO on the streamed step against TRL's GRPOTrainer (the reference, test-only): the same tiny Llama that
transformers wrote, the same prompts and completions (fed to TRL through its rollout_func, so only the generation
is replaced), the same rewards. Step 1's loss and every gradient within twice TRL's own fp32 noise (TRL in float32
against TRL in float64), for each loss type, with and without beta, LoRA and full fine-tuning."""
from __future__ import annotations

import contextlib
import dataclasses
import unittest.mock
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from layers import FAMILIES
from layers.grpo import GRPOLoss, group_advantages
from streamer import StreamingTrainer, TrainerConfig
from streamer.errors import ConfigError, StreamerError
from streamer.grpo import completion_rows, frozen_reference, grpo_step, token_logps
from streamer.weights import hf_state_dict
from streamer.rewards import RewardError, Rewards
from tests.test_data_cli import write_tokenizer
from tests.test_dpo import _set_adapters, record_gradients
from tests.conftest import PREFERENCE_CFG

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

CFG = PREFERENCE_CFG
PROMPTS = ["Say a word:", "Name a color:"]  # of equal token counts, so TRL left-pads neither
GENERATIONS = 4
TARGETS = ("q_proj", "v_proj", "down_proj")
MAX_COMPLETION = 8
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def tuned_folder(llama_folder: Path) -> Path:
    """llama_folder's model with every weight moved (by 0.02 standard normals): a policy that full fine-tuning has
    taken away from its reference, the checkpoint, so beta's KL and its gradient are not 0."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    folder = llama_folder.parent / "tuned"
    model.save_pretrained(folder)
    write_tokenizer(folder, "qwen")
    return folder


def _completions(prompt_index: int, eos: int) -> list[list[int]]:
    """Each prompt's fixed completions: token ids of several lengths, some ended by end-of-text."""
    g = torch.Generator().manual_seed(prompt_index)
    out = []
    for k in range(GENERATIONS):
        length = 2 + (3 * k + prompt_index) % (MAX_COMPLETION - 1)
        ids = torch.randint(10, 300, (length,), generator=g).tolist()
        out.append(ids[:-1] + [eos] if k % 2 else ids)
    return out


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward of the completion's text: its length, in characters, over 10."""
    return [len(c) / 10 for c in completions]


def _trl(folder: Path, dtype: torch.dtype, settings: dict[str, Any], lora: bool,
         policy: Path | None = None) -> dict[str, Any]:
    """One GRPOTrainer step over PROMPTS with the fixed completions, in two micro-batches: its loss, gradients (by
    PEFT key), the rows it scored in its order, their advantages and the adapters it started from. `policy`: a
    checkpoint whose weights the model takes (full fine-tuning), its reference staying `folder`'s (TRL loads the
    reference from the path the model was loaded from)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    if policy is not None:
        model.load_state_dict(transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=dtype).state_dict())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.eos_token
    eos = tokenizer.eos_token_id
    out: dict[str, Any] = {"rollouts": []}

    def rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        assert len({len(ids) for ids in prompt_ids}) == 1  # no left padding (its rows would be NaN in float64)
        completion_ids = []
        for i, p in enumerate(prompts):  # the k-th row of a prompt's group takes its completion k
            completion_ids.append(_completions(PROMPTS.index(p), eos)[prompts[:i].count(p) % GENERATIONS])
        out["rollouts"].append((prompt_ids, completion_ids))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    peft_config = None
    if lora:
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(TARGETS),
                                      init_lora_weights=False, task_type="CAUSAL_LM")
    args = trl.GRPOConfig(output_dir=str(folder.parent / f"trl-{dtype}"), learning_rate=1e-3, logging_steps=1,
                          report_to="none", use_cpu=True, save_strategy="no", seed=0, bf16=False, fp16=False,
                          per_device_train_batch_size=len(PROMPTS) * GENERATIONS // 2, gradient_accumulation_steps=2,
                          num_generations=GENERATIONS,
                          max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE, max_steps=1,
                          max_grad_norm=0.0, disable_dropout=True, **settings)
    torch.manual_seed(0)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=length_reward, args=args, processing_class=tokenizer,
                              train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                              peft_config=peft_config, rollout_func=rollout)
    out["initial"] = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    compute_loss = trainer.compute_loss

    def recorded(model: Any, inputs: dict[str, Any], *rest: Any, **kw: Any) -> torch.Tensor:
        out["advantages"] = torch.cat([out.get("advantages", torch.empty(0)), inputs["advantages"].detach()])
        # The rows in the order TRL steps on them (it shuffles the generation batch), trimmed of their padding.
        rows = zip(inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"],
                   strict=True)
        out["rows"] = out.get("rows", []) + [(p[m.bool()].tolist(), c[k.bool()].tolist()) for p, m, c, k in rows]
        loss = compute_loss(model, inputs, *rest, **kw)
        out["loss"] = out.get("loss", 0.0) + float(loss.detach())  # each micro-batch's share of the step's loss
        return loss
    trainer.compute_loss = recorded

    record_gradients(trainer, out)
    trainer.train()
    out["grad_norm"] = float(trainer.state.log_history[0]["grad_norm"])
    out["kl"] = trainer.state.log_history[0].get("kl")
    return out


def _ours(folder: Path, reference: dict[str, Any], settings: dict[str, Any], lora: bool,
          policy: Path | None = None) -> dict[str, Any]:
    from streamer.io.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(folder)
    prompt_ids, completion_ids = reference["rollouts"][0]
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completion_ids]
    advantages = group_advantages(torch.tensor(length_reward(texts)), GENERATIONS,
                                  settings.get("scale_rewards", "group"))
    # TRL's rows, in its order: each one's advantage is its generation's.
    order = [list(zip(prompt_ids, completion_ids, strict=True)).index(row) for row in reference["rows"]]
    advantages = advantages[order]
    ids, labels = completion_rows([prompt_ids[i] for i in order], [completion_ids[i] for i in order],
                                  tokenizer.eos_id)
    loss = GRPOLoss(beta=settings.get("beta", 0.0), epsilon=0.2, loss_type=settings["loss_type"],
                    max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE)
    flat = {"lora_rank": 4, "lora_alpha": 8.0, "lora_targets": ",".join(TARGETS)} if lora else {}
    tc = TrainerConfig.of(dtype="fp32", max_grad_norm=0.0, lr=1e-3, grad_accum=2, **flat)
    out: dict[str, Any] = {"advantages": advantages}
    with StreamingTrainer.from_pretrained(policy or folder, tc) as trainer:
        leaves = _set_adapters(trainer, reference["initial"]) if lora else {}
        ref = None
        if loss.beta and lora:  # the base, the adapters off
            ref = token_logps(trainer, ids, labels, TEMPERATURE, reference=True)
        elif loss.beta:  # the checkpoint frozen in its own store, as `streamer train` keeps it
            with frozen_reference(folder, tc) as frozen:
                ref = token_logps(frozen, ids, labels, TEMPERATURE, reference=True)
        old = token_logps(trainer, ids, labels, TEMPERATURE) if settings.get("num_iterations", 1) > 1 else None
        if lora:
            step = trainer.adapters.step

            def recorded(lr: float, clip_coef: float) -> None:
                out["grads"] = {name: t.grad.detach().clone() for name, t in leaves.items()}
                step(lr, clip_coef)
            trainer.adapters.step = recorded
            out["loss"] = grpo_step(trainer, loss, ids, labels, advantages, old, ref)
        else:
            with _unit_gradients() as flat:
                out["loss"] = grpo_step(trainer, loss, ids, labels, advantages, old, ref)
            out["grads"] = hf_state_dict([trainer.layouts[u] for u in trainer.units], flat.__getitem__)
        out["grad_norm"] = trainer.grad_norm
    return out


@contextlib.contextmanager
def _unit_gradients() -> Iterator[dict[str, torch.Tensor]]:
    """Each unit's flat fp32 gradient of the step, summed over its micro-batches as the host store folds them."""
    from streamer.store.host import HostStore
    flat: dict[str, torch.Tensor] = {}
    original = HostStore.accumulate_grad

    def recorded(self: Any, unit: str, grads: Any, first: bool, *args: Any, **kwargs: Any) -> Any:
        this = torch.cat([g.detach().float().flatten().cpu() for g in grads])
        flat[unit] = this if first else flat[unit] + this
        return original(self, unit, grads, first, *args, **kwargs)
    with unittest.mock.patch.object(HostStore, "accumulate_grad", recorded):
        yield flat


CASES = [{"loss_type": "grpo"}, {"loss_type": "dr_grpo"}, {"loss_type": "dapo"}, {"loss_type": "bnpo"},
         {"loss_type": "grpo", "beta": 0.1}, {"loss_type": "dr_grpo", "beta": 0.1},
         {"loss_type": "dapo", "beta": 0.1, "num_iterations": 2},
         {"loss_type": "bnpo", "beta": 0.04, "scale_rewards": "batch"}]


def _assert_within_trls_noise(llama_folder: Path, settings: dict[str, Any], lora: bool,
                              policy: Path | None = None) -> None:
    """TRL in float32 and in float64, then ours from the same rows: the advantages equal TRL's, and the loss and
    every gradient (each relative to its largest entry) are within twice TRL's own fp32-vs-float64 difference, the
    largest over the parameters (a loss's noise at least one fp32 rounding of it). With beta, the policy is away
    from the reference (TRL's logged KL is not 0)."""
    fp32 = _trl(llama_folder, torch.float32, settings, lora=lora, policy=policy)
    fp64 = _trl(llama_folder, torch.float64, settings, lora=lora, policy=policy)
    assert fp32["rollouts"][0] == fp64["rollouts"][0]
    if settings.get("beta"):
        assert fp64["kl"] > 1e-3
    ours = _ours(llama_folder, fp32, settings, lora=lora, policy=policy)
    assert torch.allclose(ours["advantages"], fp32["advantages"].float(), atol=1e-6)
    loss_noise = max(abs(fp32["loss"] - fp64["loss"]), torch.finfo(torch.float32).eps * abs(fp64["loss"]))
    assert abs(ours["loss"] - fp64["loss"]) <= 2 * loss_noise

    def relative(grads: dict[str, torch.Tensor], name: str) -> float:
        exact = fp64["grads"][name]
        return ((grads[name].double() - exact).abs().max() / exact.abs().max()).item()
    noise = max(relative(fp32["grads"], name) for name in fp64["grads"])
    if lora:
        ours_grads = {k.replace(".weight", ".default.weight"): g for k, g in ours["grads"].items()}
        assert ours_grads.keys() == fp64["grads"].keys()
    else:
        ours_grads = ours["grads"]
        assert fp64["grads"].keys() <= ours_grads.keys()  # (a tied parameter under both its names)
    for name in fp64["grads"]:
        assert relative(ours_grads, name) <= 2 * noise, name


@pytest.mark.parametrize("settings", CASES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_a_lora_grpo_step_is_trls(llama_folder: Path, settings: dict[str, Any]) -> None:
    """LoRA (the reference is the base with the adapters off): measured TRL's noise 0.92e-6 to 1.28e-6 of a
    gradient's largest entry by case, ours 1.18e-6 to 1.56e-6: at most 1.46 times TRL's."""
    _assert_within_trls_noise(llama_folder, settings, lora=True)


@pytest.mark.parametrize("settings", CASES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_a_full_grpo_step_is_trls(llama_folder: Path, tuned_folder: Path, settings: dict[str, Any]) -> None:
    """Full fine-tuning of a policy away from its reference: with beta the reference is the checkpoint frozen in
    its own store (`frozen_reference`, as `streamer train` keeps it), TRL's the checkpoint loaded again. Every
    parameter's gradient, as the host store folds the micro-batches': measured TRL's noise 1.14e-6 to 1.53e-6 of
    a gradient's largest entry by case, ours 1.40e-6 to 2.10e-6, at most 1.55 times TRL's (TRL's KL 0.30)."""
    _assert_within_trls_noise(llama_folder, settings, lora=False, policy=tuned_folder)


def test_rewards_are_weighted_and_a_failing_function_is_one_line(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Reward functions by `module:function` with TRL's signature (dataset columns as keyword lists), summed with
    reward_weights (None: unscorable, left out); one that raises, returns the wrong count or cannot be found is
    refused in one line naming it."""
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n"
        "def target(prompts, completions, answer, **kw):\n"
        "    return [None if a is None else float(c == a) for c, a in zip(completions, answer)]\n"
        "def broken(prompts, completions, **kw):\n    raise KeyError('answer')\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = Rewards(["my_rewards:length", "my_rewards:target"], weights=[0.5, 2.0])
    total, each = rewards.score(["p"] * 3, ["ab", "abc", ""], {"answer": ["ab", "x", None]})
    assert total.tolist() == [0.5 * 2 + 2.0, 0.5 * 3, 0.0]
    assert each[2, 1].isnan()
    with pytest.raises(RewardError, match=r"^reward function my_rewards:broken raised KeyError: 'answer'$"):
        Rewards(["my_rewards:broken"]).score(["p"], ["c"])
    with pytest.raises(RewardError, match=r"^reward function my_rewards:short returned 1 rewards for 2 completions"):
        Rewards(["my_rewards:short"]).score(["p"] * 2, ["a", "b"])
    with pytest.raises(ConfigError, match="reward function my_rewards:nothing: my_rewards has no function nothing"):
        Rewards(["my_rewards:nothing"])
    with pytest.raises(ConfigError, match="2 reward_weights for 1 reward functions"):
        Rewards(["my_rewards:length"], weights=[1.0, 2.0])


def test_group_advantages_are_trls() -> None:
    """Rewards normalized within each group (or the batch), as TRL: a NaN reward is left out and gets 0."""
    from trl.trainer.utils import nanstd
    rewards = torch.tensor([1.0, 2.0, 4.0, float("nan"), 0.5, 0.5, 3.0, 1.0])
    grouped = rewards.view(-1, 4)
    expected = (rewards - grouped.nanmean(1).repeat_interleave(4)) / (nanstd(grouped, dim=1).repeat_interleave(4)
                                                                      + 1e-4)
    assert torch.allclose(group_advantages(rewards, 4, "group"), expected.nan_to_num(0.0))
    batch = (rewards - grouped.nanmean(1).repeat_interleave(4)) / (nanstd(rewards) + 1e-4)
    assert torch.allclose(group_advantages(rewards, 4, "batch"), batch.nan_to_num(0.0))
    assert torch.allclose(group_advantages(rewards, 4, "none"),
                          (rewards - grouped.nanmean(1).repeat_interleave(4)).nan_to_num(0.0))


def test_the_documented_toy_task_learns() -> None:
    """docs/CLI.md's "GRPO from Python" command, as a user types it: the mean reward rises from about 0.29 over
    the first 5 steps to about 0.53 over the last 5 (measured 0.286 and 0.532), at least by 0.1."""
    import re
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    assert "python examples/grpo_toy.py --steps 15" in (root / "docs" / "CLI.md").read_text()
    out = subprocess.run([sys.executable, "examples/grpo_toy.py", "--steps", "15"], cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    first, last = map(float, re.search(r"first 5 steps ([\d.]+), last 5 steps ([\d.]+)", out.stdout).groups())
    assert abs(first - 0.29) < 0.1 and abs(last - 0.53) < 0.15
    assert last > first + 0.1


def test_bad_grpo_settings_are_one_line() -> None:
    from streamer.grpo import GRPOSettings, train_grpo
    from streamer.io.tokenizer import train_bpe
    from streamer.runtime.distributed import DataParallel
    with pytest.raises(ConfigError, match="num_generations must be >= 2"):
        GRPOSettings(num_generations=1)
    with pytest.raises(ConfigError, match="temperature must be > 0"):
        GRPOSettings(temperature=0.0)
    with pytest.raises(ConfigError, match="loss_type must be one of grpo, dr_grpo, dapo, bnpo"):
        GRPOSettings(loss_type="cispo")
    with pytest.raises(ConfigError, match="scale_rewards must be one of group, batch, none"):
        GRPOSettings(scale_rewards="batchwise")
    cfg = dataclasses.replace(FAMILIES["llama"].example(), vocab_size=300, max_position_embeddings=64)
    with StreamingTrainer(cfg, TrainerConfig.of(dtype="fp32", grad_accum=2)) as trainer:
        ids, labels = completion_rows([[5, 6]] * 4, [[7, 8, 0]] * 4, 0)
        with pytest.raises(StreamerError, match=r"step takes one objective per micro-batch of this process \(2, "):
            trainer.step(ids, labels, objectives=[])
        with pytest.raises(StreamerError, match="GRPO needs one advantage per row \\(4\\); got \\(3,\\)"):
            grpo_step(trainer, GRPOLoss(), ids, labels, torch.zeros(3))
        with pytest.raises(ConfigError, match="beta > 0 needs the reference model: with LoRA the base with the "):
            train_grpo(trainer, train_bpe(["some text"], 300), [{"prompt": "Hi"}], Rewards([length_reward]),
                       GRPOSettings(beta=0.1), 1)
        # As a process of 3 under torchrun: a step's 2 x 8 completions do not split over them.
        trainer.data_parallel = DataParallel(0, 3)
        with pytest.raises(ConfigError, match="^a step's 16 completions do not split over 3 processes x grad_accum 2"):
            train_grpo(trainer, train_bpe(["some text"], 300), [{"prompt": "Hi"}], Rewards([length_reward]),
                       GRPOSettings(), 1)
        trainer.data_parallel = None


def test_rollouts_are_seeded_and_end_at_end_of_text() -> None:
    """A prompt's completions are sampled by the runtime's generation: the same seed gives the same completions,
    another seed others; each stops after its first end-of-text (kept, as TRL's) or at max_completion_length."""
    from streamer.generate import Sampling
    from streamer.grpo import rollout
    cfg = dataclasses.replace(FAMILIES["llama"].example(), vocab_size=32, max_position_embeddings=64)
    sampling = Sampling(max_new_tokens=12, temperature=1.0, seed=3)
    with StreamingTrainer(cfg, TrainerConfig.of(dtype="fp32")) as trainer:
        first = rollout(trainer, [5, 6, 7], 6, sampling, stop_id=0)
        assert rollout(trainer, [5, 6, 7], 6, sampling, stop_id=0) == first
        assert rollout(trainer, [5, 6, 7], 6, dataclasses.replace(sampling, seed=4), stop_id=0) != first
    assert len(first) == 6
    for completion in first:
        assert 1 <= len(completion) <= 12
        assert 0 not in completion[:-1] and (completion[-1] == 0 or len(completion) == 12)
    assert any(c[-1] == 0 for c in first)  # a vocabulary of 32 ends some of them within 12 tokens


CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say a word:"}],
         [{"role": "user", "content": "Name a color:"}]]


def test_conversational_prompts_are_tokenized_and_scored_as_trls(llama_folder: Path) -> None:
    """A prompt that is a conversation is rendered by the chat template with the assistant's header and tokenized
    as TRL's GRPOTrainer tokenizes it (transformers' apply_chat_template(add_generation_prompt=True), the text of
    TRL's maybe_apply_chat_template); the reward functions get the prompts, the completions (the assistant's
    message) and the columns as TRL's GRPOTrainer gives them the same completions (fed to it through its
    rollout_func)."""
    import json

    import transformers
    from streamer.grpo import GRPOLoop, GRPOSettings
    from streamer.io.tokenizer import load_tokenizer

    seen: dict[str, list[str]] = {}

    def recorder(who: str) -> Any:
        def reward(prompts: list[Any], completions: list[Any], answer: list[str], **kw: Any) -> list[float]:
            seen[who] = sorted(json.dumps([p, c, a]) for p, c, a in zip(prompts, completions, answer, strict=True))
            return [float(len(c[0]["content"])) for c in completions]
        return reward
    data = [{"prompt": chat, "answer": answer} for chat, answer in zip(CHATS, ("a", "red"), strict=True)]
    settings = GRPOSettings(num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION, prompts_per_step=2)
    with StreamingTrainer.from_pretrained(llama_folder, TrainerConfig.of(dtype="fp32")) as trainer:
        loop = GRPOLoop(trainer, load_tokenizer(llama_folder), data, Rewards([recorder("ours")]), settings)
        loop.step()
    rollout = loop.pending
    assert rollout is not None
    hf = transformers.AutoTokenizer.from_pretrained(llama_folder)
    hf.pad_token = hf.eos_token
    for chat, ids in zip(CHATS, rollout.prompt_ids[::GENERATIONS], strict=True):
        assert ids == hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
        text = trl.data_utils.maybe_apply_chat_template({"prompt": chat}, hf)["prompt"]
        assert ids == hf(text, add_special_tokens=False)["input_ids"]

    def fed(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        rows = [CHATS.index(p) * GENERATIONS + prompts[:i].count(p) % GENERATIONS for i, p in enumerate(prompts)]
        return {"prompt_ids": [rollout.prompt_ids[r] for r in rows],
                "completion_ids": [rollout.completion_ids[r] for r in rows], "logprobs": None}
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_folder, dtype=torch.float32)
    args = trl.GRPOConfig(output_dir=str(llama_folder.parent / "trl-chat"), report_to="none", use_cpu=True,
                          save_strategy="no", per_device_train_batch_size=len(CHATS) * GENERATIONS,
                          num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION, max_steps=1,
                          bf16=False, fp16=False)
    trl.GRPOTrainer(model=model, reward_funcs=recorder("trl"), args=args, processing_class=hf,
                    train_dataset=datasets.Dataset.from_list(data), rollout_func=fed).train()
    assert seen["ours"] == seen["trl"]
    rows = [json.loads(row) for row in seen["ours"]]
    assert all(p in CHATS and [m.keys() for m in c] == [{"role", "content"}] and c[0]["role"] == "assistant"
               for p, c, _ in rows)
