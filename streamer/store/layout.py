"""How a unit's tensors sit in one flat slab (where each slab kind lives: memory_model.step.Placement)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.overrides import TorchFunctionMode

from layers import ModelConfig, build_unit, weight_decayed
from layers.packed4 import padded, quantized_numels
from layers.quant4 import FrozenQuant, matrix, piece_key, quantized_keys
from streamer.errors import StoreError

# The torch dtype of each name memory_model.DTYPE_BYTES sizes (the same names, the same byte sizes).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise StoreError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class TensorSlot:
    key: str  # the unit module's own key, e.g. "attn.q_proj.weight"
    hf_key: str  # e.g. "transformer.h.3.attn.q_proj.weight"
    shape: tuple[int, ...]
    offset: int  # in elements, inside the unit's flat slab

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def decay(self) -> bool:
        return weight_decayed(self.shape)


class _ShapesOnly(TorchFunctionMode):
    """Skips torch.nn.init's fills while a layout reads a unit's shapes: on meta tensors the first normal_
    imports torch._dynamo (about 1 s), which the resource check before a run should not wait for."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


@dataclass(frozen=True)
class Piece:
    """A tensor of a 4-bit unit's byte slab: a 16-bit tensor, or a piece of a quantized weight."""

    key: str  # the module's key: 'attn.q_proj.weight' (its packed codes), 'attn.q_proj.absmax', 'ln_1.weight'
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in bytes

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


@dataclass(frozen=True)
class Placed:
    """One tensor's values in a slab of bytes: from byte `offset`, flat, in `dtype` as stored (they may be given
    in another, cast as their chunks are written)."""

    offset: int
    values: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def of(cls, piece: Piece, values: torch.Tensor, lent: int = 0) -> "Placed":
        """`values` as `piece` of a packed unit whose pieces' offsets count `lent` bytes before its own slab."""
        if values.numel() != math.prod(piece.shape):
            raise StoreError(f"{piece.key} has {values.numel()} values where its unit holds {math.prod(piece.shape)}")
        return cls(piece.offset - lent, values.reshape(-1), piece.dtype)

    @property
    def end(self) -> int:
        return self.offset + self.values.numel() * self.dtype.itemsize


def slab_chunk(placed: Sequence[Placed], start: int, count: int) -> torch.Tensor:
    """Bytes [start, start + count) of a slab made of `placed` (zero where none lies): only these bytes' values
    cast to their stored dtype, so no unit is ever held whole in a wider one; a view of the values themselves
    where one tensor, already in its stored dtype, holds them all."""
    end = start + count
    for p in placed:
        if p.offset <= start and end <= p.end and p.values.dtype == p.dtype:
            return p.values.view(torch.uint8)[start - p.offset:end - p.offset]
    out = torch.zeros(count, dtype=torch.uint8)
    for p in placed:
        low, high, size = max(start, p.offset), min(end, p.end), p.dtype.itemsize
        if low >= high:
            continue
        first, skip = divmod(low - p.offset, size)  # the elements these bytes lie in
        values = p.values[first:-(-(high - p.offset) // size)]
        if skip == 0 and (low - start) % size == 0 and (high - low) % size == 0:  # whole elements: cast in place
            out[low - start:high - start].view(p.dtype).copy_(values)
        else:
            out[low - start:high - start] = values.to(p.dtype).view(torch.uint8)[skip:skip + high - low]
    return out


@dataclass(frozen=True)
class Packed4:
    """A unit of a quantized store (layers/packed4.py, a GGUF base's layers/packed_gguf.py): its slab is bytes,
    `pieces` in slab order (a tied head's borrowed embedding first), and `quantized` the slots of the weights held
    quantized, each as `quant`'s pieces."""

    quant: FrozenQuant
    pieces: tuple[Piece, ...]
    quantized: tuple[str, ...]  # slot keys
    borrowed_bytes: tuple[int, ...]  # bytes of each borrowed owner's slab, in device order

    @classmethod
    def of(cls, cfg: ModelConfig, unit: str, slots: Sequence[TensorSlot], borrowed: Sequence[TensorSlot],
           module: torch.nn.Module, quant: FrozenQuant) -> "Packed4":
        held = set(quantized_keys(module, cfg.lora().projections))
        quantized = [s for s in slots if s.key in held] if unit.startswith("block.") else []
        if sorted(s.numel for s in quantized) != sorted(quantized_numels(cfg, unit)):
            raise StoreError(f"--load-in-4bit does not hold {cfg.model_type}'s blocks yet (their Linear modules are "
                             "not its projections); drop --load-in-4bit")
        pieces, offset, lent = [], 0, []
        for slot in borrowed:  # another unit's whole slab, 16-bit (only an embedding is borrowed)
            pieces.append(Piece(slot.key, quant.dtype, slot.shape, offset))
            lent.append(padded(slot.numel * quant.dtype.itemsize))
            offset += lent[-1]
        start = offset
        for slot in slots:
            if slot not in quantized:
                pieces.append(Piece(slot.key, quant.dtype, slot.shape, offset))
                offset += slot.numel * quant.dtype.itemsize
        offset = start + padded(offset - start)
        for slot in quantized:
            for name, dtype, shape in quant.weight_pieces(matrix(slot.shape), slot.hf_key):
                pieces.append(Piece(piece_key(slot.key, name), dtype, shape, offset))
                offset += padded(dtype.itemsize * math.prod(shape))
        return cls(quant, tuple(pieces), tuple(s.key for s in quantized), tuple(lent))

    @property
    def nbytes(self) -> int:
        """Bytes of the unit's own slab (`layers.packed4.unit_bytes`)."""
        last = self.pieces[-1]
        return padded(last.offset + last.nbytes) - sum(self.borrowed_bytes)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {p.key: flat[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.pieces}

    def placed(self, tensors: dict[str, Any]) -> list[Placed]:
        """The unit's own slab as its pieces' values where they lie, from its tensors by slot key (taken out of
        `tensors`): the quantized ones by `quant`'s quantize, one weight at a time (its 16-bit tensor let go as
        its pieces are made), or given as their pieces already (a folder transformers saved 4-bit); the others as
        given, cast to `quant.dtype` a chunk at a time as the slab is written (`slab_chunk`)."""
        lent, by_key = sum(self.borrowed_bytes), {p.key: p for p in self.pieces}  # (offsets count what is lent)
        out = []
        for key in self.quantized:
            given = tensors.pop(key)
            for name, value in (given if isinstance(given, dict) else self.quant.quantize(given)).items():
                out.append(Placed.of(by_key[piece_key(key, name)], value, lent))
            del given
        for key in list(tensors):
            out.append(Placed.of(by_key[key], tensors.pop(key), lent))  # (only quantized weights come as pieces)
        return out

    def unpack(self, slab: torch.Tensor, slots: Sequence[TensorSlot]) -> torch.Tensor:
        """The unit's own tensors in slot order, flat in fp32, the quantized ones dequantized."""
        views = self.views(torch.cat([torch.zeros(sum(self.borrowed_bytes), dtype=torch.uint8), slab]))
        out = torch.empty(sum(s.numel for s in slots), dtype=torch.float32)
        for slot in slots:
            if slot.key in self.quantized:
                pieces = {name: views[piece_key(slot.key, name)] for name, _, _ in
                          self.quant.weight_pieces(matrix(slot.shape), slot.hf_key)}
                value = self.quant.dequantize(pieces, matrix(slot.shape))
            else:
                value = views[slot.key]
            out[slot.offset:slot.offset + slot.numel].copy_(value.reshape(-1))
        return out


@dataclass(frozen=True)
class UnitLayout:
    name: str
    slots: tuple[TensorSlot, ...]  # the unit's own tensors in its stored slab, decayed first
    # What the unit's module uses that another unit's state holds (a tied lm_head: the embedding's weight), each
    # that unit's whole weights: (slot, owner). On the device they come first in the unit's one flat buffer, and
    # their gradient is folded into the owner's accumulator (`split_device`).
    borrowed: tuple[tuple[TensorSlot, str], ...] = ()
    # A 4-bit store's unit: its slab is bytes (its `numel`), and the slots keep the 16-bit tensors' places for
    # their keys and for `Packed4.unpack`.
    packed: Packed4 | None = None

    @classmethod
    def of(cls, cfg: ModelConfig, unit: str, quant: FrozenQuant | None = None) -> "UnitLayout":
        with _ShapesOnly():
            module = build_unit(cfg, unit)
        params = list(module.named_parameters())
        lent = cfg.params().borrowed(unit)
        borrowed, offset = [], 0
        for key, param in params:
            if key in lent:
                owner = lent[key][0]
                borrowed.append((TensorSlot(key, cfg.adapter().key(unit, key), tuple(param.shape), offset), owner))
                offset += param.numel()
        own = [p for p in params if p[0] not in lent]
        ordered = [p for p in own if p[1].dim() >= 2] + [p for p in own if p[1].dim() < 2]
        slots, offset = [], 0
        for key, param in ordered:
            slots.append(TensorSlot(key, cfg.adapter().key(unit, key), tuple(param.shape), offset))
            offset += param.numel()
        packed = None if quant is None else Packed4.of(cfg, unit, slots, [s for s, _ in borrowed], module, quant)
        return cls(unit, tuple(slots), tuple(borrowed), packed)

    @property
    def numel(self) -> int:
        """The elements the unit's own state holds (its slab; what its update walks); a 4-bit unit's bytes."""
        return self.packed.nbytes if self.packed is not None else sum(s.numel for s in self.slots)

    @property
    def decay_numel(self) -> int:
        return sum(s.numel for s in self.slots if s.decay)

    @property
    def keys(self) -> list[str]:
        """The unit's parameter keys in the order of its device weights (`views`)."""
        return [s.key for s, _ in self.borrowed] + [s.key for s in self.slots]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit's parameters as views of its device weights `flat` (the borrowed ones first); a 4-bit unit's
        pieces (`Packed4`)."""
        if self.packed is not None:
            return self.packed.views(flat)
        slots = [s for s, _ in self.borrowed] + list(self.slots)
        pieces = flat.split_with_sizes([s.numel for s in slots])
        return {s.key: piece.view(s.shape) for s, piece in zip(slots, pieces, strict=True)}

    @property
    def device_parts(self) -> list[tuple[str, int]]:
        """The unit's device weights by the state that holds them, in device order: (unit, elements) of each
        owner it borrows from, then its own (`UnitParams.device_parts`); a 4-bit unit's in bytes."""
        if self.packed is not None:
            return [(owner, n) for (_, owner), n in zip(self.borrowed, self.packed.borrowed_bytes, strict=True)] + \
                [(self.name, self.numel)]
        return [(owner, s.numel) for s, owner in self.borrowed] + [(self.name, self.numel)]

    def split_device(self, pieces: Sequence[torch.Tensor]) -> list[tuple[str, list[torch.Tensor]]]:
        """A gradient laid end to end in the device order (one tensor per parameter, or flat) as (unit, its
        pieces): each owner's part of what the unit borrows, then the unit's own."""
        out: list[tuple[str, list[torch.Tensor]]] = []
        queue = list(pieces)
        for unit, size in self.device_parts:
            taken: list[torch.Tensor] = []
            while size:
                piece = queue.pop(0)
                if piece.numel() > size:  # a flat gradient: cut it at the boundary
                    piece, rest = piece[:size], piece[size:]
                    queue.insert(0, rest)
                taken.append(piece)
                size -= piece.numel()
            out.append((unit, taken))
        return out


@dataclass(frozen=True)
class ExpertGroups:
    """A block whose experts load in `count` groups (memory_model.step.StepConfig.expert_group_size), as
    pieces of its slab: its weights load holds the rest (`rest`, laid end to end, read from `rest_ranges`), and
    each group holds its rows of every expert tensor (`group`, read from `ranges(g)`)."""

    layout: UnitLayout
    experts: tuple[TensorSlot, ...]  # the expert tensors, in slab order
    count: int
    rest: UnitLayout
    rest_ranges: tuple[tuple[int, int], ...]  # (start, count) in the slab
    group: UnitLayout

    @classmethod
    def of(cls, layout: UnitLayout, keys: Sequence[str], count: int) -> "ExpertGroups":
        experts = tuple(s for s in layout.slots if s.key in keys)
        others: list[TensorSlot] = []
        ranges: list[tuple[int, int]] = []
        offset = 0
        for slot in layout.slots:
            if slot.key in keys:
                continue
            others.append(TensorSlot(slot.key, slot.hf_key, slot.shape, offset))
            offset += slot.numel
            if ranges and ranges[-1][0] + ranges[-1][1] == slot.offset:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + slot.numel)
            else:
                ranges.append((slot.offset, slot.numel))
        pieces, offset = [], 0
        for slot in experts:
            shape = (slot.shape[0] // count, *slot.shape[1:])
            pieces.append(TensorSlot(slot.key, slot.hf_key, shape, offset))
            offset += slot.numel // count
        return cls(layout, experts, count, UnitLayout(layout.name, tuple(others)), tuple(ranges),
                   UnitLayout(layout.name, tuple(pieces)))

    def ranges(self, group: int) -> tuple[tuple[int, int], ...]:
        """(start, count) in the slab of each expert tensor's rows in `group`."""
        return tuple((s.offset + group * (s.numel // self.count), s.numel // self.count) for s in self.experts)

    def whole(self, rest: Sequence[torch.Tensor], groups: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """The unit's tensors in slab order from its rest's (in `rest`'s order) and each group's (in `group`'s)."""
        own = dict(zip(self.rest.keys, rest, strict=True))
        experts = {s.key: [pieces[i] for pieces in groups] for i, s in enumerate(self.experts)}
        return [piece for s in self.layout.slots for piece in (experts[s.key] if s.key in experts else [own[s.key]])]


# Elements of a gradient piece of another dtype (bf16 into an fp32 accumulator) added at once: the temporary fp32 copy
# torch makes of the addend is this size, not the piece's (a tied embedding's own gradient, added to the head's part,
# widened whole was an unpriced GiB of host memory on Llama-3.2-1B).
WIDENED_BLOCK = 2**20


def fold_into(flat: torch.Tensor, pieces: Sequence[torch.Tensor], first: bool,
              non_blocking: bool = False, start: int | None = None) -> torch.Tensor:
    """Copy (`first`) or add `pieces`, which laid end to end make one flat tensor, into `flat`; returns `flat`.
    `non_blocking`: the copies are device-to-pinned-host transfers the caller synchronizes. `start`: `flat` holds
    elements [start, start + flat.numel()) of that tensor (a block of a unit folded by chunk), else all of it.

    A unit's gradient arrives as one tensor per parameter: folding each into its place skips the cat that
    would gather them into one flat tensor first (one more copy of the unit's gradient, into fresh memory).
    """
    block, start = start is not None, start or 0
    end, offset = start + flat.numel(), 0
    for piece in pieces:
        low, high = max(start, offset), min(end, offset + piece.numel())
        if low < high:
            source = piece if high - low == piece.numel() else piece.reshape(-1)[low - offset:high - offset]
            target = flat[low - start:high - start].view(source.shape)
            if first:
                target.copy_(source, non_blocking=non_blocking)
            elif source.dtype == flat.dtype:
                target.add_(source)
            else:  # torch widens an addend of another dtype whole before adding: a block at a time bounds that copy
                whole, into = source.reshape(-1), target.view(-1)
                for first_block in range(0, whole.numel(), WIDENED_BLOCK):
                    into[first_block:first_block + WIDENED_BLOCK].add_(whole[first_block:first_block + WIDENED_BLOCK])
        offset += piece.numel()
    if offset < end or (not block and offset != end):
        raise ValueError(f"gradient pieces hold {offset} elements, the flat tensor {flat.numel()} from {start}")
    return flat


def squared_norm(t: torch.Tensor) -> float:
    """A gradient's squared L2 norm, in fp32 as torch's clip_grad_norm_ computes per-tensor norms (a float64 copy
    costs 25x more)."""
    return float(torch.linalg.vector_norm(t)) ** 2


def expert_groups(cfg: ModelConfig, size: int, layouts: dict[str, UnitLayout]) -> dict[str, ExpertGroups]:
    """The blocks whose experts load `size` at a time (memory_model.step.StepConfig.expert_group_size, checked by
    memory_model.expert_groups.expert_group), each as `ExpertGroups`: none where blocks load whole."""
    experts = cfg.params().experts()
    if cfg.sparse_mlp is None or not 0 < size < experts:
        return {}
    return {u: ExpertGroups.of(layout, cfg.sparse_mlp.keys, experts // size) for u, layout in layouts.items()
            if u.startswith("block.")}


def model_layouts(cfg: ModelConfig, quant: FrozenQuant | None = None) -> tuple[UnitLayout, ...]:
    """Every unit's layout; `quant`: in a 4-bit store (`StoreSpec.quant4`)."""
    return tuple(UnitLayout.of(cfg, unit, quant) for unit in cfg.unit_names())
