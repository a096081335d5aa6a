"""How streamed weights enter autograd without staying on the device, and how activations are charged.

A unit's parameters are views of one flat device buffer. `StreamedWeights` puts them into the graph
without saving them; its backward hands the parameters' gradients to a sink (the offload). While a unit's
forward runs, `SavedTensorRecorder` sees every tensor autograd saves: one that lives in the unit's weight
buffer (or in a group of a block's experts, `group_loaded`) is packed as a handle and unpacked, in backward,
from the buffer streamed in again; any other is an activation, charged to the ledger once per storage until the
unit's backward is done.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch

from memory_model import Ledger
from streamer.store.layout import UnitLayout


class Residency(enum.Enum):
    NOT_AVAILABLE = "not_available"
    INFLIGHT = "inflight"
    AVAILABLE = "available"


@dataclass
class UnitState:
    """One unit's device residency, owned by the runtime (never attributes patched onto tensors)."""

    name: str
    residency: Residency = Residency.NOT_AVAILABLE
    buffer: torch.Tensor | None = None

    def weights(self) -> torch.Tensor:
        if self.residency is not Residency.AVAILABLE or self.buffer is None:
            raise RuntimeError(f"unit {self.name}'s weights are not on the device ({self.residency.value})")
        return self.buffer


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage. `data_ptr()` is 0 for every meta tensor, so use the StorageImpl."""
    return t.untyped_storage()._cdata


class StreamedWeights(torch.autograd.Function):
    """flat weights -> the unit's parameters (views of it, in layout order) as graph nodes that save nothing.

    Backward hands `sink` the parameters' gradients as autograd made them, one per parameter: the host
    folds each into its place, so they are never gathered into one flat tensor on the device.
    """

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, flat: torch.Tensor, layout: UnitLayout,
                sink: Callable[[tuple[torch.Tensor, ...]], None]) -> tuple[torch.Tensor, ...]:
        ctx.sink = sink
        return tuple(layout.views(flat.detach()).values())

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.sink(grads)
        return None, None, None, None


@dataclass(frozen=True)
class WeightHandle:
    state: UnitState
    size: torch.Size
    stride: tuple[int, ...]
    offset: int | torch.SymInt  # in elements of `dtype`
    # The saved tensor's dtype, where the buffer holds other ones (a 4-bit unit's byte slab holds fp32 and 16-bit
    # pieces): the buffer is viewed as it before the tensor is taken from it.
    dtype: torch.dtype
    # A group of a block's experts, released after its forward: loads it again for the backward that unpacks it.
    reload: Callable[[], object] | None = None


class SavedTensorRecorder:
    """Packs streamed weights as handles and charges every other saved storage to the ledger."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._charged: dict[int, int | None] = {}  # storage key -> ledger handle (None: charged elsewhere)
        self._owned: dict[str, list[int]] = {}  # unit -> storage keys it charged
        self.resident: set[int] = set()  # storages charged for the whole run elsewhere (LoRA's adapters)
        # Groups of a block's experts on the device now, by their buffer's storage: (state, its reload).
        self._groups: dict[int, tuple[UnitState, Callable[[], object]]] = {}

    def group_loaded(self, state: UnitState, reload: Callable[[], object]) -> None:
        """A group of a block's experts is on the device: what its forward saves from it is packed as handles,
        which its backward unpacks after `reload`."""
        self._groups[storage_key(state.weights())] = (state, reload)

    def group_released(self, state: UnitState) -> None:
        self._groups.pop(storage_key(state.weights()))

    def forget_groups(self) -> None:
        """A step stopped part-way: no group is on the device any more (the loader released them)."""
        self._groups.clear()

    def hooks(self, state: UnitState) -> torch.autograd.graph.saved_tensors_hooks:
        weight_key = storage_key(state.weights())
        owned = self._owned.setdefault(state.name, [])

        def pack(t: torch.Tensor) -> torch.Tensor | WeightHandle:
            key = storage_key(t)
            if key == weight_key:
                return WeightHandle(state, t.size(), t.stride(), t.storage_offset(), t.dtype)
            if key in self._groups:
                group, reload = self._groups[key]
                return WeightHandle(group, t.size(), t.stride(), t.storage_offset(), t.dtype, reload)
            if key not in self._charged and key not in self.resident:
                nbytes = t.untyped_storage().nbytes()
                self._charged[key] = self.ledger.allocate("activations", state.name, nbytes,
                                                          f"saved {tuple(t.shape)} {t.dtype}")
                owned.append(key)
            return t

        def unpack(packed: torch.Tensor | WeightHandle) -> torch.Tensor:
            if isinstance(packed, WeightHandle):
                if packed.reload is not None and packed.state.residency is not Residency.AVAILABLE:
                    packed.reload()
                return packed.state.weights().view(packed.dtype).as_strided(packed.size, packed.stride, packed.offset)
            return packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def charge(self, unit: str, t: torch.Tensor, what: str) -> None:
        """Charge a tensor the runtime itself keeps (a checkpointed block input)."""
        key = storage_key(t)
        if key not in self._charged:
            self._charged[key] = self.ledger.allocate("activations", unit, t.untyped_storage().nbytes(), what)
            self._owned.setdefault(unit, []).append(key)

    def charged_elsewhere(self, unit: str, t: torch.Tensor) -> None:
        """A tensor the unit's backward saves whose bytes another charge holds until then (an offloaded block
        input back from the host, charged as a loaded resource): not charged again."""
        key = storage_key(t)
        if key not in self._charged:
            self._charged[key] = None
            self._owned.setdefault(unit, []).append(key)

    def release(self, unit: str) -> None:
        """The unit's backward is done: its saved tensors are gone with its graph."""
        for key in self._owned.pop(unit, []):
            handle = self._charged.pop(key)
            if handle is not None:
                self.ledger.free(handle)
