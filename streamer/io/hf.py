"""Hugging Face checkpoints (every family in layers) in and out, one tensor at a time.

A 6B checkpoint is larger than the memory this runtime is built to save, so
nothing here ever holds a whole model: `HFCheckpoint` opens shards lazily and
reads one tensor per call, and `HFExporter` holds at most one shard before it
goes to disk.

Long because every way a hub folder stores a weight is read here, tensor by tensor: shards, tensors saved
under other names or in parts, MXFP4-packed experts and bitsandbytes' 4-bit pieces.
"""
from __future__ import annotations

import functools
import json
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from layers import CheckpointMismatch, ConfigError, ModelConfig, check_state_dict, resident_model
from layers.config import gguf_note
from layers.packed4 import BLOCKSIZE, NESTED_BLOCKSIZE
from layers.quant4 import Quant4, Quant8, dequantize
from memory_model.lora import LoraConfig
from streamer.errors import CheckpointError, StoreError
from streamer.store.layout import DTYPES, dtype_name
from streamer.store.slabfile import pread_into
from streamer.io.staging import StagedFolder

SUPPORTED_DTYPES = tuple(DTYPES.values())
# Searched in this order: safetensors first, because a pickle can only be read
# safely through torch's restricted unpickler and is slower to open.
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                 "pytorch_model.bin", "pytorch_model.bin.index.json")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# MXFP4's 4-bit values by code (its low 3 bits the magnitude, its high bit the sign), as transformers' FP4_VALUES.
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Errors torch.load raises for files that are not a weights-only, mmap-able pickle.
_PICKLE_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError)


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lives and what it is, known without reading its data."""

    shard: str
    shape: tuple[int, ...]
    dtype: str  # torch's name ("float32") or safetensors' code for dtypes torch lacks ("F8_E4M3")

    def __post_init__(self) -> None:
        if not self.shard or any(d < 0 for d in self.shape):
            raise ValueError(f"invalid tensor entry {self}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HFCheckpoint:
    """A Hugging Face checkpoint folder: config.json plus safetensors or (weights-only) pickle weights."""

    def __init__(self, root: Path, config: ModelConfig, entries: dict[str, _Entry],
                 shards: dict[str, Any]) -> None:
        self.root = root
        self.config = config
        self._entries = entries
        self._shards = shards  # file name -> safe_open handle, or the mmap-ed dict a pickle holds

    @classmethod
    def open(cls, directory: str | Path) -> HFCheckpoint:
        root = Path(directory)
        if not root.is_dir():
            raise CheckpointError(f"{root} is not a folder; pass the folder that holds config.json and the weights")
        config = _read_config(root)
        layout = next((name for name in _WEIGHT_FILES if (root / name).is_file()), None)
        if layout is None:
            raise CheckpointError(f"{root} holds no weights; expected one of {', '.join(_WEIGHT_FILES)}"
                                  f"{gguf_note(root)}")
        if layout.endswith(".index.json"):
            wanted = _read_index(root, layout)
            files = sorted(set(wanted.values()))
        else:
            wanted, files = None, [layout]
        entries: dict[str, _Entry] = {}
        shards: dict[str, Any] = {}
        for name in files:
            shards[name], found = _open_shard(root, name)
            keys = found if wanted is None else [k for k, f in wanted.items() if f == name]
            for key in keys:
                if key not in found:
                    raise CheckpointError(f"{layout} puts {key!r} in {name}, which does not hold it; "
                                          "re-save the checkpoint or fix the index")
                if not key.endswith(config.ignored_checkpoint_suffixes):
                    entries[key] = found[key]
        checkpoint = cls(root, config, entries, shards)
        checkpoint._join_saved_parts()
        checkpoint._join_packed()
        checkpoint._join_4bit()
        checkpoint._join_8bit()
        checkpoint._drop_tied_copies()
        return checkpoint

    def _join_4bit(self) -> None:
        """A weight transformers saved 4-bit (bitsandbytes: W's packed codes, W.absmax, W.nested_absmax and
        W.quant_state.bitsandbytes__nf4, its JSON) is listed as W, its 16-bit shape and dtype: `read` dequantizes it,
        `read_4bit` gives its pieces as saved (a 4-bit run's import keeps them)."""
        self._quant4: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
        for name in [n for n in self._entries if BNB_STATE in n]:
            key, quant_type = name.split(BNB_STATE)
            raw = self._read_stored(name, self._entries[name], torch.uint8)
            try:
                state = json.loads(bytes(raw.tolist()).decode())
                shape, dtype, blocksize = tuple(state["shape"]), state["dtype"], state["blocksize"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{self.root}: {name} is not bitsandbytes' quant state ({_brief(exc)}); "
                                      "re-save the checkpoint") from None
            if blocksize != BLOCKSIZE or state.get("nested_blocksize", NESTED_BLOCKSIZE) != NESTED_BLOCKSIZE:
                raise CheckpointError(f"{self.root}: {key} is quantized in blocks of {blocksize}; only bitsandbytes' "
                                      f"default {BLOCKSIZE} is read: pass the 16-bit checkpoint with --load-in-4bit")
            if key in self._part_entries:  # joined into a fused tensor: one expert's weight of a mixture
                raise CheckpointError(f"{self.root}: {key} is one expert's weight saved 4-bit (transformers before 5 "
                                      "quantized each expert apart); a 4-bit base holds each fused expert tensor "
                                      "quantized whole, as bitsandbytes does: pass the 16-bit checkpoint with "
                                      "--load-in-4bit")
            pieces = {"weight": key, **{p: key + suffix for p, suffix in BNB_PIECES.items()
                                        if key + suffix in self._entries}}
            weight = self._entries[key]
            self._entries[key] = _Entry(weight.shard, shape, dtype)
            self._part_entries[key] = weight
            for piece in [name, *pieces.values(), *(key + suffix for suffix in BNB_CONSTANTS)]:
                if piece != key and piece in self._entries:
                    self._part_entries[piece] = self._entries.pop(piece)
            self._quant4[key] = ({**state, "quant_type": quant_type}, pieces)

    def _join_8bit(self) -> None:
        """A weight transformers saved 8-bit (bitsandbytes' Linear8bitLt: W int8, its module's SCB and
        weight_format) is listed as W in float16, the dtype Int8Params quantized it from: `read` dequantizes it,
        `read_4bit` gives its pieces as saved (an 8-bit run's import keeps them)."""
        for name in [n for n in self._entries if n.endswith(BNB_8BIT_SCALES)]:
            module = name.removesuffix(BNB_8BIT_SCALES)
            key = f"{module}.weight"
            weight = self._entries.get(key)
            if weight is None or weight.dtype != "int8" or len(weight.shape) != 2:
                raise CheckpointError(f"{self.root}: {name} has no 2D int8 weight {key} beside it, as bitsandbytes' "
                                      "Linear8bitLt saves one; re-save the checkpoint")
            self._entries[key] = _Entry(weight.shard, weight.shape, "float16")
            self._part_entries[key] = weight
            for piece in (name, f"{module}{BNB_8BIT_FORMAT}"):
                if piece in self._entries:
                    self._part_entries[piece] = self._entries.pop(piece)
            self._quant4[key] = ({"quant_type": "int8"}, {"weight": key, "SCB": name})

    @property
    def quantized(self) -> bool:
        """Some weights are saved quantized by bitsandbytes (4-bit or 8-bit)."""
        return bool(self._quant4)

    def read_4bit(self, key: str) -> dict[str, torch.Tensor] | None:
        """A 4-bit or 8-bit saved weight's pieces as saved (layers.packed4's names); None: `key` is not one."""
        if key not in self._quant4:
            return None
        state, names = self._quant4[key]
        pieces = {piece: self._read_stored(name, self._part_entries[name],
                                           getattr(torch, self._part_entries[name].dtype))
                  for piece, name in names.items()}
        if "nested_offset" in state:
            pieces["nested_offset"] = torch.tensor(state["nested_offset"], dtype=torch.float32)
        return pieces

    def _join_saved_parts(self) -> None:
        """A tensor transformers saves under another name (`StateDictAdapter.saved_name`) or in parts (a
        mixture's experts, one expert and projection a tensor: `StateDictAdapter.saved_parts`) is listed under the
        model's own name, and read whole."""
        self._parts: dict[str, list[list[str]]] = {}
        self._renamed: dict[str, str] = {}  # the model's name -> the one it is saved under
        self._part_entries: dict[str, _Entry] = {}
        for key in expected_tensors(self.config):
            parts, name = self.config.adapter().saved_parts(key), self.config.adapter().saved_name(key)
            if parts is None:
                if key not in self._entries and name in self._entries:
                    self._entries[key] = self._entries.pop(name)
                    self._renamed[key] = name
                continue
            names = [name for row in parts for name in row]
            if key in self._entries or not all(name in self._entries for name in names):
                continue
            first = self._entries[names[0]]
            if any(self._entries[name].shape != first.shape for name in names):
                raise CheckpointError(f"{self.root}: the tensors that make {key} ({names[0]} …) differ in shape; "
                                      "re-save the checkpoint")
            self._entries[key] = _Entry(first.shard, (len(parts), len(parts[0]) * first.shape[0], *first.shape[1:]),
                                        first.dtype)
            self._part_entries.update((name, self._entries.pop(name)) for name in names)
            self._parts[key] = parts

    def _join_packed(self) -> None:
        """A tensor a published checkpoint holds MXFP4-packed (`StateDictAdapter.packed`: gpt-oss's experts, its
        blocks (..., out, G, 16) of two 4-bit codes a byte and its scales (..., out, G), one power of two per 32
        values) is listed under the model's own name, (..., G * 32, out), and dequantized when read. Its values
        are exact in bfloat16 (2-bit mantissas times powers of two), the dtype it is listed as."""
        self._packed: dict[str, tuple[str, str]] = {}
        for key in expected_tensors(self.config):
            names = self.config.adapter().packed(key)
            if names is None or key in self._entries or not all(name in self._entries for name in names):
                continue
            blocks, scales = (self._entries[name] for name in names)
            if blocks.dtype != "uint8" or scales.dtype != "uint8" or blocks.shape[:-1] != scales.shape:
                raise CheckpointError(f"{self.root}: {names[0]} {blocks.shape} ({blocks.dtype}) and {names[1]} "
                                      f"{scales.shape} ({scales.dtype}) are not MXFP4 blocks and their scales")
            *prefix, rows, groups, pairs = blocks.shape
            self._entries[key] = _Entry(blocks.shard, (*prefix, groups * pairs * 2, rows), "bfloat16")
            self._part_entries.update((name, self._entries.pop(name)) for name in names)
            self._packed[key] = names

    def _drop_tied_copies(self) -> None:
        """A tied parameter's second name, which some writers keep, must hold the one tensor (transformers
        unties the model otherwise): then it is dropped, and the owner's name is read."""
        for tied, owner in self.config.adapter().tied_keys().items():
            if tied in self._entries and owner in self._entries:
                if not torch.equal(self.read(tied), self.read(owner)):
                    raise CheckpointError(f"{self.root}: {tied} differs from {owner}, but config.json says "
                                          "tie_word_embeddings=true; set it to false to keep both")
                del self._entries[tied]

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the shards' files and mappings; the checkpoint cannot be read afterwards."""
        for source in self._shards.values():
            if isinstance(source, _Safetensors):
                source.close()
        self._shards.clear()

    def keys(self) -> list[str]:
        """Every tensor name, in storage order (shard by shard), minus buffers that hold no learned state."""
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def dtype(self, key: str) -> torch.dtype:
        name = self._entry(key).dtype
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(f"{key} in {self.root} is stored as {name}; only float32, bfloat16 and "
                                  "float16 weights are supported: convert the checkpoint to one of them")
        return dtype

    def read(self, key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor as a fresh CPU tensor of `dtype` that the caller owns."""
        entry = self._entry(key)
        self.dtype(key)
        if key in self._quant4 and self._quant4[key][0]["quant_type"] == "int8":
            pieces = self.read_4bit(key)
            assert pieces is not None  # a key in _quant4 has its pieces
            return Quant8(dtype).dequantize(pieces, (entry.shape[0], entry.shape[1]))
        if key in self._quant4:
            state, _ = self._quant4[key]
            quant = Quant4(state["quant_type"], "nested_offset" in state, getattr(torch, state["dtype"]))
            pieces, (rows, cols) = self.read_4bit(key), self.shape(key)
            assert pieces is not None  # a key in _quant4 has its pieces
            return dequantize(pieces, (rows, cols), quant).to(dtype)
        if key in self._packed:
            blocks, scales = (self._read_stored(name, self._part_entries[name], torch.uint8)
                              for name in self._packed[key])
            return dequantize_mxfp4(blocks, scales, dtype)
        if key in self._parts:  # each row (expert) its parts concatenated, the rows stacked
            return torch.stack([torch.cat([self._read_stored(name, self._part_entries[name], dtype) for name in row])
                                for row in self._parts[key]])
        return self._read_stored(self._renamed.get(key, key), entry, dtype)

    def _read_stored(self, key: str, entry: _Entry, dtype: torch.dtype) -> torch.Tensor:
        if not self._shards:
            raise CheckpointError(f"{self.root} was closed; open it again to read {key}")
        source = self._shards[entry.shard]
        try:
            if isinstance(source, _Safetensors):
                return source.read(key, entry).to(dtype)  # (a tensor of its own: no copy in its own dtype)
            tensor = source[key]
        except (SafetensorError, StoreError) as exc:
            raise CheckpointError(f"cannot read {key} from {self.root / entry.shard} ({_brief(exc)}); "
                                  "the file is damaged: download or export it again") from None
        # A pickle's tensors are views of a file mapping that later reads share,
        # so a caller writing into them would corrupt the checkpoint's next read.
        return tensor.to(dtype=dtype, copy=True)

    def iter_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) one at a time in storage order; only the tensor just yielded is held."""
        for key in self._entries:
            yield key, self.read(key, dtype)

    def validate(self) -> None:
        """Check names, shapes and dtypes against the model config.json describes, reading no tensor data."""
        for key in self._entries:
            self.dtype(key)
        given = {k: torch.empty(e.shape, device="meta") for k, e in self._entries.items()}
        try:
            check_state_dict(expected_tensors(self.config), given)
        except CheckpointMismatch as exc:
            raise CheckpointError(f"{self.root}: {exc}".replace("\n", "\\n")) from None

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise CheckpointError(f"{self.root} has no tensor named {key!r}; its keys start with "
                                  f"{list(self._entries)[:3]}") from None


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 blocks (..., out, G, 16) uint8, two 4-bit codes a byte (the low one first), and their scales
    (..., out, G) uint8, each 2^(scale - 127) over its group's 32 values -> (..., G * 32, out) of `dtype`: the
    values of each of the `out` rows, the input dimension first, as transformers' `convert_moe_packed_tensors`
    makes them (the same table, the same ldexp in `dtype`)."""
    *prefix, groups, pairs = blocks.shape
    table = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(*prefix, groups, 2 * pairs, dtype=dtype)
    out[..., 0::2] = table[(blocks & 0x0F).to(torch.int)]
    out[..., 1::2] = table[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, scales.to(torch.int32)[..., None] - 127, out=out)
    return out.reshape(*prefix, groups * 2 * pairs).transpose(-1, -2).contiguous()


def expected_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The HF state dict a config describes, as meta tensors: names and shapes, no memory. A tied parameter is
    there once, under its owner's name, as transformers saves it."""
    try:
        with torch.device("meta"):
            state = resident_model(cfg, init=False).state_dict()
        return {k: v for k, v in state.items() if k not in cfg.adapter().tied_keys()}
    except (RuntimeError, OverflowError, ValueError) as exc:
        raise CheckpointError(f"the config describes a model that cannot be built ({_brief(exc)}); "
                              "check its sizes") from None


# The quantization_config methods whose folders hold weights this reader reads: gpt-oss's MXFP4 experts
# (`StateDictAdapter.packed`), a GGUF file's dequantized tensors, and bitsandbytes' 4-bit tensors (`_join_4bit`).
READ_QUANT_METHODS = ("mxfp4", "gguf", "bitsandbytes")
# What transformers saves beside a bitsandbytes 4-bit weight W: its pieces, and the JSON of its quant state.
BNB_PIECES = {"absmax": ".absmax", "nested_absmax": ".nested_absmax"}
BNB_CONSTANTS = (".quant_map", ".nested_quant_map")  # the codes, bitsandbytes' own tables
BNB_STATE = ".quant_state.bitsandbytes__"
# What transformers saves beside a bitsandbytes 8-bit module's int8 weight: each row's absmax, and the layout's code.
BNB_8BIT_SCALES, BNB_8BIT_FORMAT = ".SCB", ".weight_format"


def saved_dtype(directory: str | Path) -> str:
    """A checkpoint's weights' dtype as saved, the widest where they differ ('bf16'): what a frozen base's import
    reads each tensor in (a weight saved 4-bit or 8-bit, in the 16-bit dtype it was quantized from). A folder of
    config.json alone (planned before its weights are there): fp32, the widest read."""
    root = Path(directory)
    files = [root / name for name in _WEIGHT_FILES if (root / name).is_file()]
    if not files:
        return "fp32"
    # A run plans its step several times; the folder is opened once while its weight files stay as they are.
    return _saved_dtype(root.resolve(), tuple(f.stat().st_mtime_ns for f in files))


@functools.cache
def _saved_dtype(root: Path, _stamps: tuple[int, ...]) -> str:
    with HFCheckpoint.open(root) as checkpoint:
        return dtype_name(max({checkpoint.dtype(key) for key in checkpoint.keys()}, key=lambda d: d.itemsize))


def check_quantization(path: Path, lora: LoraConfig | None = None) -> None:
    """A folder whose weights another library quantized (GPTQ, AWQ, fp8) is refused in one line naming its
    quant_method. One bitsandbytes saved 4-bit or 8-bit trains as saved: LoRA on its quantized base with its
    settings, which `lora` (the run's) must have."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # ModelConfig.from_hf says what is wrong with the file
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    quant = quant if isinstance(quant, dict) else {}
    method = quant.get("quant_method")
    four_bit = method == "bitsandbytes" and quant.get("load_in_4bit", quant.get("_load_in_4bit"))
    eight_bit = method == "bitsandbytes" and quant.get("load_in_8bit", quant.get("_load_in_8bit"))
    if method == "bitsandbytes" and not four_bit and not eight_bit:
        method = "bitsandbytes (neither 4-bit nor 8-bit)"
    if method is not None and method not in READ_QUANT_METHODS:
        raise CheckpointError(f"{path}: its weights are quantized by {method!r} (quantization_config), which is not "
                              "read; pass the 16-bit checkpoint it was made from (--load-in-4bit quantizes one "
                              "as bitsandbytes does)")
    if four_bit and lora is not None:
        saved = (quant.get("bnb_4bit_quant_type", "fp4"), bool(quant.get("bnb_4bit_use_double_quant", False)))
        if not lora.load_in_4bit or (lora.bnb_4bit_quant_type, lora.bnb_4bit_use_double_quant) != saved:
            flags = f"--lora-rank R --load-in-4bit --bnb-4bit-quant-type {saved[0]}" + \
                (" --bnb-4bit-use-double-quant" if saved[1] else "")
            raise CheckpointError(f"{path.parent} holds bitsandbytes 4-bit weights ({saved[0]}"
                                  f"{', double quant' if saved[1] else ''}): train it with {flags}")
    if eight_bit and lora is not None and not lora.load_in_8bit:
        raise CheckpointError(f"{path.parent} holds bitsandbytes 8-bit weights: train it with --lora-rank R "
                              "--load-in-8bit")


def _read_config(root: Path) -> ModelConfig:
    path = root / "config.json"
    check_quantization(path)
    try:
        return ModelConfig.from_hf(path)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except (TypeError, ValueError, OSError) as exc:  # values of the wrong JSON type, unreadable file
        raise CheckpointError(f"{path} is not a valid model config ({_brief(exc)}); fix or replace it") from None


def _read_index(root: Path, name: str) -> dict[str, str]:
    """The index's weight_map, each shard checked to be a file inside `root`."""
    path = root / name
    try:
        raw = json.loads(path.read_text(encoding="utf-8-sig"))  # a byte-order mark (Notepad) is no error
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({_brief(exc)}); re-save the checkpoint") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path} has no 'weight_map' object of tensor name -> shard file; re-save the checkpoint")
    for key, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{path}: the shard of {key!r} must be a file name, got {shard!r}")
        _inside(root, shard, path)
    return weight_map


def _inside(root: Path, shard: str, index: Path) -> Path:
    """Refuse shard names that leave the checkpoint folder: an index must not make us read arbitrary files."""
    relative = Path(shard)
    if not shard or "\x00" in shard or relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(f"{index} names shard {shard!r}, which is not a file inside {root}; "
                              "shards must be plain file names in the checkpoint folder")
    try:
        resolved = (root / relative).resolve()
        escapes = not resolved.is_relative_to(root.resolve())
        exists = resolved.is_file()
    except (OSError, RuntimeError) as exc:  # name too long, symlink loop
        raise CheckpointError(f"{index} names shard {shard!r}, which cannot be opened ({_brief(exc)})") from None
    if escapes:
        raise CheckpointError(f"{index} names shard {shard!r}, which links outside {root}; "
                              "copy the shard into the checkpoint folder")
    if not exists:
        raise CheckpointError(f"shard {shard!r} listed in {index} is missing from {root}; "
                              "download or copy it next to the index")
    return resolved


class _Safetensors:
    """A safetensors shard whose tensors are read by positional reads into tensors the caller owns: no file
    mapping, whose pages read would count in the process's resident set until the checkpoint closes (the whole
    checkpoint by the end of an import), only the page cache. Its header is checked by safetensors (`handle`),
    which reads the dtypes torch names otherwise (float8's) itself."""

    def __init__(self, path: Path, handle: Any) -> None:
        self.path, self.handle = path, handle
        self.file = open(path, "rb", buffering=0)  # (closed with the checkpoint, or when it is let go)
        size = struct.unpack("<Q", self.file.read(8))[0]
        header = json.loads(self.file.read(size))
        self.starts = {key: 8 + size + value["data_offsets"][0] for key, value in header.items()
                       if key != "__metadata__"}

    def read(self, key: str, entry: _Entry) -> torch.Tensor:
        stored = getattr(torch, entry.dtype, None)
        if not isinstance(stored, torch.dtype):
            return self.handle.get_tensor(key).clone()  # (a view of safetensors' mapping otherwise)
        out = torch.empty(entry.shape, dtype=stored)
        pread_into(self.file.fileno(), out, self.starts[key], self.path)
        return out

    def close(self) -> None:
        self.file.close()


def _open_shard(root: Path, name: str) -> tuple[Any, dict[str, _Entry]]:
    path = root / name
    if name.endswith(".safetensors"):
        try:
            handle = safe_open(str(path), framework="pt")
            found = {}
            for key in handle.offset_keys():
                view = handle.get_slice(key)
                code = view.get_dtype()
                dtype = _SAFETENSORS_DTYPES.get(code)
                found[key] = _Entry(name, tuple(view.get_shape()), _dtype_name(dtype) if dtype else code)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file ({_brief(exc)}); "
                                  "download or export it again") from None
        return _Safetensors(path, handle), found
    try:
        # weights_only: a pickle can run arbitrary code; torch's restricted
        # unpickler only rebuilds tensors and plain containers. mmap: the
        # file's pages are read on demand, so opening costs no memory.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except _PICKLE_ERRORS as exc:
        raise CheckpointError(f"{path} is not a weights-only PyTorch checkpoint ({_brief(exc)}); "
                              "convert it to safetensors") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{path} must hold a flat dict of tensor name -> tensor; "
                              "save the model's state_dict() itself")
    return state, {k: _Entry(name, tuple(v.shape), _dtype_name(v.dtype)) for k, v in state.items()}


# Fields of a source config.json an export does not carry: its weights are dequantized, in the export's dtype.
NOT_CARRIED = ("quantization_config", "torch_dtype", "dtype")


class HFExporter:
    """Write a checkpoint that transformers' `AutoModelForCausalLM.from_pretrained` loads, tensor by tensor.

    with HFExporter(out_dir, cfg, dtype=torch.bfloat16) as export:
        for key, tensor in tensors:
            export.add(key, tensor)

    Everything goes to a hidden sibling folder first (`staging_dir`, where
    other files such as a tokenizer may be saved too) that replaces `directory`
    only once every tensor is written: a failed export leaves nothing behind.
    One shard (`max_shard_bytes`, or one tensor if larger) is in memory at a time. `token_ids` (bos_token_id,
    eos_token_id: the tokenizer's) replace config.json's defaults. `carried`: the source checkpoint's config.json,
    whose fields the model's config does not hold (architectures, auto_map, the user's own) the export keeps.
    """

    def __init__(self, directory: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 max_shard_bytes: int = 2 * 2**30, overwrite: bool = False,
                 token_ids: dict[str, int] | None = None, carried: Mapping[str, Any] | None = None) -> None:
        if dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(f"cannot export as {dtype}; choose float32, bfloat16 or float16")
        if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
            raise CheckpointError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
        self.cfg, self.dtype, self.max_shard_bytes = cfg, dtype, max_shard_bytes
        self.token_ids = dict(token_ids or {})
        self.carried = {k: v for k, v in (carried or {}).items() if k not in NOT_CARRIED}
        self.folder = StagedFolder(directory, overwrite)
        self.directory, self.staging_dir = self.folder.directory, self.folder.path
        self._expected = expected_tensors(cfg)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shard_keys: list[list[str]] = []
        self._added: set[str] = set()  # the model's names (a tensor saved in parts is one)
        self._total_bytes = 0

    def __enter__(self) -> HFExporter:
        self.folder.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is None:
                self._finish()
        except OSError as exc:
            raise CheckpointError(f"writing {self.directory} failed ({exc.strerror}: {exc.filename}); "
                                  "free disk space or choose another folder") from None
        finally:
            self.folder.__exit__()

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Queue one tensor under its HF name; a full shard is written out before the next one starts."""
        if not self.staging_dir.is_dir():
            raise RuntimeError("HFExporter.add() must be called inside its `with` block")
        expected = self._expected.get(key)
        if expected is None:
            raise CheckpointError(f"{key!r} is not a tensor of a model with this config; "
                                  f"valid names look like {next(iter(self._expected))!r}")
        if key in self._added:
            raise CheckpointError(f"{key} was added twice; add each tensor once")
        if tuple(tensor.shape) != tuple(expected.shape):
            raise CheckpointError(f"{key} has shape {tuple(tensor.shape)}; the config needs {tuple(expected.shape)}")
        if not tensor.is_floating_point():
            raise CheckpointError(f"{key} is {tensor.dtype}; weights must be floating point")
        self._added.add(key)
        parts = self.cfg.adapter().saved_parts(key)
        if parts is None:
            self._queue(self.cfg.adapter().saved_name(key), tensor)
            return
        for row, names in zip(tensor, parts, strict=True):  # saved as transformers saves it: each row's parts apart
            for name, piece in zip(names, row.chunk(len(names)), strict=True):
                self._queue(name, piece)

    def _queue(self, key: str, tensor: torch.Tensor) -> None:
        # copy=True: the caller's tensor may be a view into a larger buffer it
        # reuses (the host store's slabs); safetensors needs owned, contiguous data.
        owned = tensor.detach().to(device="cpu", dtype=self.dtype, copy=True).contiguous()
        size = owned.numel() * owned.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[key] = owned
        self._pending_bytes += size

    def _flush(self) -> None:
        path = self.staging_dir / f"shard-{len(self._shard_keys)}.tmp"
        try:
            save_file(self._pending, str(path), metadata={"format": "pt"})
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot write {path} ({_brief(exc)}); free disk space or choose another "
                                  "folder") from None
        self._shard_keys.append(list(self._pending))
        self._total_bytes += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def _finish(self) -> None:
        if self._pending:
            self._flush()
        missing = sorted(set(self._expected) - self._added)
        if missing:
            raise CheckpointError(f"export to {self.directory} is incomplete: {len(missing)} tensors were never "
                                  f"added, e.g. {missing[:3]}; add every tensor of the model")
        count = len(self._shard_keys)
        # Hugging Face's own naming: one file needs no index.
        names = (["model.safetensors"] if count == 1
                 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        for i, name in enumerate(names):
            os.replace(self.staging_dir / f"shard-{i}.tmp", self.staging_dir / name)
        if count > 1:
            weight_map = {k: name for name, keys in zip(names, self._shard_keys, strict=True) for k in sorted(keys)}
            _write_json(self.staging_dir / "model.safetensors.index.json",
                        {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map})
        _write_json(self.staging_dir / "config.json",
                    {**self.carried, **self.cfg.adapter().to_hf(), **self.token_ids, "dtype": _dtype_name(self.dtype)})
        self.folder.commit()


def _brief(exc: BaseException) -> str:
    """A library's error as one line: torch and safetensors messages can span a page."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


