"""A model's weights into a trainer's store and out of it, one unit at a time: HF's initialisation, HF-keyed
tensors written as a fresh state (Adam moments zero), and a unit's fp32 master read back as HF-keyed tensors."""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch

from layers import CheckpointMismatch, ModelConfig, build_unit, check_state_dict, init_weights
from memory_model.schedule import chunks
from streamer.runtime.distributed import DataParallel
from streamer.store.interface import StoreReader, StoreWriter
from streamer.store.layout import Placed, UnitLayout, slab_chunk


def initial_unit(cfg: ModelConfig, unit: str, index: int, seed: int) -> dict[str, torch.Tensor]:
    """HF's initialisation of the `index`-th unit, seeded per unit so the result does not depend on order."""
    torch.manual_seed(seed * 1_000_003 + index)
    module = build_unit(cfg, unit, device="cpu")
    init_weights(module)
    return dict(module.state_dict())


def hf_tensors(layouts: Iterable[UnitLayout], state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF state dict checked strictly against the units' slots (attention's constant buffers dropped, and a
    tied parameter's second name: its one tensor is the owner's)."""
    layouts = list(layouts)
    expected = {s.hf_key: torch.empty(s.shape, device="meta") for lay in layouts for s in lay.slots}
    given = {k: v for k, v in state_dict.items() if not k.endswith(("attn.bias", "attn.masked_bias"))}
    for tied, owner in _tied_keys(layouts):
        copy = given.pop(tied, None)
        if copy is not None and owner in given and not torch.equal(copy, given[owner]):
            raise CheckpointMismatch(f"{tied} differs from {owner}, but the model ties them "
                                     "(tie_word_embeddings=true); give one tensor")
    check_state_dict(expected, given)
    return given


def _tied_keys(layouts: Iterable[UnitLayout]) -> list[tuple[str, str]]:
    """(HF key of a borrowed tensor, HF key of the owner's tensor it is): a tied lm_head and the embedding."""
    by_unit = {layout.name: layout for layout in layouts}
    pairs = []
    for layout in by_unit.values():
        for slot, owner in layout.borrowed:
            (whole,) = by_unit[owner].slots  # what a unit borrows is another unit's whole weights
            pairs.append((slot.hf_key, whole.hf_key))
    return pairs


def write_fresh_state(store: StoreWriter, layout: UnitLayout, tensors: dict[str, torch.Tensor],
                      compute_dtype: torch.dtype, data_parallel: DataParallel | None) -> None:
    """A unit's weights (by slot key, taken out of `tensors`, in any float dtype) as its master, moments zero, and
    compute copy (of the master as stored: a bf16 master's values, in fp32 compute too), chunk by chunk as
    `write_frozen` writes a frozen base's unit (its compute weights alone)."""
    if store.spec.frozen:
        write_frozen(store, layout, tensors, compute_dtype, data_parallel)
        return
    # Each chunk of the fp32 master cast from the tensors' own slices as it is written (an fp32 tensor's are
    # views of it): the unit is never held whole in fp32 beside them.
    placed = [Placed(slot.offset * 4, tensors.pop(slot.key).reshape(-1), torch.float32) for slot in layout.slots]
    stored, first = _rank_slice(store, layout.numel, data_parallel)
    compute = "compute" in store.spec.stored_kinds()
    # The moments' every chunk: writers copy (or quantize) what they are given, and keep no reference.
    zeros = torch.zeros(min(store.spec.chunk, stored), dtype=torch.float32)
    with store.unit_writer(layout.name, store.step) as writer:
        for start, count in chunks(stored, store.spec.chunk):
            piece = slab_chunk(placed, (first + start) * 4, count * 4).view(torch.float32)
            values = {"master": piece, "exp_avg": zeros[:count], "exp_avg_sq": zeros[:count]}
            if compute:
                values["compute"] = piece.to(store.spec.kind_dtype("master")).to(compute_dtype)
            for kind in store.spec.stored_kinds():
                writer.write(kind, start, values[kind])
            del piece, values  # before the next chunk's: one chunk held at a time


def write_frozen(store: StoreWriter, layout: UnitLayout, tensors: dict[str, torch.Tensor],
                 compute_dtype: torch.dtype, data_parallel: DataParallel | None) -> None:
    """A frozen base's unit (LoRA) from its tensors as given (a checkpoint's in its own dtype; a fresh unit's in
    fp32), chunk by chunk: each chunk cast to the compute dtype as it is written, so the unit is never held whole
    in another dtype. A quantized store's unit: its byte slab, each quantized weight quantized whole first
    (`Packed4.placed`)."""
    if layout.packed is not None:  # (a quantized base is never sharded: TrainerConfig)
        placed, dtype, numel = layout.packed.placed(tensors), torch.uint8, layout.packed.nbytes
    else:
        placed = [Placed(slot.offset * compute_dtype.itemsize, tensors.pop(slot.key).reshape(-1), compute_dtype)
                  for slot in layout.slots]
        dtype, numel = compute_dtype, layout.numel
    stored, first = _rank_slice(store, numel, data_parallel)
    size = dtype.itemsize
    with store.unit_writer(layout.name, store.step) as writer:
        for start, count in chunks(stored, store.spec.chunk):
            writer.write("compute", start, slab_chunk(placed, (first + start) * size, count * size).view(dtype))


def _rank_slice(store: StoreWriter, numel: int, data_parallel: DataParallel | None) -> tuple[int, int]:
    """(elements this store holds of a unit of `numel`, the first of them in the unit): the whole unit, or this
    rank's slice (past the unit's end, zeros)."""
    if store.spec.shards == 1:
        return numel, 0
    assert data_parallel is not None  # a sharded store only across ranks
    stored = data_parallel.stored_numel(numel)
    return stored, data_parallel.rank * stored


def read_master(store: StoreReader, layout: UnitLayout, stored: int,
                data_parallel: DataParallel | None) -> torch.Tensor:
    """A unit's fp32 master (a frozen base's: its compute weights) as one flat host tensor; `stored`: the
    elements this store holds of it. A 4-bit unit's: its 16-bit tensors and its quantized weights dequantized."""
    if layout.packed is not None:  # (a 4-bit base is never sharded: TrainerConfig)
        slab = torch.empty(stored, dtype=torch.uint8)
        store.read_master(layout.name, slab)
        return layout.packed.unpack(slab, layout.slots)
    out = torch.empty(stored, dtype=torch.float32)
    for start, count in chunks(stored, store.spec.chunk):
        store.read_state(layout.name, "master", start, out[start:start + count])
    if store.spec.shards == 1:
        return out
    # Sharded: every rank's slice, so every rank must ask for the same unit at the same time.
    assert data_parallel is not None  # a sharded store only across ranks
    whole = data_parallel.gather_slices(torch.empty(stored * store.spec.shards), out)
    return whole[:layout.numel]


def hf_state_dict(layouts: Iterable[UnitLayout], flat_of: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-keyed copies of every unit's weights, `flat_of(unit)` giving a unit's flat fp32 weights; a tied
    parameter under both its names, one tensor, as in the transformers class's state_dict."""
    out, layouts = {}, list(layouts)
    for layout in layouts:
        flat = flat_of(layout.name)
        for slot in layout.slots:
            out[slot.hf_key] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
    for tied, owner in _tied_keys(layouts):
        out[tied] = out[owner]
    return out
