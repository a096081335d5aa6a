"""`python -m benchmarks.convergence`: the opt-in precisions of the optimizer state against exact fp32 AdamW.

Each precision trains the same model from the same seed on the same data with `streamer train`, as a user
runs it, evaluating the held-out loss every `--eval-every` steps. The report (docs/CONVERGENCE.md by
default) holds every evaluation's loss, each precision's relative difference from fp32, and a plot of the
curves beside it. The goal: within 1% of fp32 at every evaluation.

The model is a GPT-J of about 100M parameters (d_model 768, 12 layers) initialised at random and trained on
the embedded demo corpus, since nothing is downloaded: a training run from scratch, not a fine-tune of
published weights. `--quick` runs the harness on a tiny model (the test suite runs it), not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.01  # relative difference from fp32 at every evaluation
MAX_GRAD_NORM = 1.0  # streamer train's default --max-grad-norm, which these runs keep

# (name, the flags that select it); fp32 first: the reference.
PRECISIONS = (("fp32", ()), ("bf16 moments", ("--moment-dtype", "bf16")), ("int8 moments", ("--moment-dtype", "int8")),
              ("bf16 master, int8 moments", ("--master-dtype", "bf16", "--moment-dtype", "int8")))
MODEL_100M = {"model_type": "gptj", "n_embd": 768, "n_layer": 12, "n_head": 12, "rotary_dim": 64,
              "vocab_size": 8192, "n_positions": 2048}
MODEL_QUICK = {"model_type": "gptj", "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 16,
               "vocab_size": 512, "n_positions": 256}


@dataclass(frozen=True)
class Settings:
    model: dict
    steps: int
    eval_every: int
    batch: int
    seq: int
    lr: float


def settings(quick: bool, steps: int | None) -> Settings:
    if quick:
        return Settings(MODEL_QUICK, steps or 6, 3, 2, 64, 1e-3)
    return Settings(MODEL_100M, steps or 300, 25, 2, 128, 3e-4)


@dataclass(frozen=True)
class Curve:
    eval_loss: dict[int, float]  # held-out loss by step
    clipped: int  # steps whose gradient norm exceeded --max-grad-norm (1.0, the default)
    steps: int


def train(s: Settings, flags: tuple[str, ...], config: Path, run_dir: Path) -> Curve:
    """One `streamer train` run's held-out losses and how many of its steps clipped."""
    command = [sys.executable, "-m", "streamer", "train", "--model", str(config), "--steps", str(s.steps),
               "--batch", str(s.batch), "--seq", str(s.seq), "--lr", str(s.lr), "--schedule", "cosine",
               "--warmup", str(max(s.steps // 20, 1)), "--eval-every", str(s.eval_every), "--sample-tokens", "0",
               "--seed", "0", "--store", "ram", "--run-dir", str(run_dir), *flags]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "grad_norm" in r]
    return Curve({r["step"]: r["eval_loss"] for r in records if "eval_loss" in r},
                 sum(r["grad_norm"] > MAX_GRAD_NORM for r in steps), len(steps))


def report(s: Settings, runs: dict[str, Curve], command: str, seconds: float, plot: str) -> str:
    curves = {name: run.eval_loss for name, run in runs.items()}
    reference = curves["fp32"]
    steps = sorted(reference)
    names = list(curves)
    worst = {n: max(abs(curves[n][k] / reference[k] - 1) for k in steps) for n in names[1:]}
    params = 12 * s.model["n_layer"] * s.model["n_embd"] ** 2 + 2 * s.model["vocab_size"] * s.model["n_embd"]
    out = ["# Convergence of the optimizer-state precisions", "",
           "Written by `python -m benchmarks.convergence`; every number below was measured in the run it "
           "describes. Do not edit by hand: rerun the command.", "",
           f"- command: `{command}`; {seconds / 60:.1f} min",
           f"- model: GPT-J, d_model {s.model['n_embd']}, {s.model['n_layer']} layers, vocabulary "
           f"{s.model['vocab_size']} (about {params / 1e6:.0f}M parameters), random init, the embedded demo corpus",
           f"- {s.steps} steps of {s.batch} x {s.seq} tokens, RAM tier, lr {s.lr:g} (cosine), seed 0; held-out loss "
           f"every {s.eval_every} steps", "", "## Goal", ""]
    out += [f"- {n}: within {GOAL:.0%} of fp32 at every evaluation: {'met' if w <= GOAL else 'NOT met'} "
            f"(at most {w:.2%})" for n, w in worst.items()]
    out += ["", "## Clipping", "", f"Steps whose gradient norm exceeded --max-grad-norm {MAX_GRAD_NORM:g} (then "
            "the update runs after the backward on the disk tier, not fused into it):", ""]
    out += [f"- {name}: {run.clipped} of {run.steps}" for name, run in runs.items()]
    out += ["", "## Held-out loss", "", f"![curves]({plot})", "",
            "| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for k in steps:
        cells = [f"{reference[k]:.4f}"] + [f"{curves[n][k]:.4f} ({curves[n][k] / reference[k] - 1:+.2%})"
                                          for n in names[1:]]
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(curves: dict[str, dict[int, float]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        steps = sorted(curve)
        axes.plot(steps, [curve[k] for k in steps], marker="o", markersize=3, label=name)
    axes.set_xlabel("step")
    axes.set_ylabel("held-out loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the harness on a tiny model (< 1 min)")
    parser.add_argument("--steps", type=int, help="steps per run (default 300; --quick: 6)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "CONVERGENCE.md",
                        help="the report; the plot goes beside it (default docs/CONVERGENCE.md)")
    args = parser.parse_args(argv)
    s = settings(args.quick, args.steps)
    started = time.monotonic()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="convergence-") as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(s.model))
        for name, flags in PRECISIONS:
            began = time.monotonic()
            runs[name] = train(s, flags, config, Path(tmp) / name.replace(" ", "-"))
            print(f"trained with {name} in {time.monotonic() - began:.0f} s", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    image = args.output.with_suffix(".png")
    plot({name: run.eval_loss for name, run in runs.items()}, image)
    command = "python -m benchmarks.convergence" + (" --quick" if args.quick else "") + \
              (f" --steps {args.steps}" if args.steps else "")
    text = report(s, runs, command, time.monotonic() - started, image.name)
    args.output.write_text(text)
    print(text + f"\nwrote {args.output} and {image}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
