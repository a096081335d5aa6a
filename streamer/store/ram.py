"""The RAM back end: one flat host tensor (a slab) per unit and kind placed in RAM, pinned with pin_memory all."""
from __future__ import annotations

import torch

from streamer.store.spec import StoreSpec


class RamSlabs:
    """Slabs of the kinds `spec.ram_kinds()` names. fp32 compute weights are the master weights themselves,
    so asking for "compute" then gives the master slab."""

    def __init__(self, spec: StoreSpec, numels: dict[str, int], pin: bool) -> None:
        self._spec, self._compute_is_master = spec, spec.compute_is_master
        self._slabs: dict[tuple[str, str], torch.Tensor] = {}
        for unit, numel in numels.items():
            for kind in spec.ram_kinds():
                buf = torch.zeros(spec.kind_range(kind, 0, numel)[1], dtype=spec.kind_dtype(kind))
                self._slabs[unit, kind] = buf.pin_memory() if pin else buf

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
