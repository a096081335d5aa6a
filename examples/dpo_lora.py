"""DPO with LoRA on a streamed model, through the Python API: preference pairs -> TRL's rows -> streamed steps.

    python examples/dpo_lora.py [--steps 3] [--beta 0.1] [--loss-type sigmoid]

A small random Llama is made with transformers and saved beside a tokenizer trained offline. The pairs
(prompt, chosen, rejected) are tokenized as TRL's DPOTrainer tokenizes them. The reference is the base with the
adapters off: each step computes its log-probabilities in its own forward, each unit loaded once running for the
policy and, adapters off, for the reference. Each step prints TRL's metrics: the loss, rewards/accuracies and
rewards/margins.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import transformers

from layers import LlamaConfig
from streamer import StreamingTrainer, TrainerConfig
from streamer.io.preference import pair_rows, tokenize_pairs
from streamer.io.records import read_pairs
from streamer.io.tokenizer import train_bpe

SMALL = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)
PAIRS = [{"prompt": "Question: what is a list?", "chosen": " An ordered sequence.", "rejected": " A fish."},
         {"prompt": "Question: what does import do?", "chosen": " It loads a module.", "rejected": " Nothing."},
         {"prompt": "Say hello.", "chosen": " Hello there, friend.", "rejected": " No."},
         {"prompt": "Question: what is None?", "chosen": " The absence of a value.", "rejected": " A number."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--loss-type", default="sigmoid", choices=("sigmoid", "ipo", "hinge", "robust"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dpo-example-") as folder:
        train(Path(folder), args)


def train(folder: Path, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**SMALL.adapter().to_hf())).save_pretrained(
        folder / "hf")
    tokenizer = train_bpe([p["prompt"] + p["chosen"] + p["rejected"] for p in PAIRS] * 8, SMALL.vocab_size)
    data = folder / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(p) for p in PAIRS))

    ids, labels = pair_rows(tokenize_pairs(read_pairs(data), tokenizer, SMALL.max_position_embeddings),
                            tokenizer.eos_id, SMALL.max_position_embeddings)
    tc = TrainerConfig.of(method="dpo", beta=args.beta, loss_type=args.loss_type, lora_rank=8, lr=5e-3,
                          dtype="fp32", grad_accum=2)
    with StreamingTrainer.from_pretrained(folder / "hf", tc) as trainer:
        for step in range(1, args.steps + 1):
            loss = trainer.step(ids, labels)  # the reference, the base, computed in the step
            print(f"step {step}: loss {loss:.4f}, rewards/accuracies {trainer.metrics['rewards/accuracies']:.2f}, "
                  f"rewards/margins {trainer.metrics['rewards/margins']:.4f}")


if __name__ == "__main__":
    main()
