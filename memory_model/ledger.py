"""Every device byte the runtime creates, charged to a category and a layer, with the peak and its makeup.

The ledger is the simulated device's allocator of record: the budget is enforced here (not by torch), so a
run on a 24 GiB cpu can prove that a schedule fits a 3 GiB device. An I/O thread allocates too, hence the lock.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from memory_model.devices import DEVICE_PRESETS
from memory_model.units import format_size

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "workspace")
# Memory that grows with batch x sequence: what a smaller batch shrinks.
_BATCH_SCALED = ("activations", "workspace")

Listener = Callable[[dict[str, int]], None]


@dataclass(frozen=True)
class WindowStats:
    """What happened between open_window() and close_window(): the window's own peak and its makeup; for the layer
    the window was opened for, the most that layer itself held of each category at once while it was open."""

    peak: int
    peak_breakdown: dict[str, int]
    start_in_use: int
    end_in_use: int
    layer_peaks: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Charge:
    category: str
    layer: str
    nbytes: int
    what: str


class DeviceOutOfMemory(RuntimeError):
    """An allocation that would exceed the device budget; nothing was charged for it."""

    def __init__(self, message: str, *, category: str, layer: str, nbytes: int, what: str, in_use: int,
                 capacity: int, breakdown: dict[str, int], suggestions: tuple[str, ...]) -> None:
        super().__init__(message)
        self.category, self.layer, self.nbytes, self.what = category, layer, nbytes, what
        self.in_use, self.capacity = in_use, capacity
        self.breakdown, self.suggestions = breakdown, suggestions


class Ledger:
    """allocate() -> handle, free(handle); in_use, peak and their breakdowns by category and by layer."""

    def __init__(self, capacity_bytes: int | None, device_name: str = "cpu",
                 hint_context: dict[str, Any] | None = None, block_bytes: Callable[[int], int] | None = None) -> None:
        """`block_bytes`: what an allocation of n bytes takes on the device (on CUDA the caching allocator's
        block, memory_model.allocator.cuda_block_bytes); None: n."""
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int)
                                           or capacity_bytes <= 0):
            raise ValueError(f"capacity_bytes must be a positive integer or None (unlimited), got {capacity_bytes!r}")
        self.capacity = capacity_bytes
        self.device_name = device_name
        self.block_bytes = block_bytes
        self.hint_context: dict[str, Any] = dict(hint_context or {})
        self._lock = threading.Lock()
        self._charges: dict[int, _Charge] = {}
        self._next_handle = 1
        self._by_category = dict.fromkeys(CATEGORIES, 0)
        self._by_layer: dict[str, int] = {}
        self._held: dict[str, dict[str, int]] = {}  # layer -> its bytes by category
        self._in_use = 0
        self._peak = 0
        self._peak_breakdown = dict.fromkeys(CATEGORIES, 0)
        self._peak_layers: dict[str, int] = {}
        # id -> [peak, breakdown at peak, in_use at open, layer, that layer's most of each category]
        self._windows: dict[int, list[Any]] = {}
        self._next_window = 1
        self._listeners: list[Listener] = []

    # --- charging ------------------------------------------------------------------------
    def allocate(self, category: str, layer: str, nbytes: int, what: str = "") -> int:
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; categories are {', '.join(CATEGORIES)}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative integer, got {nbytes!r}")
        if self.block_bytes is not None:
            nbytes = self.block_bytes(nbytes)
        with self._lock:
            if self.capacity is not None and self._in_use + nbytes > self.capacity:
                raise self._out_of_memory(category, layer, nbytes, what)
            handle = self._next_handle
            self._next_handle += 1
            self._charges[handle] = _Charge(category, layer, nbytes, what)
            self._by_category[category] += nbytes
            if nbytes:  # by_layer lists layers that hold bytes
                self._by_layer[layer] = self._by_layer.get(layer, 0) + nbytes
            held = self._held.setdefault(layer, dict.fromkeys(CATEGORIES, 0))
            held[category] += nbytes
            self._in_use += nbytes
            if self._in_use > self._peak:
                self._peak = self._in_use
                self._peak_breakdown = dict(self._by_category)
                self._peak_layers = dict(self._by_layer)
            for window in self._windows.values():
                if self._in_use > window[0]:
                    window[0], window[1] = self._in_use, dict(self._by_category)
                if window[3] == layer:
                    window[4][category] = max(window[4][category], held[category])
            self._notify()
            return handle

    def free(self, handle: int) -> None:
        with self._lock:
            charge = self._charges.pop(handle, None)
            if charge is None:
                raise KeyError(f"ledger handle {handle!r} is not allocated (freed twice, or never allocated?)")
            self._by_category[charge.category] -= charge.nbytes
            self._held[charge.layer][charge.category] -= charge.nbytes
            if charge.nbytes:
                left = self._by_layer[charge.layer] - charge.nbytes
                if left:
                    self._by_layer[charge.layer] = left
                else:
                    del self._by_layer[charge.layer]
            self._in_use -= charge.nbytes
            self._notify()

    # --- reading -------------------------------------------------------------------------
    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def peak_breakdown(self) -> dict[str, int]:
        with self._lock:
            return dict(self._peak_breakdown)

    @property
    def peak_layer_breakdown(self) -> dict[str, int]:
        with self._lock:
            return dict(self._peak_layers)

    def breakdown(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_category)

    def by_layer(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_layer)

    def live(self) -> int:
        """How many allocations are outstanding (a runtime that ends a step with leftovers leaks)."""
        return len(self._charges)

    def reset_peak(self) -> None:
        """Start a new measurement from what is in use now (e.g. at the start of each step)."""
        with self._lock:
            self._peak = self._in_use
            self._peak_breakdown = dict(self._by_category)
            self._peak_layers = dict(self._by_layer)

    # --- windows: peaks of overlapping intervals (trace spans, possibly on two threads) -----
    def open_window(self, layer: str | None = None) -> int:
        """A window from now to close_window; for `layer`, it also keeps the most that layer holds of each category."""
        with self._lock:
            window = self._next_window
            self._next_window += 1
            held = dict(self._held.get(layer, dict.fromkeys(CATEGORIES, 0))) if layer is not None else {}
            self._windows[window] = [self._in_use, dict(self._by_category), self._in_use, layer, held]
            return window

    def close_window(self, window: int) -> WindowStats:
        with self._lock:
            try:
                peak, breakdown, start, _, layer_peaks = self._windows.pop(window)
            except KeyError:
                raise KeyError(f"ledger window {window!r} is not open") from None
            return WindowStats(peak, breakdown, start, self._in_use, layer_peaks)

    # --- listeners: the trace samples memory over time from here ----------------------------
    def add_listener(self, listener: Listener) -> None:
        """Call listener(breakdown) after every change, under the ledger's lock: keep it cheap."""
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def _notify(self) -> None:
        if self._listeners:
            snapshot = dict(self._by_category)
            for listener in self._listeners:
                listener(snapshot)

    # --- the error ---------------------------------------------------------------------------
    def _out_of_memory(self, category: str, layer: str, nbytes: int, what: str) -> DeviceOutOfMemory:
        assert self.capacity is not None
        current = dict(self._by_category)
        needed = dict(current)
        needed[category] += nbytes
        suggestions = suggest_fixes(needed, self.capacity, self.hint_context)
        parts = ", ".join(f"{c} {format_size(current[c])}" for c in CATEGORIES)
        label = f" ({what})" if what else ""
        message = (
            f"device out of memory: allocating {format_size(nbytes)} for {category} of {layer}{label} "
            f"with {format_size(self._in_use)} of {format_size(self.capacity)} in use on {self.device_name} "
            f"({parts}). To fit: {'; or '.join(suggestions)}"
        )
        return DeviceOutOfMemory(message, category=category, layer=layer, nbytes=nbytes, what=what,
                                 in_use=self._in_use, capacity=self.capacity, breakdown=current,
                                 suggestions=tuple(suggestions))


def suggest_fixes(needed: dict[str, int], capacity: int, hints: dict[str, Any]) -> list[str]:
    """Changes that would make `needed` (the breakdown including the failed request) fit `capacity`.

    Estimated from the usage at the failure point, which is a lower bound on the step's real peak;
    hints may carry `planned_peak_bytes` (the planner's peak) to size the budget and device advice.
    Known hints: advise (a callable(needed, capacity, hints) -> suggestions, used instead), activations
    ("resident"|"checkpoint"|"offload"), batch, seq, grad_accum, planned_peak_bytes.
    """
    if callable(hints.get("advise")):  # the caller's planner-sized advice (streamer.advice)
        return list(hints["advise"](needed, capacity, hints))
    total = sum(needed.values())
    required = max(total, int(hints.get("planned_peak_bytes") or 0))
    out: list[str] = []
    scaled = sum(needed[c] for c in _BATCH_SCALED)
    if hints.get("activations") == "resident" and needed["activations"] == max(needed.values()):
        out.append("`--activations checkpoint` (activations dominate; keep only each block's input)")
    elif hints.get("activations") == "checkpoint" and needed["activations"] == max(needed.values()):
        out.append("`--activations offload` (activations dominate; keep the block inputs in host memory)")
    batch, accum = hints.get("batch"), hints.get("grad_accum") or 1
    micro = batch // accum if isinstance(batch, int) and isinstance(accum, int) and accum >= 1 else 0
    if micro > 1 and scaled > 0:  # activations and workspace scale with the micro-batch
        assert isinstance(batch, int) and isinstance(accum, int)  # micro > 1 only then
        fixed = total - scaled
        smaller = math.floor((capacity - fixed) / (scaled / micro)) if capacity > fixed else 0
        smaller = min(smaller, micro - 1)
        if smaller >= 1:
            seq = hints.get("seq")
            shape = f"{smaller} x {seq}" if seq else str(smaller)
            out.append(f"a smaller batch: at most about {shape} per micro-batch (--batch {smaller * accum}, or "
                       f"--grad-accum {math.ceil(batch / smaller)} to keep the batch of {batch})")
    out.append(f"a larger budget: --budget {round_up_size(required)} or more")
    roomy = [name for name, spec in DEVICE_PRESETS.items() if spec.memory_bytes >= required]
    if roomy:
        out.append(f"another device preset with room for {format_size(required)}: {', '.join(roomy)}")
    return out


def round_up_size(nbytes: int) -> str:
    """A budget to type: GiB with one decimal from 1 GiB, whole MiB or KiB below; never below nbytes."""
    if nbytes >= 2**30:
        return f"{math.ceil(nbytes / 2**30 * 10) / 10:g}GiB"
    if nbytes >= 2**20:
        return f"{math.ceil(nbytes / 2**20)}MiB"
    return f"{max(1, math.ceil(nbytes / 2**10))}KiB"
