"""A Hugging Face GPT-J folder -> the host store -> a few streamed steps -> a Hugging Face folder -> transformers.

    python examples/hf_roundtrip.py [--hf-dir DIR] [--out runs/hf-roundtrip] [--steps 3]

Without --hf-dir a small random GPT-J is made with transformers and saved as sharded safetensors beside a
tokenizer trained offline. With --hf-dir, any GPT-J folder in Hugging Face layout works (config.json,
model.safetensors or shards with model.safetensors.index.json, or pytorch_model.bin; tokenizer.json or
vocab.json + merges.txt): the import reads one tensor at a time, so the process grows by a few units'
worth of memory (measured on a 355M model: 819 MiB, against 1,355 MiB of fp32 weights; the largest unit is
197 MiB), not by the model. The CLI does the same with `streamer train --from-pretrained DIR` and `streamer export`.
"""
from __future__ import annotations

import argparse
import threading
from pathlib import Path

import psutil
import torch
import transformers

from layers import GPTJ, GPTJConfig
from streamer import StreamingTrainer, TrainerConfig
from streamer.export import export_hf
from streamer.io.data import BatchStream, demo_corpus, tokenize
from streamer.io.tokenizer import load_tokenizer, train_bpe

SMALL = GPTJConfig(vocab_size=1024, n_positions=128, n_embd=128, n_layer=4, n_head=4, rotary_dim=16)
SHARD = 1_000_000  # bytes: small enough that the small model is written as several shards


def make_checkpoint(path: Path) -> None:
    """What a user downloads: config.json, sharded safetensors + index, tokenizer files."""
    torch.manual_seed(0)
    hf_config = transformers.GPTJConfig(**{k: v for k, v in SMALL.adapter().to_hf().items() if k != "architectures"})
    transformers.GPTJForCausalLM(hf_config).save_pretrained(path, max_shard_size=SHARD)
    train_bpe(demo_corpus(), vocab_size=SMALL.vocab_size).save(path)


class PeakMemory:
    """This process's private (anonymous) memory, sampled every 5 ms while the block runs; its peak growth.

    Private, not RSS: RSS also counts the checkpoint's file pages that safetensors maps while reading, which
    belong to the kernel's page cache and are dropped under memory pressure.
    """

    def __enter__(self) -> "PeakMemory":
        self.process = psutil.Process()
        self.start = self.peak = self._private()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _private(self) -> int:
        info = self.process.memory_info()
        return info.rss - info.shared

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, self._private())
            threading.Event().wait(0.005)

    def __exit__(self, *_: object) -> None:
        self._running = False
        self._thread.join()

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", type=Path, help="a GPT-J folder in Hugging Face layout (default: make one)")
    parser.add_argument("--out", type=Path, default=Path("runs/hf-roundtrip"))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose a new --out")
    source = args.hf_dir or args.out / "source"
    if args.hf_dir is None:
        make_checkpoint(source)
    print(f"source: {source}: {', '.join(sorted(p.name for p in source.iterdir()))}")

    tc = TrainerConfig.of(lr=1e-4, store="disk", activations="checkpoint")
    with PeakMemory() as memory:
        trainer = StreamingTrainer.from_pretrained(source, tc, store_dir=args.out / "store")
    cfg = trainer.cfg
    largest_unit = max(lay.numel for lay in trainer.layouts.values()) * 4 / 2**20
    print(f"imported {cfg.num_params():,} params ({cfg.num_params() * 4 / 2**20:,.1f} MiB in fp32) tensor by "
          f"tensor: private memory grew by at most {memory.growth_mib:,.1f} MiB (largest unit {largest_unit:,.1f} "
          "MiB in fp32)")

    tokenizer = load_tokenizer(source)
    seq = min(128, cfg.max_position_embeddings)
    batches = BatchStream(tokenize(demo_corpus()[:40], tokenizer, seq), batch=4)
    with trainer:
        for step in range(1, args.steps + 1):
            print(f"step {step}: loss {trainer.step(*next(batches)):.3f}")
        export_hf(trainer, tokenizer, args.out / "hf", max_shard_bytes=SHARD if args.hf_dir is None else 2 * 2**30)
        print(f"exported: {', '.join(sorted(p.name for p in (args.out / 'hf').iterdir()))}")
        if cfg.num_params() > 2 * 10**9:
            print("skipping the transformers comparison: it would load the whole model into memory")
            return
        state = trainer.state_dict()

    exported = transformers.GPTJForCausalLM.from_pretrained(args.out / "hf", attn_implementation="eager").eval()
    reference = GPTJ(cfg, init=False)
    reference.load_hf_state_dict(state)
    ids = torch.tensor([tokenizer.encode("The for statement is used to iterate")])
    with torch.no_grad():
        diff = (exported(ids).logits - reference(ids)).abs().max().item()
    print(f"transformers loads the export; its logits differ from the trainer's weights by at most {diff:.2e}")


if __name__ == "__main__":
    main()
