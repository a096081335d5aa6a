"""`streamer bench`: the benchmarks of a source checkout, run as their own process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from streamer.errors import StreamerError

# The source checkout this package was installed from in editable mode, where benchmarks/ lives.
CHECKOUT = Path(__file__).resolve().parents[2]


def bench_command(argv: list[str]) -> int:
    """The benchmarks live beside the package in a source checkout (they are not part of the runtime):
    run them there as their own process, so that nothing in streamer imports them."""
    checkout = CHECKOUT
    if not (checkout / "benchmarks" / "bench.py").is_file():
        raise StreamerError("`streamer bench` runs from a source checkout and benchmarks/ is not beside this "
                            f"installation ({checkout}); clone the repository, `pip install -e .` it and run "
                            "`make bench`")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "benchmarks.bench", *argv], env=env).returncode
