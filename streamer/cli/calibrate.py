"""`streamer calibrate`: measure this machine's figures (the cpu's `local` device, or a GPU against its preset)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from layers import ModelConfig
from memory_model import DEVICE_PRESETS
from streamer.cli.devices import catalogue_entry
from streamer.cli.flags import declare_command
from streamer.console import make_console
from streamer.errors import StreamerError
from streamer.run import RunConfig

EXAMPLES = """\
examples:
  streamer calibrate                                   the cpu as the local device (cached for plan --target local)
  streamer calibrate --device cpu --target h100-sxm    the GPU path's probes, run on the cpu"""
# The GPU path's probes sized for a cpu: a few seconds in all.
CPU_PROBES = {"matmul_n": 1024, "attention_heads": 4, "attention_seq": 512, "head_dim": 64,
              "copy_bytes": 64 * 2**20, "update_params": 8 * 2**20, "repeats": 3}


def declare(parser: argparse.ArgumentParser) -> None:
    declare_command(parser, calibrate_command,
                    "Measure this machine. On a CUDA GPU (`streamer calibrate --device cuda`): the achieved share "
                    "of its preset's matmul and attention peaks, the host links with pinned buffers and the "
                    "host's AdamW, each figure 'measured', saved in runs/ and printed as --set flags for plan "
                    "and train. On the cpu without --target: the local device.", EXAMPLES)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--target", help="the preset whose peaks the fractions are of (default on CUDA: the "
                                         f"GPU's, by its name; one of {', '.join(DEVICE_PRESETS)})")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="the dtype measured (default: bf16 on a GPU "
                                                                  "preset, fp32 for the local device)")
    parser.add_argument("--model", default=RunConfig.model, help="the model the local device's probes are sized for")
    parser.add_argument("--json", action="store_true", help="every figure as {value, basis, source}")


def calibrate_command(args: argparse.Namespace) -> int:
    import torch

    from streamer.calibration.calibrate import CACHE_NAME, local_spec
    from streamer.calibration.calibrate_device import ProbeSizes, calibrate_device, preset_for, set_flags

    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise StreamerError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise StreamerError(f"--device {args.device} but torch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise StreamerError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.target is not None and args.target not in DEVICE_PRESETS:
        raise StreamerError(f"unknown --target {args.target!r}; choose one of {', '.join(DEVICE_PRESETS)}")
    runs = Path("runs")
    if device.type == "cpu" and args.target is None:
        shape = ModelConfig.named(args.model)
        spec = local_spec(runs, shape, args.dtype or "fp32", refresh=True)
        saved = runs / CACHE_NAME
    else:
        target = args.target or preset_for(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        sizes = ProbeSizes(**CPU_PROBES) if device.type == "cpu" else ProbeSizes()
        spec = calibrate_device(device, target, args.dtype or "bf16", sizes)
        runs.mkdir(exist_ok=True)
        saved = runs / f"device-{target}-{device.type}.json"
        saved.write_text(json.dumps(catalogue_entry(spec), indent=2))
    if args.json:
        print(json.dumps(catalogue_entry(spec), indent=2))
        return 0
    console = make_console()
    for name, figure in spec.figures.items():
        if figure.basis == "measured":
            console.print(f"{name} = {figure.value:.6g}  ({figure.source})", markup=False, highlight=False)
    console.print(f"saved in {saved}", markup=False, highlight=False)
    for note in spec.notes if spec.name == "local" else ():  # what it measured on, and a busy machine if it was
        console.print(f"note: {note}", markup=False, highlight=False)
    if args.target is not None or device.type == "cuda":
        console.print(f"plan with them: streamer plan --target {spec.name} {set_flags(spec)}", markup=False,
                      highlight=False)
    return 0
