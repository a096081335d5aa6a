"""`streamer devices`: the device catalogue, every figure with its basis and source; and `--set field=value`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from layers import ModelConfig
from memory_model import DEVICE_PRESETS, DeviceSpec
from memory_model.catalogue import Figure
from memory_model.devices import FIGURES
from streamer.cli.flags import declare_command
from streamer.console import make_console
from streamer.run import RunConfig
from streamer.calibration.calibrate import local_spec

EXAMPLES = """\
examples:
  streamer devices
  streamer devices --json"""


def declare(parser: argparse.ArgumentParser) -> None:
    declare_command(parser, devices_command, "The simulated devices' figures.", EXAMPLES)
    parser.add_argument("--json", action="store_true", help="every figure as {value, basis, source}")
    parser.add_argument("--local", action="store_true", help="also calibrate and list this machine (seconds)")
    parser.add_argument("--model", default=RunConfig.model, help="the model --local sizes its probes for")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32", help="the dtype --local measures")


def devices_command(args: argparse.Namespace) -> int:
    specs = list(DEVICE_PRESETS.values())
    if args.local:
        # Measured again and cached for `plan --target local` and `plan --compare`: run it on a quiet machine.
        shape = ModelConfig.named(args.model)
        specs.append(local_spec(Path("runs"), shape, args.dtype, refresh=True))
    if args.json:
        print(json.dumps([catalogue_entry(s) for s in specs], indent=2))
        return 0
    table = Table(title="device catalogue (basis: S sourced, D derived, M measured, A assumed; "
                        "`streamer devices --json` has every source)")
    table.add_column("field")
    for spec in specs:
        table.add_column(spec.name, justify="right")
    for name in FIGURES:
        table.add_row(name, *(_cell(spec.figures.get(name)) for spec in specs))
    table.add_row("update on", *(s.update_on for s in specs))
    table.add_row("data-parallel reduce", *(s.reduce for s in specs))
    make_console().print(table)
    return 0


def catalogue_entry(spec: DeviceSpec) -> dict[str, object]:
    return {"name": spec.name, "update_on": spec.update_on, "reduce": spec.reduce,
            "fields": {name: f.to_dict() for name, f in spec.figures.items()}, "notes": list(spec.notes)}


def _cell(figure: Figure | None) -> str:
    if figure is None:
        return "-"
    return f"{figure.value:.4g} {figure.basis[0].upper()}"
