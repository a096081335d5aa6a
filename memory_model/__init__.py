"""What a device is and what a training step costs on it: device specs, the ledger, traces, the planner.

No tensor math and no torch import here (calibrating the `local` device imports torch when asked for).
"""
from memory_model.devices import DEVICE_PRESETS, DTYPE_BYTES, DeviceSpec, Link, device_spec
from memory_model.ledger import CATEGORIES, DeviceOutOfMemory, Ledger, WindowStats, suggest_fixes
from memory_model.trace import PHASES, MemorySample, SpanEvent, Trace
from memory_model.units import SizeError, format_size, parse_size

__all__ = [
    "CATEGORIES", "DEVICE_PRESETS", "DTYPE_BYTES", "PHASES", "DeviceOutOfMemory", "DeviceSpec", "Ledger", "Link",
    "MemorySample", "SizeError", "SpanEvent", "Trace", "WindowStats", "device_spec", "format_size", "parse_size",
    "suggest_fixes",
]
