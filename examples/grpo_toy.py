"""GRPO on a streamed model, through the Python API: a toy task whose mean reward rises in a few dozen steps.

    python examples/grpo_toy.py --steps 15

A small random Llama and a tokenizer trained here. The reward is a format target: the share of a completion's
characters that are lowercase letters or spaces (`lowercase`, TRL's reward signature). Each step samples
`num_generations` completions of each of its prompts with the runtime's own generation (KV cache on the device),
scores them, normalizes the rewards within each prompt's group (the advantages) and takes one step of TRL's
GRPO loss. Each step prints its mean reward and a completion; the last line the mean reward of the first and last
five steps. The same task from the command line, on this model and these prompts (grpo_toy.json, grpo_toy.jsonl):
docs/CLI.md, "GRPO: prompts and reward functions".
"""
from __future__ import annotations

import argparse
from typing import Any

from layers import LlamaConfig
from streamer import StreamingTrainer, TrainerConfig
from streamer.grpo import GRPOSettings, train_grpo
from streamer.io.tokenizer import train_bpe
from streamer.rewards import Rewards

SMALL = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)
PROMPTS = [{"prompt": "Write a word:"}, {"prompt": "Say something:"}, {"prompt": "Name a thing:"},
           {"prompt": "Answer:"}]
TEXT = ("The quick brown fox jumps over the lazy dog. PACK MY BOX WITH 5 DOZEN LIQUOR JUGS! 0123456789 #$%&*+=?@ "
        "Sphinx of black quartz, judge my vow; (How) [vexingly] {quick} daft zebras jump - 42 / 7 = 6.")


def lowercase(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """The share of each completion's characters that are lowercase letters or spaces (0 for an empty one)."""
    return [sum(c.islower() or c == " " for c in text) / len(text) if text else 0.0 for text in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    history = train(args.steps, args.num_generations, args.max_completion_length, args.lr)
    window = max(1, min(5, len(history) // 2))
    first = sum(h["reward"] for h in history[:window]) / window
    last = sum(h["reward"] for h in history[-window:]) / window
    print(f"mean reward: first {window} steps {first:.3f}, last {window} steps {last:.3f}")


def train(steps: int, num_generations: int = 8, max_completion_length: int = 6,
          lr: float = 1e-2) -> list[dict[str, Any]]:
    """The toy run: each step's record (mean reward, loss, advantages, completions)."""
    tokenizer = train_bpe([TEXT] * 4 + [p["prompt"] for p in PROMPTS], SMALL.vocab_size)
    settings = GRPOSettings(num_generations=num_generations, max_completion_length=max_completion_length,
                            temperature=1.0, loss_type="dapo", prompts_per_step=2, seed=0)
    tc = TrainerConfig.of(dtype="fp32", lr=lr, seed=0, max_grad_norm=1.0)

    def log(record: dict[str, Any]) -> None:
        print(f"step {record['step']}: reward {record['reward']:.3f}, loss {record['loss']:.4f}, "
              f"completion {record['completions'][0]!r}")

    with StreamingTrainer(SMALL, tc) as trainer:
        return train_grpo(trainer, tokenizer, PROMPTS, Rewards([lowercase]), settings, steps, log)


if __name__ == "__main__":
    main()
