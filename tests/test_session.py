"""A run's lifecycle through the library (`streamer.session`), as README's "A run, from Python" shows it: stopped
after some steps without a kill and resumed, it equals an uninterrupted run bit for bit."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from streamer.run import RunConfig
from streamer.run_dir import RunDir
from streamer.session import Event, open_trainer, start

ROOT = Path(__file__).resolve().parents[1]


def readme_block() -> str:
    """The Python block of README's "A run, from Python"."""
    section = ROOT.joinpath("README.md").read_text().split("### A run, from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def weights_and_losses(run: Path) -> tuple[dict[str, torch.Tensor], dict[int, float], dict[int, float]]:
    """The run's weights, and each step's training loss and eval loss as metrics.jsonl logged them."""
    with open_trainer(RunDir(run)) as trainer:
        weights = trainer.state_dict()
    records = RunDir(run).read_metrics()
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == sorted(set(steps))  # each step logged once
    return (weights, {r["step"]: r["loss"] for r in records if "loss" in r},
            {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r})


def test_the_readme_block_stops_and_resumes_a_run_equal_to_an_uninterrupted_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_block(), "README.md", "exec"), namespace)
    assert isinstance(namespace["sample"], str)

    events: list[Event] = []
    cfg = namespace["cfg"].replace(run_dir=str(tmp_path / "whole"))
    assert isinstance(cfg, RunConfig)
    with start(cfg, listener=events.append) as session:
        trained = session.train()
        session.finish()
    assert trained.steps == 6 and [e.step for e in events if e.kind == "step"] == list(range(1, 7))
    assert [e.step for e in events if e.kind == "evaluated"] == [0, 2, 4, 6]

    stopped, whole = weights_and_losses(tmp_path / "runs" / "api"), weights_and_losses(tmp_path / "whole")
    assert stopped[0].keys() == whole[0].keys()
    assert all(torch.equal(stopped[0][k], whole[0][k]) for k in whole[0])
    assert stopped[1] == whole[1] and sorted(whole[1]) == list(range(1, 7))
    assert stopped[2] == whole[2]
