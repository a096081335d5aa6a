"""`streamer export`: write a run as a Hugging Face folder (LoRA's adapters merged) with its tokenizer's
files as they were given, or a LoRA run's adapters as a PEFT adapter folder (`streamer.export`)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from memory_model import parse_size
from streamer.cli.flags import declare_command
from streamer.console import make_console
from streamer.export import export_hf, export_peft, refuse_non_empty
from streamer.run import RunError
from streamer.store.layout import DTYPES
from streamer.run_dir import RunDir
from streamer.session import open_trainer


EXAMPLES = """\
examples:
  streamer export RUN ./hf-out
  streamer export RUN ./hf-out --dtype bf16 --max-shard-size 2GB --overwrite

A LoRA run's merged export is its base as the --from-pretrained checkpoint holds it (the store keeps only the
compute-dtype copy) plus the adapters in fp32, in the checkpoint's dtype; --base names that checkpoint if it
has moved."""


def declare(parser: argparse.ArgumentParser) -> None:
    declare_command(parser, export_command, "Export the master weights and the tokenizer; "
                    "transformers.AutoModelForCausalLM.from_pretrained loads the result.", EXAMPLES)
    parser.add_argument("run", metavar="RUN", help="a run directory")
    parser.add_argument("hf_dir", metavar="HF_DIR", help="the folder to write (must be new or empty)")
    parser.add_argument("--dtype", choices=tuple(DTYPES),
                        help="weights' dtype (default: fp32, the master weights exactly; a LoRA run's merged export: "
                             "its base checkpoint's)")
    parser.add_argument("--base", metavar="HF_DIR", help="a LoRA run's base checkpoint, for the merged export "
                        "(default: the run's --from-pretrained folder)")
    parser.add_argument("--max-shard-size", default="2GiB", help="largest safetensors shard (default: 2GiB)")
    parser.add_argument("--overwrite", action="store_true", help="replace HF_DIR if it holds files")
    parser.add_argument("--step", type=int, help="export this kept step (`streamer train --keep-last`, "
                        "--keep-best) instead of the last")
    parser.add_argument("--format", choices=("hf", "peft"), default="hf",
                        help="hf: full weights, LoRA's adapters merged (default); peft: a LoRA run's adapters as a "
                             "PEFT adapter folder")


def export_command(args: argparse.Namespace) -> int:
    run = RunDir.open(args.run)
    refuse_non_empty(Path(args.hf_dir), args.overwrite)  # before the run is opened: a wrong folder fails at once
    tokenizer = run.load_tokenizer()
    with open_trainer(run, {"device": "cpu", "budget": None}, step=args.step) as trainer:
        begin = time.perf_counter()
        if args.format == "peft":
            export_peft(trainer, args.hf_dir, args.base or run.read_config().from_pretrained, overwrite=args.overwrite)
            how = (f"peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(BASE), "
                   f"{args.hf_dir!r})")
        else:
            if args.base is not None and trainer.adapters is None:
                raise RunError("--base names a LoRA run's base checkpoint and this run trained every weight; drop it")
            base = args.base or run.read_config().from_pretrained if trainer.adapters is not None else None
            export_hf(trainer, tokenizer, args.hf_dir, args.dtype and DTYPES[args.dtype],
                      parse_size(args.max_shard_size), overwrite=args.overwrite, base=base,
                      source_config=run.read_source_config())
            how = f"transformers.AutoModelForCausalLM.from_pretrained({args.hf_dir!r})"
        step = trainer.step_count
    files = sorted(p.name for p in Path(args.hf_dir).iterdir())
    make_console().print(
        f"exported step {step} of {run.root} to {args.hf_dir} in {time.perf_counter() - begin:.1f} s: "
        f"{', '.join(files)}\nload it with {how}", markup=False, highlight=False)
    return 0
