"""The RAM back end (a `streamer.store.interface.SlabBackend`): one flat host tensor (a slab) per unit and kind placed
on a zero-copy tier, page-locked for a CUDA device as `pin_memory` says: copied into pinned memory ("all"), or
registered where it lies ("register")."""
from __future__ import annotations

from typing import Iterable

import torch

from memory_model.units import format_size
from streamer.errors import StoreError
from streamer.store.spec import StoreSpec

# cudaHostRegisterDefault: the pages are locked for the current device's context, as torch's pinned allocator does.
HOST_REGISTER_DEFAULT = 0


class RamSlabs:
    """Slabs of the kinds `spec.ram_kinds()` names. fp32 compute weights are the master weights themselves,
    so asking for "compute" then gives the master slab. `pin`: a `PIN_MODES` value; "all" copies each slab into
    memory torch's pinned allocator gives, "register" page-locks each slab where it lies (`close` unlocks them)."""

    def __init__(self, spec: StoreSpec, numels: dict[str, int], pin: str) -> None:
        self._spec, self._compute_is_master = spec, spec.compute_is_master
        self._slabs: dict[tuple[str, str], torch.Tensor] = {}
        for unit, numel in numels.items():
            for kind in spec.ram_kinds():
                buf = torch.zeros(spec.kind_range(kind, 0, numel)[1], dtype=spec.kind_dtype(kind))
                self._slabs[unit, kind] = buf.pin_memory() if pin == "all" else buf
        self._registered = register(self._slabs.values()) if pin == "register" else []

    def close(self) -> None:
        """Unlock the slabs `register` locked: their memory is torch's again, pageable. Copies still in flight
        from them finish first."""
        if self._registered and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        unregister(self._registered)
        self._registered = []

    def get(self, unit: str, kind: str) -> torch.Tensor | None:
        """The slab itself, or None where this kind is not in RAM."""
        if kind == "compute" and self._compute_is_master:
            kind = "master"
        return self._slabs.get((unit, kind))

    def holds(self, unit: str, kind: str) -> bool:
        """Whether `kind` has a slab of its own (fp32 compute weights have none: they are the masters)."""
        return (unit, kind) in self._slabs

    def write(self, unit: str, kind: str, start: int, values: torch.Tensor) -> None:
        """Copy `values`, in their stored form (`quant.stored`), into elements [start, ...) of the slab, if it
        has one; a view of the slab itself is already in place (an update on the host writes its new compute
        weights straight into it)."""
        slab = self._slabs.get((unit, kind))
        if slab is None:
            return
        first = self._spec.kind_range(kind, start, 0)[0]
        target = slab[first:first + values.numel()]
        if target.data_ptr() != values.data_ptr():
            target.copy_(values)


def register(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Page-lock each tensor's memory where it lies (cudaHostRegister), so that a copy to the device reads it by
    DMA with no staging copy; returns the pointers registered, for `unregister`. Unlike torch's pinned allocator
    it rounds nothing up: the slabs stay their own size. A refusal (the locked-memory limit, say) unlocks what was
    locked and says so in one line."""
    cudart = torch.cuda.cudart()
    done: list[int] = []
    try:
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                continue
            status = cudart.cudaHostRegister(t.data_ptr(), nbytes, HOST_REGISTER_DEFAULT)
            if int(status) != 0:
                raise StoreError(f"cudaHostRegister refused to lock a {format_size(nbytes)} slab ({status}) after "
                                 f"{len(done)} others: the host's locked-memory limit (ulimit -l) or its RAM; "
                                 "use --pin-memory staging")
            done.append(t.data_ptr())
    except BaseException:
        unregister(done)
        raise
    return done


def unregister(pointers: Iterable[int]) -> None:
    cudart = None
    for ptr in pointers:
        cudart = cudart or torch.cuda.cudart()
        cudart.cudaHostUnregister(ptr)
