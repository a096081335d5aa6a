"""What a device is and what a training step costs on it: device specs, the ledger, traces, the planner.

No tensor math and no torch import here: the runtime measures the `local` device (streamer.calibration.calibrate).
"""
from memory_model.devices import DEVICE_PRESETS, DeviceSpec, Link, device_spec
from memory_model.ledger import CATEGORIES, DeviceOutOfMemory, Ledger, WindowStats, suggest_fixes
from memory_model.planner import BASELINE_BYTES_PER_PARAM, Plan, UnitRow, peak_device_bytes, plan
from memory_model.shapes import PlanConfig
from memory_model.trace import PHASES, MemorySample, SpanEvent, Trace
from memory_model.units import COMPUTE_DTYPES, DTYPE_BYTES, SizeError, format_size, parse_size

__all__ = [
    "BASELINE_BYTES_PER_PARAM", "CATEGORIES", "COMPUTE_DTYPES", "DEVICE_PRESETS", "DTYPE_BYTES", "PHASES",
    "DeviceOutOfMemory", "DeviceSpec", "Ledger", "Link", "MemorySample", "Plan", "PlanConfig", "SizeError", "SpanEvent",
    "Trace", "UnitRow", "WindowStats", "device_spec", "format_size", "parse_size", "peak_device_bytes", "plan",
    "suggest_fixes",
]
