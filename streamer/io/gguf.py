"""A GGUF file (llama.cpp's) as a frozen base: `--from-pretrained FILE.gguf` and `StreamingTrainer.from_pretrained`.

Config and tokenizer are read as transformers reads them (`AutoConfig` and `AutoTokenizer` with `gguf_file=`: its
key map, its tokenizer converters). Tensor names are gguf's own map (`gguf.get_tensor_name_map`), as transformers'
`get_gguf_hf_weights_map` reverses it. Each block projection's weight is kept as the file's blocks
(layers/packed_gguf.py); Llama's q and k rows are put back in Hugging Face's order, as transformers'
`LlamaTensorProcessor` does to the dequantized weight. A row of a GGUF tensor is whole blocks, so moving rows of
blocks is the same as moving the rows they dequantize to. Everything else is dequantized by
`gguf.quants.dequantize` when read (into the compute dtype, a bounded number of rows at a time); a Gemma norm
less the one llama.cpp's converter added (transformers' `Gemma2TensorProcessor`). A mixture's fused expert
tensors are kept as the file's blocks too: gate_up_proj is each expert's ffn_gate_exps rows, then its ffn_up_exps
rows, as transformers' `Qwen2MoeTensorProcessor` joins them. gguf and transformers are imported only here (the
`gguf` extra).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from layers import ConfigError, ModelConfig
from layers.packed_gguf import TYPE_SIZES, GGUFBase, kept
from layers.quant_gguf import QuantGGUF
from streamer.errors import CheckpointError
from streamer.io.tokenizer import Tokenizer

# GGUF architectures read here: those transformers' GGUF loading reads whose family is registered here (a
# Mistral file is "llama"; so is a Mixtral file, with experts, which transformers reads as a dense Llama: refused),
# and those of mixtures. What transformers' TENSOR_PROCESSORS undo of llama.cpp's converter: the q and k rows it
# permuted (interleaved RoPE), and the one it added to Gemma's norm weights.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen3moe")
MIXTURES = ("qwen3moe",)
# A fused expert tensor's parts as llama.cpp keeps them, by its last name (transformers' Qwen2MoeTensorProcessor
# puts gate's rows, then up's, in each expert's gate_up_proj).
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PERMUTED = {"llama": (".attn_q.", ".attn_k.")}
NORMS_PLUS_ONE = ("gemma3",)
# A tensor read into a dtype other than gguf's float32 is dequantized this many values at a time (whole rows), each
# block cast as it comes: an embedding is never held whole in float32 beside its destination.
DEQUANTIZE_NUMEL = 2**21


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
        self._tensors = tensors  # HF key -> gguf's ReaderTensors (a fused expert tensor's parts)
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
        experts = reader.fields.get(f"{arch}.expert_count")
        if arch not in MIXTURES and experts is not None and int(experts.contents()) > 0:
            raise CheckpointError(f"{path}: a GGUF {arch!r} file with experts (a Mixtral) is not read: transformers "
                                  "reads it as a dense model; pass the Hugging Face folder it was made from")
        config = _config(path)
        width = reader.fields.get(f"{arch}.expert_feed_forward_length")
        if config.sparse_mlp is not None and width is not None and int(width.contents()) != config.sparse_mlp.width:
            raise CheckpointError(f"{path}: its experts are {int(width.contents())} wide, but transformers reads no "
                                  f"expert width from a GGUF file and takes {config.sparse_mlp.width}; pass the "
                                  "Hugging Face folder it was made from")
        arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
        names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
        by_name = {t.name: t for t in reader.tensors}
        tensors, permuted, plus_one = {}, set(), set()
        for key, meta in expected_tensors(config).items():
            wanted = tuple(meta.shape)
            if len(wanted) == 3:  # a fused expert tensor: the file's tensors of its parts, each (E, out, in)
                parent, fused = key.rsplit(".", 1)
                looked = [f"{names.get_name(f'{parent}.{part}')}.weight" for part in FUSED[fused]]
            else:
                module, suffix = key.rsplit(".", 1)
                looked = [f"{names.get_name(module)}.{suffix}"]
            if any(name not in by_name for name in looked):
                raise CheckpointError(f"{path} holds no tensor for {key} (looked for {' and '.join(looked)}); the "
                                      "file is not a whole model: download it again")
            parts = tuple(by_name[name] for name in looked)
            types = {t.tensor_type.name for t in parts}
            unread = types - set(TYPE_SIZES)
            if unread or len(types) > 1:
                what = (f"is GGUF type {', '.join(sorted(unread))}, which has no dequantizer here (read: "
                        f"{', '.join(TYPE_SIZES)})") if unread else f"mixes GGUF types {', '.join(sorted(types))}"
                raise CheckpointError(f"{path}: {' and '.join(looked)} {what}; pass a GGUF file of those types, or "
                                      "the Hugging Face folder it was made from")
            shapes = [_shape((t,)) for t in parts]
            if _shape(parts) != wanted or len({s[:1] + s[2:] for s in shapes}) > 1:
                raise CheckpointError(f"{path}: {' and '.join(looked)} {' and '.join(map(str, shapes))}, but the "
                                      f"file's config makes {key} {wanted}; the file is damaged: download it again")
            tensors[key] = parts
            if any(part in looked[0] for part in PERMUTED.get(arch, ())):
                permuted.add(key)
            if arch in NORMS_PLUS_ONE and "norm.weight" in looked[0]:
                plus_one.add(key)
        return cls(path, config, tensors, permuted, plus_one)

    def base(self) -> GGUFBase:
        """The type of each block projection's weight (those a run keeps as the file's blocks)."""
        cfg = self.config
        return GGUFBase(tuple((key, self._type(key)) for unit in cfg.unit_names() if unit.startswith("block.")
                              for key, _ in kept(cfg, unit)))

    def _blocks(self, key: str) -> np.ndarray:
        """The tensor's rows as bytes (rows, row bytes), Llama's q and k rows in Hugging Face's order. A fused
        expert tensor's rows are expert by expert, each expert's rows of its parts in turn (gate_up_proj: its
        gate rows, then its up rows)."""
        parts = [np.ascontiguousarray(t.data).view(np.uint8) for t in self._tensors[key]]
        experts = int(self._tensors[key][0].shape[2]) if len(self._tensors[key][0].shape) == 3 else 1
        data = np.concatenate([p.reshape(experts, -1) for p in parts], axis=1)
        rows = sum(int(np.prod(t.shape[1:])) for t in self._tensors[key])
        data = data.reshape(rows, -1)
        if key in self._permuted:
            heads = self.config.num_key_value_heads if ".k_proj." in key else self.config.num_attention_heads
            data = data.reshape(heads, rows // heads // 2, 2, -1).swapaxes(2, 1).reshape(rows, -1)
        return data

    def read_4bit(self, key: str) -> dict[str, torch.Tensor]:
        """A block projection's pieces as the store keeps them (its blocks and type), as HFCheckpoint.read_4bit."""
        return QuantGGUF.pieces_of(torch.from_numpy(self._blocks(key).copy()), self._type(key))

    def _type(self, key: str) -> str:
        """The GGUF type of the tensor's blocks (one for all its parts)."""
        return str(self._tensors[key][0].tensor_type.name)

    def dtype(self, key: str) -> torch.dtype:
        """The dtype gguf dequantizes every tensor into, whatever its type in the file."""
        return torch.float32

    def read(self, key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor dequantized by gguf (float32), then in `dtype`, as transformers loads it: into another dtype,
        `DEQUANTIZE_NUMEL` values at a time."""
        parts = self._tensors[key]
        if len(parts[0].shape) == 1:
            return torch.from_numpy(self._dequantized(key, np.ascontiguousarray(parts[0].data))).to(dtype)
        rows = self._blocks(key)
        if dtype == torch.float32:
            return torch.from_numpy(self._dequantized(key, rows).reshape(_shape(parts)))
        out = torch.empty(_shape(parts), dtype=dtype)
        flat = out.view(len(rows), -1)
        step = max(1, DEQUANTIZE_NUMEL // flat.shape[1])
        for first in range(0, len(rows), step):
            flat[first:first + step].copy_(torch.from_numpy(self._dequantized(key, rows[first:first + step])))
        return out

    def _dequantized(self, key: str, data: np.ndarray) -> np.ndarray:
        """Values of `key` from its data (whole rows) as gguf dequantizes them, in float32 (a copy); a Gemma norm
        less the one llama.cpp's converter added."""
        from gguf.quants import dequantize

        values = np.array(dequantize(data, self._tensors[key][0].tensor_type), dtype=np.float32)  # (a copy)
        if key in self._plus_one:
            values -= 1
        return values

    def validate(self) -> None:
        """Names, shapes and types were checked at open."""


def _shape(parts: tuple[Any, ...]) -> tuple[int, ...]:
    """The shape of a tensor (Hugging Face's order) made of the file's `parts`: one, or a fused expert tensor's
    parts (E, out, in) joined along each expert's rows."""
    shapes = [tuple(int(d) for d in reversed(t.shape)) for t in parts]
    return shapes[0] if len(shapes) == 1 else (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])


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
