"""`streamer export`: write a run as a Hugging Face GPT-J folder."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from memory_model import parse_size
from streamer.cli.flags import declare_command
from streamer.cli.generate import open_trainer
from streamer.console import make_console
from streamer.io.tokenizer import Tokenizer, load_tokenizer
from streamer.run import RunError
from streamer.store.layout import DTYPES
from streamer.run_dir import RunDir
from streamer.trainer import StreamingTrainer


EXAMPLES = """\
examples:
  streamer export RUN ./hf-out
  streamer export RUN ./hf-out --dtype bf16 --max-shard-size 2GB --overwrite"""


def declare(parser: argparse.ArgumentParser) -> None:
    declare_command(parser, export_command, "Export the master weights and the tokenizer; "
                    "transformers.GPTJForCausalLM.from_pretrained loads the result.", EXAMPLES)
    parser.add_argument("run", metavar="RUN", help="a run directory")
    parser.add_argument("hf_dir", metavar="HF_DIR", help="the folder to write (must be new or empty)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                        help="weights' dtype (default: fp32, the master weights exactly)")
    parser.add_argument("--max-shard-size", default="2GiB", help="largest safetensors shard (default: 2GiB)")
    parser.add_argument("--overwrite", action="store_true", help="replace HF_DIR if it holds files")


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
    """Write the trainer's master weights as a Hugging Face GPT-J folder, one unit in memory at a time."""
    from streamer.io.hf import HFExporter
    if max_shard_bytes <= 0:
        raise RunError("--max-shard-size must be more than 0 bytes")
    with HFExporter(hf_dir, trainer.cfg, dtype, max_shard_bytes, overwrite) as exporter:
        for unit in trainer.units:
            flat = trainer.unit_master(unit)
            for slot in trainer.layouts[unit].slots:
                exporter.add(slot.hf_key, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
        if tokenizer is not None:
            tokenizer.save(exporter.staging_dir)

