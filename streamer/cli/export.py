"""`streamer export`: write a run as a Hugging Face folder (LoRA's adapters merged) with its tokenizer's
files as they were given, or a LoRA run's adapters as a PEFT adapter folder."""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from streamer.io.hf import HFCheckpoint


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
    tokenizer = load_tokenizer(run.tokenizer)
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
                      parse_size(args.max_shard_size), overwrite=args.overwrite, base=base)
            how = f"transformers.AutoModelForCausalLM.from_pretrained({args.hf_dir!r})"
        step = trainer.step_count
    files = sorted(p.name for p in Path(args.hf_dir).iterdir())
    make_console().print(
        f"exported step {step} of {run.root} to {args.hf_dir} in {time.perf_counter() - begin:.1f} s: "
        f"{', '.join(files)}\nload it with {how}", markup=False, highlight=False)
    return 0


def refuse_non_empty(out: Path, overwrite: bool) -> None:
    """A folder holding files is written only with --overwrite."""
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise RunError(f"{out} is not empty; choose a new folder or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise RunError(f"{out} is a file; choose a folder to export to")
    if out.is_symlink():  # an export replaces the folder whole, which would replace the link, not where it points
        raise RunError(f"{out} is a symbolic link; export to the folder it points to ({out.resolve()}) or choose a "
                       "new folder")


def export_peft(trainer: StreamingTrainer, out_dir: str | Path, base: str | None, overwrite: bool = False) -> None:
    """Write a LoRA run's adapters as PEFT writes them: adapter_config.json and
    adapter_model.safetensors with PEFT's keys ('base_model.model.transformer.h.0.attn.q_proj.lora_A.weight';
    `Adapters.hf_state_dict`)."""
    from safetensors.torch import save_file

    if trainer.adapters is None:
        raise RunError("this run trained every weight, not LoRA adapters: export it without --format peft")
    out = Path(out_dir)
    refuse_non_empty(out, overwrite)
    if out.exists() and any(out.iterdir()):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    lora, targets = trainer.tc.lora, trainer.adapters.targets
    # A mixture's fused experts are weight tensors, which PEFT targets apart from the Linear modules.
    modules = [t for t in targets if t not in trainer.cfg.lora_parameters]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules,
              "target_parameters": [t for t in targets if t not in modules], "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
              "use_dora": False}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = trainer.adapters.hf_state_dict({unit: trainer.cfg.hf_prefix(unit) for unit in trainer.units})
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def export_hf(trainer: StreamingTrainer, tokenizer: Tokenizer | None, hf_dir: str | Path,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 2 * 2**30, overwrite: bool = False,
              base: str | Path | None = None) -> None:
    """Write the trainer's master weights (LoRA's adapters merged) as a Hugging Face folder, one unit in
    memory at a time, in `dtype` (default: fp32).

    A LoRA run's store holds its frozen base in the compute dtype only; with `base` (the checkpoint the run
    started from) the merged weights are that checkpoint's full-precision base plus scaling x B A in fp32, in
    the checkpoint's dtype by default: then they equal PEFT's base plus adapter to fp32 rounding.

    With a tokenizer: its files (copied verbatim where it was loaded from a folder, so the chat template, special
    tokens, model_max_length and padding side are the user's), and its bos/eos ids in config.json and
    generation_config.json, which `generate` in transformers reads to stop where `streamer generate` stops.
    """
    from streamer.io.hf import HFExporter
    if max_shard_bytes <= 0:
        raise RunError("--max-shard-size must be more than 0 bytes")
    token_ids = None if tokenizer is None else {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    # A 4-bit base's run exports the model it trained: its base dequantized, the adapters merged (in fp32).
    full_precision = base is not None and trainer.adapters is not None and not trainer.tc.lora.load_in_4bit
    source = _open_base(base, trainer) if full_precision and base is not None else None
    if dtype is None:
        dtype = torch.float32 if source is None else source.dtype(source.keys()[0])
    with HFExporter(hf_dir, trainer.cfg, dtype, max_shard_bytes, overwrite, token_ids) as exporter:
        for unit in trainer.units:
            if source is None:
                flat = trainer.merged_unit_master(unit)
            else:
                flat = _full_precision_base(trainer, source, unit)
                assert trainer.adapters is not None  # a full-precision source only for a LoRA run
                trainer.adapters.merge_into(unit, flat, trainer.layouts[unit])
            for slot in trainer.layouts[unit].slots:
                exporter.add(slot.hf_key, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
        if tokenizer is not None:
            tokenizer.save(exporter.staging_dir)
            (exporter.staging_dir / "generation_config.json").write_text(json.dumps(token_ids, indent=2) + "\n")



def _open_base(base: str | Path, trainer: StreamingTrainer) -> "HFCheckpoint":
    """The LoRA run's base checkpoint, which must be there and describe this run's model."""
    from streamer.io.hf import HFCheckpoint
    if not Path(base, "config.json").is_file():
        raise RunError(f"{base} (this LoRA run's base checkpoint) is not there: the merged export adds the adapters "
                       "to its full-precision weights; pass --base HF_DIR with the folder the run started from")
    source = HFCheckpoint.open(base)
    if source.config != trainer.cfg:
        raise RunError(f"{base} holds another model than this run's; pass --base HF_DIR with the folder the run "
                       "started from")
    return source


def _full_precision_base(trainer: StreamingTrainer, source: "HFCheckpoint", unit: str) -> torch.Tensor:
    """A unit's flat fp32 base as the source checkpoint holds it, checked against the store's copy: rounded to
    the run's compute dtype, each tensor must equal the one the run trained on."""
    flat = trainer.unit_master(unit)
    for slot in trainer.layouts[unit].slots:
        piece, stored = source.read(slot.hf_key).reshape(-1), flat[slot.offset:slot.offset + slot.numel]
        if not torch.equal(piece.to(trainer.tc.compute_dtype).float(), stored):
            raise RunError(f"{slot.hf_key} in {source.root} differs from the base this run trained on; pass --base "
                           "HF_DIR with the folder the run started from")
        stored.copy_(piece)
    return flat
