"""Fine-tune with a completion-only loss: the model learns to write the summary, never the text it summarises.

    python examples/finetune_summarization.py [--steps 150] [--out runs/summarization]

Makes a small prompt/completion JSONL (reports of who bought what where, and their one-line summaries),
trains a small GPT-J from scratch with streamed layers under a device budget, prints the held-out loss as
it falls, and generates a summary for a report the model has not seen. The same data from the shell (with the
demo's model and budget; the loss covers the completions there too):

    streamer train --data runs/summarization/reports.jsonl --steps 150 --seq 64 --batch 16 --eval-fraction 0.1

Everything runs offline in about a minute on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from layers import GPTJConfig
from streamer import DeviceConfig, LRSchedule, OptimizerConfig, Placement, StepConfig, StreamingTrainer, TrainerConfig
from streamer.io.data import BatchStream, load_dataset
from streamer.generate import Sampling, complete
from streamer.io.tokenizer import train_bpe

NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jun"]
ITEMS = ["apples", "bicycles", "candles", "drums", "easels", "flutes", "guitars", "hammers", "inks", "jackets"]
CITIES = ["Paris", "Lagos", "Kyoto", "Lima", "Oslo", "Quito", "Rome", "Seoul", "Tunis", "Vienna"]
OPENERS = ["Early on a rainy morning,", "After a long week,", "To everyone's surprise,", "Late in the afternoon,"]
ENDINGS = ["The shop was busy.", "Prices were fair that day.", "Nobody else came.", "It started to snow."]
MODEL = GPTJConfig(vocab_size=1024, n_positions=128, n_embd=128, n_layer=4, n_head=4, rotary_dim=16)


def make_example(rng: random.Random) -> dict[str, str]:
    name, item, city, count = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(CITIES), rng.randint(2, 9)
    report = (f"{rng.choice(OPENERS)} {name} walked into a market in {city} and bought {count} {item}. "
              f"{rng.choice(ENDINGS)}")
    return {"prompt": f"Report: {report}\nSummary:", "completion": f" {name} bought {count} {item} in {city}."}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path("runs/summarization"))
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose a new --out")
    args.out.mkdir(parents=True)

    rng = random.Random(0)
    data = args.out / "reports.jsonl"
    examples = [make_example(rng) for _ in range(1200)]
    data.write_text("".join(json.dumps(e) + "\n" for e in examples))
    tokenizer = train_bpe((e["prompt"] + e["completion"] for e in examples), vocab_size=MODEL.vocab_size)
    # Each example gets a sequence of its own; labels are -100 on the prompt and the padding.
    dataset = load_dataset(data, tokenizer, seq=64)
    train, held_out = dataset.split(eval_fraction=0.1, seed=0)
    assert held_out is not None  # 1200 examples: a tenth is never empty
    batches = BatchStream(train, batch=16, seed=0)

    # The budget holds half the model's 16 B/param training state: each batch of 16 runs as 8 micro-batches
    # (activations stay resident, nothing is recomputed; small enough for fp32 too, which --dtype auto picks on a
    # CPU without native bf16) and the update streams 256K parameters at a time.
    tc = TrainerConfig(optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.01),
                       schedule=LRSchedule("cosine", warmup_steps=min(10, args.steps // 10), total_steps=args.steps),
                       step=StepConfig(grad_accum=8, update_chunk=2**18, store=Placement.of("disk")),
                       device=DeviceConfig(budget="8MiB"))
    print(f"{MODEL.num_params():,} params; 16 B/param would need {16 * MODEL.num_params() / 2**20:.1f} MiB "
          f"on the device, the budget is 8 MiB; {len(train)} train / {len(held_out)} held-out examples")
    eval_ids, eval_labels = held_out.input_ids[:64], held_out.labels[:64]
    with StreamingTrainer(MODEL, tc, store_dir=args.out / "store") as trainer:
        print(f"step    0: held-out loss {trainer.evaluate(eval_ids, eval_labels):.3f}")
        for step in range(1, args.steps + 1):
            # positions: None, one example a sequence; mask: transformers' attention mask, False on padding
            ids, labels, positions, mask = next(batches)
            loss = trainer.step(ids, labels, positions, mask)
            if step % 25 == 0 or step == args.steps:
                print(f"step {step:4d}: train loss {loss:.3f}, held-out loss "
                      f"{trainer.evaluate(eval_ids, eval_labels):.3f}")
        unseen = make_example(random.Random(12345))
        summary = complete(trainer, tokenizer, unseen["prompt"], Sampling(max_new_tokens=24))
        print(f"\n{unseen['prompt']}{summary}\n(reference:{unseen['completion']})")
        print(f"device peak {trainer.ledger.peak / 2**20:.2f} MiB of the 8 MiB budget")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
