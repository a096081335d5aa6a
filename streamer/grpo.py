"""GRPO on the streamed step, through the Python API: rows of a prompt and a completion, the log-probabilities of
the policy that sampled them and of the reference, and one step whose loss is layers/grpo.py's `GRPOObjective`
(TRL's GRPOTrainer's, given the same prompts, completions and rewards).

Rollouts are the runtime's own generation (`streamer.generate`: the units streamed, the KV cache on the device):
`rollout` samples a prompt's completions. `train_grpo` is the loop: generate, score (`streamer.rewards`), the
advantages, then the steps, logging each step's rewards, advantages and completions.

Under torchrun (data parallel) each process samples and scores its share of a step's rows, as TRL's processes do;
the rewards are gathered, so each group's advantages are computed over the whole group, and every process holds the
step's rows, of which `StreamingTrainer.step` takes its share."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from layers import IGNORE_INDEX
from memory_model.objective import ObjectiveConfig
from memory_model.rollout import resident_decode
from layers.grpo import GRPOLoss, GRPOObjective, TokenLogProbs, group_advantages
from memory_model.schedule import step_events
from streamer.errors import ConfigError, StreamerError
from streamer.generate import Sampling, generate
from streamer.io.data import chat_prompt
from streamer.rewards import Rewards
from streamer.runtime.step import MicroBatch, StepContext
from streamer.config import TrainerConfig
from streamer.trainer import StreamingTrainer

if TYPE_CHECKING:
    from streamer.io.tokenizer import Tokenizer
    from streamer.runtime.distributed import DataParallel

Prompt = str | Sequence[Mapping[str, str]]  # a text, or a conversation: {"role", "content"} messages


def prompt_tokens(tokenizer: Tokenizer, prompt: Prompt, where: str = "the prompt") -> list[int]:
    """A GRPO prompt's ids as TRL's GRPOTrainer tokenizes it: a text with the tokens the tokenizer adds before one
    (BOS); a conversation rendered by the chat template with the assistant's header after it and tokenized as it is
    (apply_chat_template(add_generation_prompt=True, tokenize=True)). An empty prompt is end-of-text alone.
    `where`: the record, named by a malformed message's error."""
    if isinstance(prompt, str):
        ids = tokenizer.prompt_ids(prompt)
    else:
        ids = tokenizer.encode(chat_prompt([dict(m) for m in prompt], tokenizer, where))
    return ids or [tokenizer.eos_id]


def reward_completion(prompt: Prompt, text: str) -> str | list[dict[str, str]]:
    """A completion as TRL gives it to the reward functions: its text, or for a conversation's prompt the
    assistant's message."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


def completion_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                    pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), (rows, T): each prompt followed by its completion, padded on the right with `pad_id`;
    labels -100 but on the completion. T is the longest row."""
    if len(prompts) != len(completions):
        raise StreamerError(f"{len(prompts)} prompts but {len(completions)} completions; give one prompt per row")
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), length), IGNORE_INDEX, dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        row = torch.tensor([*prompt, *completion], dtype=torch.long)
        ids[i, :len(row)] = row
        labels[i, len(prompt):len(row)] = row[len(prompt):]
    return ids, labels


def token_logps(trainer: StreamingTrainer, input_ids: torch.Tensor, labels: torch.Tensor,
                temperature: float = 1.0, reference: bool = False) -> torch.Tensor:
    """(rows, T) fp32 on the host: each position's log-probability of its (shifted) label, 0 where it is -100, by
    forward passes only, one micro-batch's rows at a time. `reference`: the reference model's (with LoRA the base
    with the adapters off; else the weights as they are now); else the policy's as it is now (GRPO's old policy).
    Under data parallel each process computes its share of the rows and every process gets all of them."""
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise StreamerError(f"input_ids and labels must be (batch, seq) alike; got {tuple(input_ids.shape)} and "
                            f"{tuple(labels.shape)}")
    parallel = trainer.data_parallel
    if parallel is not None:
        input_ids, labels = parallel.shard(input_ids), parallel.shard(labels)
    device = trainer.executor.device
    micro = max(1, input_ids.shape[0] // trainer.tc.step.grad_accum)
    out = []
    for ids, lab in zip(input_ids.split(micro), labels.split(micro), strict=True):
        objective = TokenLogProbs(temperature)
        ctx = StepContext([MicroBatch(ids.to(device), lab.to(device), objective=objective)], trainer.step_count,
                          0.0, adapters_off=reference and trainer.adapters is not None)
        with torch.no_grad():
            trainer.executor.run(step_events(trainer.step_spec(1, backward=False)), ctx)
        trainer.executor.clear_graphs()
        assert objective.tokens is not None
        out.append(objective.tokens.float().cpu())
    local = torch.cat(out)
    return local if parallel is None else torch.cat(parallel.gather(local))


def grpo_objectives(loss: GRPOLoss, labels: torch.Tensor, advantages: torch.Tensor, micro_batches: int,
                    old: torch.Tensor | None = None, reference: torch.Tensor | None = None,
                    parallel: DataParallel | None = None) -> list[GRPOObjective]:
    """Each micro-batch's GRPO objective, the rows split in `micro_batches` parts in order (as `step` splits them).
    Under data parallel (`parallel`) the arguments are the whole step's and the objectives this process's: its
    share of the rows, split in `micro_batches`; the rows and tokens the losses divide by are the step's over the
    processes, whose gradients the all-reduce averages (TRL's dapo normalizer, num_items_in_batch / processes)."""
    rows = labels.shape[0]
    if advantages.shape != (rows,):
        raise StreamerError(f"GRPO needs one advantage per row ({rows}); got {tuple(advantages.shape)}")
    for name, t in (("old", old), ("reference", reference)):
        if t is not None and t.shape != labels.shape:
            raise StreamerError(f"the {name} log-probabilities must be (rows, T) as the labels "
                                f"{tuple(labels.shape)}; got {tuple(t.shape)}")
    if loss.beta and reference is None:
        raise StreamerError("beta > 0 needs the reference's log-probabilities (token_logps(..., reference=True))")
    processes = 1 if parallel is None else parallel.world
    if rows % (micro_batches * processes):
        raise StreamerError(f"{rows} rows do not split into grad_accum={micro_batches} micro-batches on each of "
                            f"{processes} process(es)")
    tokens = float((labels[:, 1:] != IGNORE_INDEX).sum())

    def mine(t: torch.Tensor) -> list[torch.Tensor]:
        return list((t if parallel is None else parallel.shard(t)).chunk(micro_batches))

    def parts(t: torch.Tensor | None) -> list[torch.Tensor | None]:
        return [None] * micro_batches if t is None else [*mine(t)]
    return [GRPOObjective(loss, a, o, r, rows / processes, tokens / processes, micro_batches)
            for a, o, r in zip(mine(advantages), parts(old), parts(reference), strict=True)]


def grpo_step(trainer: StreamingTrainer, loss: GRPOLoss, input_ids: torch.Tensor, labels: torch.Tensor,
              advantages: torch.Tensor, old: torch.Tensor | None = None,
              reference: torch.Tensor | None = None) -> float:
    """One optimizer step of GRPO's loss over the rows (`completion_rows`); returns the loss (TRL's). Under data
    parallel every process passes the whole step's rows and takes its share."""
    objectives = grpo_objectives(loss, labels, advantages, trainer.tc.step.grad_accum, old, reference,
                                 trainer.data_parallel)
    return trainer.step(input_ids, labels, objectives=objectives)


@dataclass(frozen=True)
class GRPOSettings:
    """GRPO's settings by TRL's GRPOConfig names; `prompts_per_step`: the prompts of a step, each with
    `num_generations` completions (TRL's per-device batch is their product); `seed`: the sampling's."""

    num_generations: int = 8
    max_completion_length: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    num_iterations: int = 1
    prompts_per_step: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ConfigError(f"num_generations must be >= 2 (a group's rewards are compared), got "
                              f"{self.num_generations}")
        if not self.temperature > 0:
            raise ConfigError(f"GRPO samples: temperature must be > 0, got {self.temperature}")
        if self.num_iterations < 1 or self.prompts_per_step < 1:
            raise ConfigError(f"num_iterations and prompts_per_step must be >= 1, got {self.num_iterations} and "
                              f"{self.prompts_per_step}")
        try:
            self.loss()
            group_advantages(torch.zeros(self.num_generations), self.num_generations, self.scale_rewards)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @classmethod
    def of(cls, objective: ObjectiveConfig, batch: int, seed: int) -> GRPOSettings:
        """`streamer train --method grpo`'s: --batch completions a step, --seed's sampling."""
        if batch % objective.num_generations:
            raise ConfigError(f"--batch {batch} completions do not split into groups of --num-generations "
                              f"{objective.num_generations}; use a multiple of it")
        return cls(num_generations=objective.num_generations, max_completion_length=objective.max_completion_length,
                   temperature=objective.temperature, top_p=objective.top_p, beta=objective.beta,
                   epsilon=objective.epsilon, loss_type=objective.loss_type, num_iterations=objective.num_iterations,
                   prompts_per_step=batch // objective.num_generations, seed=seed)

    def loss(self) -> GRPOLoss:
        return GRPOLoss(beta=self.beta, epsilon=self.epsilon, epsilon_high=self.epsilon_high,
                        loss_type=self.loss_type, max_completion_length=self.max_completion_length,
                        temperature=self.temperature)

    def sampling(self, seed: int) -> Sampling:
        return Sampling(max_new_tokens=self.max_completion_length, temperature=self.temperature, top_k=self.top_k,
                        top_p=self.top_p, seed=seed)


def rollout(trainer: StreamingTrainer, prompt_ids: Sequence[int], num_generations: int, sampling: Sampling,
            stop_id: int | None) -> list[list[int]]:
    """`num_generations` completions of one prompt, sampled together (one batch, the KV cache on the device); each
    ends at its first `stop_id`, kept (as TRL's completions keep end-of-text), or at max_new_tokens. The units stay
    on the device from the prefill on where the planner finds they fit the budget beside the cache
    (`resident_decode`); else each pass streams them."""
    positions = len(prompt_ids) + sampling.max_new_tokens
    generation = trainer.tc.replace(grad_accum=1).plan_config(num_generations, positions)  # one pass, its rows whole
    resident = resident_decode(trainer.cfg, generation, num_generations, len(prompt_ids), positions,
                               trainer.ledger.capacity)
    out = generate(trainer, torch.tensor([list(prompt_ids)] * num_generations), sampling, stop_id=stop_id,
                   resident=resident)
    completions = []
    for row in out[:, len(prompt_ids):].tolist():
        completions.append(row[:row.index(stop_id) + 1] if stop_id in row else row)
    return completions


@dataclass
class Rollout:
    """One batch of completions and what the `num_iterations` steps on it read. `index`: the rollout's number
    (0-based), which picks its prompts and seeds; per row (each prompt's group consecutive): its prompt's record
    number, its prompt and completion ids, the completion's text, its summed reward (None: unscorable) and each
    function's; the advantages, and the old policy's and reference's log-probabilities where they are read. Every
    row of the step, in every process."""

    index: int
    records: list[int]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    rewards: list[float | None]
    per_function: list[list[float | None]]
    advantages: torch.Tensor
    old: torch.Tensor | None = None
    reference: torch.Tensor | None = None

    def state(self) -> dict[str, Any]:
        """As JSON values, committed with a step that leaves iterations of it to do: a resumed run steps on the
        same rows. fp32 values are exact as JSON numbers."""
        def rows(t: torch.Tensor | None) -> list[list[float]] | None:
            return None if t is None else t.tolist()
        return {"index": self.index, "records": self.records, "prompt_ids": self.prompt_ids,
                "completion_ids": self.completion_ids, "texts": self.texts, "rewards": self.rewards,
                "per_function": self.per_function, "advantages": self.advantages.tolist(), "old": rows(self.old),
                "reference": rows(self.reference)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Rollout:
        def rows(values: list[list[float]] | None) -> torch.Tensor | None:
            return None if values is None else torch.tensor(values, dtype=torch.float32)
        advantages = torch.tensor(state["advantages"], dtype=torch.float32)
        return cls(state["index"], state["records"], state["prompt_ids"], state["completion_ids"], state["texts"],
                   state["rewards"], state["per_function"], advantages, rows(state["old"]), rows(state["reference"]))


def frozen_reference(hf_dir: str | Path, tc: TrainerConfig, store_dir: str | Path | None = None) -> StreamingTrainer:
    """Full fine-tuning's reference for beta > 0: the checkpoint's initial weights as a frozen base (a LoRA
    trainer's store holds its compute weights alone, 2 bytes a parameter in bf16), read with the adapters off
    (`token_logps(..., reference=True)`). `tc`: the policy's settings; its LoRA settings are replaced."""
    return StreamingTrainer.from_pretrained(hf_dir, tc.replace(lora_rank=1, lora_alpha=1.0, lora_dropout=0.0),
                                            store_dir)


class GRPOLoop:
    """GRPO's steps on `dataset` (records, each a "prompt" and any other columns, which the reward functions get as
    keyword lists). Rollout k takes the records from k x prompts_per_step on (in order, cycling), samples
    `num_generations` completions of each (seeded by the run's seed, k and the record's place: resumable), scores
    them and steps `num_iterations` times on them. A rollout with steps left is in `trainer.extra_state`, so a
    trainer opened from its store at any committed step continues as an uninterrupted run would. `reference`: the
    frozen model of full fine-tuning with beta > 0 (`frozen_reference`); with LoRA the base with the adapters off."""

    def __init__(self, trainer: StreamingTrainer, tokenizer: Tokenizer, dataset: Sequence[Mapping[str, Any]],
                 rewards: Rewards, settings: GRPOSettings, reference: StreamingTrainer | None = None) -> None:
        if not dataset or any("prompt" not in record for record in dataset):
            raise StreamerError("every GRPO record needs a 'prompt' field")
        if settings.beta and trainer.adapters is None and reference is None:
            raise ConfigError("beta > 0 needs the reference model: with LoRA the base with the adapters off; with full "
                              "fine-tuning pass reference=frozen_reference(...) (the initial weights)")
        parallel, rows = trainer.data_parallel, settings.prompts_per_step * settings.num_generations
        if parallel is not None and rows % (parallel.world * trainer.tc.step.grad_accum):
            raise ConfigError(f"a step's {rows} completions do not split over {parallel.world} processes x "
                              f"grad_accum {trainer.tc.step.grad_accum}; use a multiple of "
                              f"{parallel.world * trainer.tc.step.grad_accum}")
        self.trainer, self.tokenizer, self.dataset, self.reference = trainer, tokenizer, dataset, reference
        self.rewards, self.settings, self.loss = rewards, settings, settings.loss()
        saved = trainer.extra_state.get("rollout")
        self.pending = None if saved is None else Rollout.from_state(saved)
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None  # the last step's (input_ids, labels)

    def rollout(self, index: int) -> Rollout:
        """Rollout `index`: its prompts' completions sampled by the runtime's generation, scored, their advantages,
        and the log-probabilities its steps read, from the policy as it is now."""
        settings, tokenizer, group = self.settings, self.tokenizer, self.settings.num_generations
        first = index * settings.prompts_per_step
        numbers = [(first + j) % len(self.dataset) for j in range(settings.prompts_per_step)]
        records = [self.dataset[n] for n in numbers]
        prompts = [prompt_tokens(tokenizer, row["prompt"], f"GRPO record {n + 1}")
                   for n, row in zip(numbers, records, strict=True)]
        # This process's rows [lo, hi) of the step's (all of them in one process). A prompt whose group it shares
        # with another process is sampled whole by each (its seed: the same completions) and each keeps its rows.
        parallel, rows = self.trainer.data_parallel, len(records) * group
        share = rows if parallel is None else rows // parallel.world
        lo = 0 if parallel is None else share * parallel.rank
        hi = lo + share
        completion_ids: list[list[int]] = []
        for j in range(lo // group, (hi - 1) // group + 1):
            seed = settings.seed * 1_000_003 + first + j  # a rollout of its own per prompt and rollout: resumable
            group_ids = rollout(self.trainer, prompts[j], group, settings.sampling(seed), tokenizer.eos_id)
            completion_ids += group_ids[max(lo - j * group, 0):hi - j * group]
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completion_ids]  # TRL's batch_decode
        mine = [records[r // group] for r in range(lo, hi)]
        columns = {key: [row[key] for row in mine] for key in records[0] if key != "prompt"}
        total, per_function = self.rewards.score(
            [row["prompt"] for row in mine],
            [reward_completion(row["prompt"], text) for row, text in zip(mine, texts, strict=True)], columns)
        if parallel is not None:  # every process's rows, in order: a group's advantages read its whole group (TRL)
            gathered = parallel.gather((completion_ids, texts, total, per_function))
            completion_ids = [c for part in gathered for c in part[0]]
            texts = [t for part in gathered for t in part[1]]
            total, per_function = torch.cat([p[2] for p in gathered]), torch.cat([p[3] for p in gathered])
        advantages = group_advantages(total, group, settings.scale_rewards)
        prompt_ids = [prompt for prompt in prompts for _ in range(group)]
        ids, labels = completion_rows(prompt_ids, completion_ids, tokenizer.eos_id)
        loss = self.loss
        old = token_logps(self.trainer, ids, labels, loss.temperature) if settings.num_iterations > 1 else None
        reference = None if not loss.beta else \
            token_logps(self.reference or self.trainer, ids, labels, loss.temperature, reference=True)
        return Rollout(index, [n for n in numbers for _ in range(group)], prompt_ids, completion_ids, texts,
                       _floats(total), [_floats(row) for row in per_function], advantages, old, reference)

    def step(self) -> dict[str, Any]:
        """One optimizer step (a rollout first where the last one's iterations are done): its record, as TRL logs
        it (loss, reward, reward_std, each function's mean reward, the completions' mean length), with the
        advantages and the completions. The trainer's step_count tells whether it was committed (--nonfinite
        skip)."""
        trainer, settings = self.trainer, self.settings
        index, iteration = divmod(trainer.step_count, settings.num_iterations)
        if self.pending is None or self.pending.index != index:
            self.pending = self.rollout(index)
        rollout = self.pending
        extra = {k: v for k, v in trainer.extra_state.items() if k != "rollout"}
        if iteration + 1 < settings.num_iterations:  # the next step reads it again
            extra["rollout"] = rollout.state()
        trainer.extra_state = extra
        ids, labels = completion_rows(rollout.prompt_ids, rollout.completion_ids, self.tokenizer.eos_id)
        loss = grpo_step(trainer, self.loss, ids, labels, rollout.advantages, rollout.old, rollout.reference)
        total = torch.tensor([math.nan if r is None else r for r in rollout.rewards])
        each = torch.tensor([[math.nan if r is None else r for r in row] for row in rollout.per_function])
        self.rows = ids, labels
        return {"step": trainer.step_count, "loss": loss, "reward": _nanmean(total),
                "reward_std": _nanmean(total.view(-1, settings.num_generations).std(dim=1)),
                **{f"rewards/{name}": _nanmean(each[:, i]) for i, name in enumerate(self.rewards.names())},
                "completion_length": sum(map(len, rollout.completion_ids)) / len(rollout.completion_ids),
                "rewards": rollout.rewards, "advantages": rollout.advantages.tolist(), "completions": rollout.texts}

    def sample(self) -> dict[str, Any]:
        """The last rollout's first prompt and its completions, with their rewards and advantages."""
        assert self.pending is not None
        rollout, group = self.pending, self.settings.num_generations
        return {"prompt": self.dataset[rollout.records[0]]["prompt"], "completions": rollout.texts[:group],
                "rewards": rollout.rewards[:group], "advantages": rollout.advantages[:group].tolist()}


def train_grpo(trainer: StreamingTrainer, tokenizer: Tokenizer, dataset: Sequence[Mapping[str, Any]],
               rewards: Rewards, settings: GRPOSettings, steps: int,
               log: Callable[[dict[str, Any]], None] | None = None,
               reference: StreamingTrainer | None = None) -> list[dict[str, Any]]:
    """`steps` GRPO steps of `GRPOLoop`. Returns (and gives `log`) each step's record."""
    loop = GRPOLoop(trainer, tokenizer, dataset, rewards, settings, reference)
    history = []
    for _ in range(steps):
        record = loop.step()
        history.append(record)
        if log is not None:
            log(record)
    return history


def _floats(t: torch.Tensor) -> list[float | None]:
    """Rewards as JSON values: NaN (unscorable) as None."""
    return [None if math.isnan(v) else v for v in t.tolist()]


def _plain(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _nanmean(t: torch.Tensor) -> float | None:
    """The mean of the scored values (None where none was scored)."""
    return _plain(float(t.nanmean()))
