"""Soak test: a long run of the debug preset, watching memory, file handles and the loss.

    python -m benchmarks.soak --steps 500 --store disk

Passes when the resident set grows less than 5% from the end of the warm-up to the last step, the number
of open file descriptors does not grow, and the loss curve equals, bit for bit, the same run in the other
tier (RAM for a disk soak). The data is the interpreter's help text as bytes (the debug preset's vocabulary
is 256), so the loss falls as a real run's would. The compute dtype is auto (streamer/runtime/hardware.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from layers import GPTJConfig
from memory_model.tiers import TIERS
from streamer.config import TrainerConfig
from streamer.io.data import demo_corpus
from streamer.trainer import StreamingTrainer

MAX_RSS_GROWTH = 0.05


@dataclass(frozen=True)
class Run:
    """One tier's run: the loss per step, and RSS (bytes) and open descriptors after each step."""

    store: str
    losses: list[float]
    rss: list[int]
    fds: list[int]
    seconds: float
    trace_records: int  # spans and memory samples the trainer's trace holds at the end: it keeps every step's


@dataclass(frozen=True)
class SoakReport:
    steps: int
    warmup: int
    soaked: Run
    other: Run | None  # the same run in the other tier, for the loss

    @property
    def rss_growth(self) -> float:
        """Relative growth of the soaked run's RSS from the end of the warm-up to the last step."""
        return self.soaked.rss[-1] / self.soaked.rss[self.warmup - 1] - 1

    @property
    def fd_growth(self) -> int:
        return max(self.soaked.fds[self.warmup - 1:]) - self.soaked.fds[self.warmup - 1]

    @property
    def same_loss(self) -> bool | None:
        return None if self.other is None else self.soaked.losses == self.other.losses

    @property
    def passed(self) -> bool:
        return self.rss_growth < MAX_RSS_GROWTH and self.fd_growth <= 0 and self.same_loss is not False

    def summary(self) -> str:
        d = self.soaked
        lines = [f"{self.steps} steps of gptj-debug, {d.store} tier: {d.seconds / self.steps * 1e3:.0f} ms/step",
                 f"loss {d.losses[0]:.3f} -> {d.losses[-1]:.3f}",
                 f"RSS after step {self.warmup}: {d.rss[self.warmup - 1] / 2**20:.1f} MiB, after step {self.steps}: "
                 f"{d.rss[-1] / 2**20:.1f} MiB ({self.rss_growth:+.2%}; limit {MAX_RSS_GROWTH:.0%})",
                 f"open file descriptors after step {self.warmup}: {d.fds[self.warmup - 1]}, "
                 f"most after: {max(d.fds[self.warmup - 1:])}",
                 f"the trainer's trace holds {d.trace_records} spans and memory samples"]
        if self.other is not None:
            lines.append(f"loss curve equal to the {self.other.store} tier's: {self.same_loss}")
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


def batches(steps: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    """`steps` batches of byte sequences drawn (seeded) from the help-text corpus."""
    text = torch.frombuffer(bytearray("\n".join(demo_corpus()).encode()), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - seq, (steps, batch), generator=g)
    return [torch.stack([text[s:s + seq] for s in row.tolist()]) for row in starts]


def run(store: str, steps: int, root: Path, batch: int = 8, seq: int = 64) -> Run:
    cfg = GPTJConfig.preset("gptj-debug")
    tc = TrainerConfig.of(lr=1e-3, store=store, update_chunk=8192)  # compute dtype auto: fast on any CPU
    process = psutil.Process()
    losses, rss, fds = [], [], []
    start = time.perf_counter()
    with StreamingTrainer(cfg, tc, store_dir=root / store) as trainer:
        for ids in batches(steps, batch, seq):
            losses.append(trainer.step(ids))
            rss.append(process.memory_info().rss)
            fds.append(process.num_fds())
        records = len(trainer.trace.events) + len(trainer.trace.samples)
    return Run(store, losses, rss, fds, time.perf_counter() - start, records)


def soak(steps: int = 500, warmup: int = 50, store: str = "disk", compare: bool = True) -> SoakReport:
    if not 0 < warmup < steps:
        raise ValueError(f"need 0 < warmup < steps, got warmup={warmup}, steps={steps}")
    with tempfile.TemporaryDirectory(prefix="ws-soak-") as tmp:
        soaked = run(store, steps, Path(tmp))
        other = run(next(t for t in TIERS if t != store), steps, Path(tmp)) if compare else None
    return SoakReport(steps, warmup, soaked, other)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50, help="steps before RSS and descriptors are watched")
    parser.add_argument("--store", choices=["disk", "ram"], default="disk", help="the tier soaked")
    parser.add_argument("--no-compare", action="store_true", help="skip the other tier's run (the loss check)")
    parser.add_argument("--json", type=Path, help="also write the per-step numbers here")
    args = parser.parse_args(argv)
    try:
        report = soak(args.steps, args.warmup, args.store, compare=not args.no_compare)
    except ValueError as exc:
        parser.error(str(exc))
    print(report.summary())
    if args.json is not None:
        args.json.write_text(json.dumps({**asdict(report), "rss_growth": report.rss_growth,
                                         "fd_growth": report.fd_growth, "passed": report.passed}))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
