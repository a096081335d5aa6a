"""`streamer export`: write a run as a Hugging Face GPT-J folder, with its tokenizer's files as they were given."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from memory_model import parse_size
from streamer.cli.generate import open_trainer
from streamer.console import make_console
from streamer.io.tokenizer import Tokenizer, load_tokenizer
from streamer.run import RunError
from streamer.store.layout import DTYPES
from streamer.run_dir import RunDir
from streamer.trainer import StreamingTrainer


def export_command(args: argparse.Namespace) -> int:
    run = RunDir.open(args.run)
    tokenizer = load_tokenizer(run.tokenizer)
    with open_trainer(run, {"device": "cpu", "budget": None}) as trainer:
        begin = time.perf_counter()
        export_hf(trainer, tokenizer, args.hf_dir, DTYPES[args.dtype], parse_size(args.max_shard_size),
                  overwrite=args.overwrite)
        step = trainer.step_count
    files = sorted(p.name for p in Path(args.hf_dir).iterdir())
    make_console().print(
        f"exported step {step} of {run.root} to {args.hf_dir} in {time.perf_counter() - begin:.1f} s: "
        f"{', '.join(files)}\nload it with transformers.GPTJForCausalLM.from_pretrained({args.hf_dir!r})",
        markup=False, highlight=False)
    return 0


def export_hf(trainer: StreamingTrainer, tokenizer: Tokenizer | None, hf_dir: str | Path,
              dtype: torch.dtype = torch.float32, max_shard_bytes: int = 2 * 2**30, overwrite: bool = False) -> None:
    """Write the trainer's master weights as a Hugging Face GPT-J folder, one unit in memory at a time.

    With a tokenizer: its files (copied verbatim where it was loaded from a folder, so the chat template, special
    tokens, model_max_length and padding side are the user's), and its bos/eos ids in config.json and
    generation_config.json, which `generate` in transformers reads to stop where `streamer generate` stops.
    """
    from streamer.io.hf import HFExporter
    if max_shard_bytes <= 0:
        raise RunError("--max-shard-size must be more than 0 bytes")
    token_ids = None if tokenizer is None else {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    with HFExporter(hf_dir, trainer.cfg, dtype, max_shard_bytes, overwrite, token_ids) as exporter:
        for unit in trainer.units:
            flat = trainer.unit_master(unit)
            for slot in trainer.layouts[unit].slots:
                exporter.add(slot.hf_key, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
        if tokenizer is not None:
            tokenizer.save(exporter.staging_dir)
            (exporter.staging_dir / "generation_config.json").write_text(json.dumps(token_ids, indent=2) + "\n")

