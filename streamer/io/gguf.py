"""A GGUF file (llama.cpp's) as a frozen base: `--from-pretrained FILE.gguf` and `StreamingTrainer.from_pretrained`.

Config and tokenizer are read as transformers reads them (`AutoConfig` and `AutoTokenizer` with `gguf_file=`: its
key map, its tokenizer converters). Tensor names are gguf's own map (`gguf.get_tensor_name_map`), as transformers'
`get_gguf_hf_weights_map` reverses it. Each block projection's weight is kept as the file's blocks
(layers/packed_gguf.py); Llama's q and k rows are put back in Hugging Face's order, as transformers'
`LlamaTensorProcessor` does to the dequantized weight. A row of a GGUF tensor is whole blocks, so moving rows of
blocks is the same as moving the rows they dequantize to. Everything else is dequantized by
`gguf.quants.dequantize` when read; a Gemma norm less the one llama.cpp's converter added (transformers'
`Gemma2TensorProcessor`). gguf and transformers are imported only here (the `gguf` extra).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from layers import ConfigError, ModelConfig
from layers.packed_gguf import TYPE_SIZES, GGUFBase
from layers.quant_gguf import QuantGGUF
from streamer.errors import CheckpointError
from streamer.io.tokenizer import Tokenizer

# GGUF architectures read here: those transformers' GGUF loading reads whose family is registered here (a
# Mistral file is "llama"; a mixture's experts are not kept as blocks yet). What transformers' TENSOR_PROCESSORS
# undo of llama.cpp's converter: the q and k rows it permuted (interleaved RoPE), and the one it added to Gemma's
# norm weights.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
PERMUTED = {"llama": (".attn_q.", ".attn_k.")}
NORMS_PLUS_ONE = ("gemma3",)


def is_gguf(path: str | Path) -> bool:
    """`path` names a GGUF file (by its name: what --from-pretrained is given)."""
    return str(path).endswith(".gguf")


def _imports() -> Any:
    try:
        import gguf
        import transformers  # noqa: F401  (its GGUF config and tokenizer readers)
    except ImportError:
        raise CheckpointError("a GGUF file needs the gguf and transformers packages: pip install "
                              "'weight-streaming[gguf]'") from None
    return gguf


class GGUFCheckpoint:
    """One GGUF file, read one tensor at a time (numpy maps the file; nothing is read until asked for)."""

    def __init__(self, path: Path, config: ModelConfig, tensors: dict[str, Any], permuted: set[str],
                 plus_one: set[str]) -> None:
        self.path, self.config = path, config
        self._tensors = tensors  # HF key -> gguf's ReaderTensor
        self._permuted = permuted  # HF keys whose rows go back to Hugging Face's order
        self._plus_one = plus_one  # HF keys of norm weights stored plus one

    @classmethod
    def open(cls, path: str | Path) -> "GGUFCheckpoint":
        from streamer.io.hf import expected_tensors  # (loaded only with a checkpoint to read)

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path} is not a file; pass a .gguf file or a Hugging Face folder")
        gguf = _imports()
        try:
            reader = gguf.GGUFReader(path)
            arch = str(reader.fields["general.architecture"].contents())
        except (ValueError, KeyError, OSError, IndexError) as exc:
            raise CheckpointError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); download it "
                                  "again") from None
        if arch not in ARCHITECTURES:
            raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not read yet (only "
                                  f"{', '.join(ARCHITECTURES)}); pass the Hugging Face folder it was made from")
        config = _config(path)
        arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
        names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
        by_name = {t.name: t for t in reader.tensors}
        tensors, permuted, plus_one = {}, set(), set()
        for key, meta in expected_tensors(config).items():
            module, suffix = key.rsplit(".", 1)
            name = names.get_name(module)
            tensor = by_name.get(f"{name}.{suffix}") if name is not None else None
            if tensor is None:
                raise CheckpointError(f"{path} holds no tensor for {key} (looked for {name}.{suffix}); the file is "
                                      "not a whole model: download it again")
            type_name = tensor.tensor_type.name
            if type_name not in TYPE_SIZES:
                raise CheckpointError(f"{path}: {tensor.name} is GGUF type {type_name}, which has no dequantizer "
                                      f"here (read: {', '.join(TYPE_SIZES)}); pass a GGUF file of those types, "
                                      "or the Hugging Face folder it was made from")
            shape = tuple(int(d) for d in reversed(tensor.shape))
            wanted = tuple(meta.shape)
            if shape != wanted:
                raise CheckpointError(f"{path}: {tensor.name} is {shape}, but the file's config makes {key} "
                                      f"{wanted}; the file is damaged: download it again")
            tensors[key] = tensor
            if any(part in tensor.name for part in PERMUTED.get(arch, ())):
                permuted.add(key)
            if arch in NORMS_PLUS_ONE and "norm.weight" in tensor.name:
                plus_one.add(key)
        return cls(path, config, tensors, permuted, plus_one)

    def base(self) -> GGUFBase:
        """The type of each block projection's weight (those a run keeps as the file's blocks)."""
        cfg = self.config
        keys = [cfg.adapter().key(unit, f"{module}.weight") for unit in cfg.unit_names() if unit.startswith("block.")
                for module in cfg.lora().projections.values()]
        return GGUFBase(tuple((key, self._tensors[key].tensor_type.name) for key in keys))

    def _blocks(self, key: str) -> np.ndarray:
        """The tensor's rows as bytes (out, row bytes), Llama's q and k rows in Hugging Face's order."""
        tensor = self._tensors[key]
        rows = int(tensor.shape[-1])
        data = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1)
        if key in self._permuted:
            heads = self.config.num_key_value_heads if ".k_proj." in key else self.config.num_attention_heads
            data = data.reshape(heads, rows // heads // 2, 2, -1).swapaxes(2, 1).reshape(rows, -1)
        return data

    def read_4bit(self, key: str) -> dict[str, torch.Tensor]:
        """A block projection's pieces as the store keeps them (its blocks and type), as HFCheckpoint.read_4bit."""
        return QuantGGUF.pieces_of(torch.from_numpy(self._blocks(key).copy()), self._tensors[key].tensor_type.name)

    def read(self, key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor dequantized by gguf (float32), then in `dtype`, as transformers loads it."""
        from gguf.quants import dequantize

        tensor = self._tensors[key]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if len(shape) == 1:
            values = dequantize(np.ascontiguousarray(tensor.data), tensor.tensor_type).reshape(shape)
        else:
            values = dequantize(self._blocks(key), tensor.tensor_type).reshape(shape)
        values = np.array(values, dtype=np.float32)  # (a copy the caller owns)
        if key in self._plus_one:
            values -= 1
        return torch.from_numpy(values).to(dtype)

    def validate(self) -> None:
        """Names, shapes and types were checked at open."""


def _config(path: Path) -> ModelConfig:
    """The model config transformers reads from the file's metadata."""
    import transformers

    try:
        raw = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
        return ModelConfig.from_hf(raw)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{path}: transformers cannot read its config ({type(exc).__name__}: {exc})") from None


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer transformers builds from the file (`AutoTokenizer`, `gguf_file=`)."""
    _imports()
    import transformers

    path = Path(path)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{path}: transformers cannot build its tokenizer ({type(exc).__name__}: {exc}); pass "
                              "--tokenizer FOLDER") from None
    return Tokenizer(tok.backend_tokenizer, eos_token=tok.eos_token, bos_token=tok.bos_token,
                     chat_template=tok.chat_template if isinstance(tok.chat_template, str) else None)
