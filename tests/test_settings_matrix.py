"""Every combination of store x update place x activations x dtype x grad-accum trains through the CLI."""
from __future__ import annotations

import itertools
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from streamer.trainer import StreamingTrainer

MATRIX = list(itertools.product(["ram", "disk"], ["device", "host"], ["resident", "checkpoint"], ["fp32", "bf16"],
                                [1, 2]))
FP32_TOL = 1.0
BF16_TOL = 1.0


def _run(setup, root, combo):
    store, update_on, activations, dtype, accum = combo
    run = root / "-".join(map(str, combo))
    args = ["train", "--model", setup / "config.json", "--data", setup / "train.txt", "--tokenizer", setup / "tok",
            "--run-dir", run, "--batch", 2, "--seq", 16, "--steps", 2, "--sample-tokens", 0, "--eval-every", 0,
            "--eval-fraction", 0, "--lr", 3e-3, "--store", store, "--update-on", update_on,
            "--activations", activations, "--dtype", dtype, "--grad-accum", accum]
    done = subprocess.run([sys.executable, "-m", "streamer", *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    return combo, run, done


def _weights(run):
    trainer = StreamingTrainer.open(run / "store")
    try:
        return {k: v.float().clone() for k, v in trainer.state_dict().items()}
    finally:
        trainer.close()


def test_every_setting_combination_trains_and_agrees(tiny_setup, tmp_path):
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: _run(tiny_setup, tmp_path, c), MATRIX))
    for combo, _, done in results:
        assert done.returncode == 0 and "Traceback" not in done.stderr, (combo, done.stderr)
    weights = {combo: _weights(run) for combo, run, _ in results}
    reference = weights[MATRIX[0]]

    def largest(dtype):
        return max(float((w[k] - reference[k]).abs().max()) for c, w in weights.items() if c[3] == dtype
                   for k in reference)

    fp32, bf16 = largest("fp32"), largest("bf16")
    print(f"largest difference from {MATRIX[0]}: fp32 {fp32:.3g}, bf16 {bf16:.3g}")
    assert fp32 <= FP32_TOL
    assert bf16 <= BF16_TOL
