"""A trainer's weights out: a Hugging Face folder (LoRA's adapters merged) with its tokenizer's files as they were
given, or a LoRA run's adapters as a PEFT adapter folder. `streamer export` is this with flags."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from safetensors.torch import save_file

from streamer.io.staging import StagedFolder
from streamer.io.tokenizer import Tokenizer
from streamer.run import RunError
from streamer.trainer import StreamingTrainer

if TYPE_CHECKING:
    from streamer.io.hf import HFCheckpoint


def refuse_non_empty(out: Path, overwrite: bool) -> None:
    """Before any work: a folder holding files is written only with --overwrite; a file or a link is refused."""
    StagedFolder.refuse(out, overwrite, "pass --overwrite")


def export_peft(trainer: StreamingTrainer, out_dir: str | Path, base: str | None, overwrite: bool = False) -> None:
    """Write a LoRA run's adapters as PEFT writes them: adapter_config.json and
    adapter_model.safetensors with PEFT's keys ('base_model.model.transformer.h.0.attn.q_proj.lora_A.weight';
    `Adapters.hf_state_dict`). Written whole or not at all (`StagedFolder`)."""
    if trainer.adapters is None:
        raise RunError("this run trained every weight, not LoRA adapters: export it without --format peft")
    with StagedFolder(out_dir, overwrite, "pass --overwrite") as folder:
        _write_peft(trainer, folder.path, base)
        folder.commit()


def _write_peft(trainer: StreamingTrainer, out: Path, base: str | None) -> None:
    assert trainer.adapters is not None
    lora, targets = trainer.tc.lora, trainer.adapters.targets
    # A mixture's fused experts are weight tensors, which PEFT targets apart from the Linear modules.
    modules = [t for t in targets if t not in trainer.cfg.lora().parameters]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules,
              "target_parameters": [t for t in targets if t not in modules], "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
              "use_dora": False}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = trainer.adapters.hf_state_dict({unit: trainer.cfg.adapter().prefix(unit) for unit in trainer.units})
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def export_hf(trainer: StreamingTrainer, tokenizer: Tokenizer | None, hf_dir: str | Path,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 2 * 2**30, overwrite: bool = False,
              base: str | Path | None = None, source_config: Mapping[str, Any] | None = None) -> None:
    """Write the trainer's master weights (LoRA's adapters merged) as a Hugging Face folder, one unit in
    memory at a time, in `dtype` (default: fp32).

    A LoRA run's store holds its frozen base in the compute dtype only; with `base` (the checkpoint the run
    started from) the merged weights are that checkpoint's full-precision base plus scaling x B A in fp32, in
    the checkpoint's dtype by default: then they equal PEFT's base plus adapter to fp32 rounding.

    With a tokenizer: its files (copied verbatim where it was loaded from a folder, so the chat template, special
    tokens, model_max_length and padding side are the user's), and its bos/eos ids in config.json and
    generation_config.json, which `generate` in transformers reads to stop where `streamer generate` stops.
    `source_config`: the config.json the run started from (`RunDir.read_source_config`), whose fields the model's
    config does not hold config.json keeps.
    """
    from streamer.io.hf import HFExporter
    if max_shard_bytes <= 0:
        raise RunError("--max-shard-size must be more than 0 bytes")
    token_ids = None if tokenizer is None else {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    # A quantized base's run (4-bit, GGUF) exports the model it trained: its base dequantized, the adapters merged
    # (in fp32).
    full_precision = base is not None and trainer.adapters is not None and not trainer.tc.lora.quantized
    source = _open_base(base, trainer) if full_precision and base is not None else None
    if dtype is None:
        dtype = torch.float32 if source is None else source.dtype(source.keys()[0])
    with HFExporter(hf_dir, trainer.cfg, dtype, max_shard_bytes, overwrite, token_ids,
                    carried=source_config) as exporter:
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
