"""--report-to: TensorBoard event files in the run folder, read back; W&B offline by default; missing packages."""
from __future__ import annotations

import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from streamer.reporting import TENSORBOARD_DIR, ReportConfig, ReportSettingError
from streamer.run_dir import RunDir
from tests.test_cli import fails, run_cli, tiny_args

PER_STEP = ("loss", "lr", "grad_norm", "tokens_per_s", "device_peak_bytes", "host_rss_bytes")


def test_tensorboard_events_hold_every_metric_of_every_step(capsys, tmp_path, tiny_setup):
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, *tiny_args(tiny_setup, run, 2, "--report-to", "tensorboard", "--eval-every", 1,
                                             "--eval-batches", 1))
    assert rc == 0, err
    events = EventAccumulator(str(run / TENSORBOARD_DIR))
    events.Reload()
    metrics = RunDir(run).read_metrics()
    for key in (*PER_STEP, "eval_loss", "eval_perplexity"):
        logged = [(m["step"], m[key]) for m in metrics if key in m]
        read = [(e.step, e.value) for e in events.Scalars(key)]  # TensorBoard keeps float32
        assert read == [(step, pytest.approx(value, rel=1e-6)) for step, value in logged], key
    assert [e.step for e in events.Scalars("loss")] == [1, 2]
    assert [e.step for e in events.Scalars("eval_loss")] == [0, 1, 2]  # step 0, every step, the end
    assert all(e.value > 0 for e in events.Scalars("grad_norm"))


def test_wandb_is_offline_unless_configured_and_logs_every_step(capsys, tmp_path, tiny_setup, monkeypatch):
    calls: list[tuple[str, object]] = []

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", (step, values)))

        def finish(self):
            calls.append(("finish", None))

    fake = types.SimpleNamespace(init=lambda **kwargs: calls.append(("init", kwargs)) or FakeRun(),
                                 Settings=lambda **kwargs: kwargs)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = tmp_path / "run"
    assert run_cli(capsys, *tiny_args(tiny_setup, run, 2, "--report-to", "wandb"))[0] == 0
    init = calls[0][1]
    assert init["mode"] == "offline" and init["dir"] == str(run) and init["config"]["steps"] == 2
    logged = [value for kind, value in calls if kind == "log"]
    assert [step for step, values in logged if "loss" in values] == [1, 2]
    assert all(set(PER_STEP) <= set(values) for step, values in logged if "loss" in values)
    assert calls[-1][0] == "finish"

    monkeypatch.setenv("WANDB_MODE", "online")
    calls.clear()
    assert run_cli(capsys, "train", "--resume", run, "--steps", 3)[0] == 0  # resume keeps --report-to
    assert calls[0][1]["mode"] == "online" and calls[0][1]["id"] == init["id"]  # the same W&B run


@pytest.mark.parametrize("target,extra", [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_a_missing_package_names_its_extra_before_anything_is_written(capsys, tmp_path, tiny_setup, monkeypatch,
                                                                      target, extra):
    monkeypatch.setitem(sys.modules, "wandb" if target == "wandb" else "torch.utils.tensorboard", None)
    run = tmp_path / "run"
    error = fails(capsys, *tiny_args(tiny_setup, run, 1, "--report-to", target))
    assert f"pip install 'weight-streaming[{extra}]'" in error
    assert not run.exists()


def test_report_to_names_known_reporters():
    assert ReportConfig("tensorboard, wandb").targets == ("tensorboard", "wandb")
    assert ReportConfig().targets == ()
    for bad in ("tensorbored", "", ",", "none,wandb"):
        with pytest.raises(ReportSettingError, match="--report-to"):
            ReportConfig(bad)
    with pytest.raises(ReportSettingError, match=r"an unknown target \(tensorbored\)"):
        ReportConfig("tensorbored")
