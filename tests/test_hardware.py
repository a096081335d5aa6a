"""`--dtype auto`: bf16 where the hardware runs it natively and fast, else fp32; chosen once, recorded, resumed.

The CPU probe's decision is tested on made-up rates (both outcomes) and for real in fresh processes with
torch capped to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`, which must be set before torch
loads), the way a CPU without native bf16 runs: there auto must pick fp32, in a probe and in a training run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from layers import GPTJConfig
from streamer import TrainerConfig
from streamer.cli.plan import plan_dtype
from streamer.errors import StreamerError
from streamer.runtime.hardware import (
    DtypeChoice, MatmulProbe, choose_for_cpu, choose_for_cuda, cpu_probe, probe_cpu, resolve_compute_dtype,
)
from streamer.run import RunConfig, RunError

AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
ROOT = Path(__file__).resolve().parents[1]
NATIVE = MatmulProbe(bf16_flops=205e9, fp32_flops=103e9, n=256)  # this machine's AVX512-BF16, measured
EMULATED = MatmulProbe(bf16_flops=3.2e9, fp32_flops=103e9, n=256)  # the same CPU capped to AVX2, measured


def _tiny_run_flags(root: Path) -> list[str]:
    """A small model and text for runs of a few seconds (a BPE needs a vocabulary above 256)."""
    from pydoc_data.topics import topics
    cfg = GPTJConfig(vocab_size=320, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)
    (root / "config.json").write_text(json.dumps(cfg.adapter().to_hf()))
    (root / "train.txt").write_text("\n\n".join(topics[k] for k in sorted(topics)[:10]))
    return ["--model", str(root / "config.json"), "--data", str(root / "train.txt"), "--batch", "2", "--seq", "16",
            "--eval-every", "0", "--sample-tokens", "0"]


def _python(code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout


# --- the decision --------------------------------------------------------------------------------------------
def test_cpu_auto_follows_the_probe() -> None:
    native, emulated = choose_for_cpu(NATIVE, "auto"), choose_for_cpu(EMULATED, "auto")
    assert native == DtypeChoice("bf16", "compute dtype bf16: bf16 matmul 205.0 GFLOP/s vs fp32 103.0 on this CPU")
    assert emulated.dtype == "fp32" and not emulated.emulated
    assert emulated.reason == "compute dtype fp32: bf16 matmul 3.2 GFLOP/s vs fp32 103.0 on this CPU (no native bf16)"
    tie = MatmulProbe(bf16_flops=50e9, fp32_flops=50e9, n=256)
    assert choose_for_cpu(tie, "auto").dtype == "bf16"  # "at least as fast"


def test_explicit_dtype_wins_with_a_warning_where_bf16_is_emulated() -> None:
    forced = choose_for_cpu(EMULATED, "bf16")
    assert forced.dtype == "bf16" and forced.emulated
    assert forced.reason.startswith("warning: --dtype bf16 is emulated on this CPU") and "auto would use fp32" in \
        forced.reason
    assert choose_for_cpu(NATIVE, "bf16") == DtypeChoice("bf16", "compute dtype bf16 (--dtype bf16)")
    assert choose_for_cpu(NATIVE, "fp32") == DtypeChoice("fp32", "compute dtype fp32 (--dtype fp32)")


def test_cuda_auto_follows_the_compute_capability() -> None:
    h100 = choose_for_cuda("NVIDIA H100 80GB HBM3", (9, 0), "auto")
    assert h100 == DtypeChoice("bf16", "compute dtype bf16: NVIDIA H100 80GB HBM3 (compute capability 9.0) runs "
                                       "bf16 natively")
    assert choose_for_cuda("NVIDIA A100-SXM4-40GB", (8, 0), "auto").dtype == "bf16"
    t4 = choose_for_cuda("Tesla T4", (7, 5), "auto")
    assert t4.dtype == "fp32" and "needs 8.0 or newer" in t4.reason
    forced = choose_for_cuda("Tesla T4", (7, 5), "bf16")
    assert forced.dtype == "bf16" and forced.emulated and forced.reason.startswith("warning:")


def test_resolve_checks_its_input_and_the_device() -> None:
    with pytest.raises(StreamerError, match="--dtype must be auto, bf16 or fp32, got 'fp8'"):
        resolve_compute_dtype("cpu", "fp8")
    assert resolve_compute_dtype("meta").dtype == "bf16"  # a dry run stands for a GPU
    assert resolve_compute_dtype("cpu", "fp32").reason == "compute dtype fp32 (--dtype fp32)"
    if not torch.cuda.is_available():
        with pytest.raises(StreamerError, match="torch sees no CUDA GPU; use --device cpu"):
            resolve_compute_dtype("cuda:0")


def test_the_cpu_probe_is_short_and_measured_once_per_process() -> None:
    probe = probe_cpu()
    assert probe.bf16_flops > 0 and probe.fp32_flops > 0 and probe.n == 256
    assert cpu_probe() is cpu_probe()  # cached: a run resolves auto in several places
    assert resolve_compute_dtype("cpu").dtype == ("bf16" if cpu_probe().bf16_is_fast else "fp32")


def test_trainer_config_resolves_auto() -> None:
    assert TrainerConfig().compute_dtype == (torch.bfloat16 if cpu_probe().bf16_is_fast else torch.float32)
    assert TrainerConfig.of(device="meta").compute_dtype == torch.bfloat16
    assert TrainerConfig.of(dtype="fp32").compute_dtype == torch.float32
    assert RunConfig().trainer.step.precision.compute == "auto"
    with pytest.raises(RunError, match="--dtype must be one of auto, bf16, fp32"):
        RunConfig.of({"dtype": "fp16"})


# --- for real, capped to AVX2 ----------------------------------------------------------------------------------
def test_the_isa_cap_takes_effect_in_a_fresh_process() -> None:
    capped = _python("import torch; from streamer.runtime.hardware import resolve_compute_dtype as r; "
                     "print(torch.backends.cpu.get_cpu_capability()); print(r('cpu').reason)", AVX2)
    capability, reason = capped.splitlines()
    assert capability == "AVX2"
    assert reason.startswith("compute dtype fp32: bf16 matmul") and reason.endswith("(no native bf16)")


def test_a_training_run_under_the_avx2_cap_picks_fp32_records_it_and_resumes_with_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    flags = [*_tiny_run_flags(tmp_path), "--steps", "2"]
    env = {**os.environ, **AVX2}
    first = subprocess.run([sys.executable, "-m", "streamer", "train", "--run-dir", str(run), *flags],
                           capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "compute dtype fp32: bf16 matmul" in first.stdout and "(no native bf16)" in first.stdout
    assert first.stdout.count("compute dtype") == 1  # printed once
    assert tomllib.loads((run / "config.toml").read_text())["dtype"] == "fp32"
    assert json.loads((run / "store" / "manifest.json").read_text())["spec"]["compute_dtype"] == "fp32"
    # Resumed where bf16 is native, the run keeps the dtype it recorded: its store holds fp32 compute weights.
    again = subprocess.run([sys.executable, "-m", "streamer", "train", "--resume", str(run), "--steps", "3"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert tomllib.loads((run / "config.toml").read_text())["dtype"] == "fp32"
    assert "fp32" in next(line for line in again.stdout.splitlines() if line.startswith("run "))
    # Rerunning the first command (auto again) continues the run too: auto means the dtype it recorded.
    rerun = subprocess.run([sys.executable, "-m", "streamer", "train", "--run-dir", str(run), *flags[:-1], "4"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert "continuing it to step 4" in rerun.stdout and "compute dtype" not in rerun.stdout


def test_an_explicit_bf16_run_and_its_generate_warn_where_bf16_is_emulated(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "streamer", "train", "--run-dir", str(tmp_path / "run"),
                           *_tiny_run_flags(tmp_path), "--steps", "1", "--dtype", "bf16"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **AVX2}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "warning: --dtype bf16 is emulated on this CPU" in done.stdout
    assert tomllib.loads((tmp_path / "run" / "config.toml").read_text())["dtype"] == "bf16"
    generated = subprocess.run([sys.executable, "-m", "streamer", "generate", str(tmp_path / "run"), "--prompt",
                                "The", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300,
                               env={**os.environ, **AVX2}, cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr
    assert "warning: --dtype bf16 is emulated on this CPU" in generated.stdout  # the run's dtype, said again


def test_plan_auto_on_the_local_target_uses_the_probe_and_calibrates_that_dtype(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "streamer", "plan", "--model", "gptj-debug", "--target", "local",
                           "--batch", "2", "--seq", "32", "--json"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **AVX2}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["config"]["compute_dtype"] == "fp32" and out["compute_dtype_reason"].startswith("compute dtype fp32")
    cache = json.loads((tmp_path / "runs" / "device-local.json").read_text())
    assert [json.loads(key)["dtype"] for key in cache["entries"]] == ["fp32"]  # only the dtype it plans
    preset = plan_dtype("a100-40g", "auto")  # the presets run bf16 natively, whatever this CPU does
    assert preset == DtypeChoice("bf16", "compute dtype bf16: a100-40g runs bf16 natively")
    assert plan_dtype("cs2", "fp32").dtype == "fp32"


# --- gpu-check without a GPU ----------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, gpu-check runs the whole check")
def test_make_gpu_check_says_there_is_no_gpu_and_exits_0(tmp_path: Path) -> None:
    stamp = tmp_path / "installed"  # `make gpu-check` with this interpreter instead of a fresh .venv
    stamp.touch()
    made = subprocess.run(["make", "-s", "gpu-check", f"PY={sys.executable}", f"STAMP={stamp}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert "sees no CUDA device" in made.stdout and "nothing to check on this machine" in made.stdout


def test_the_command_sets_torch_up_before_it_loads_and_a_users_setting_wins() -> None:
    """`streamer`'s process: OpenMP threads that sleep while they wait, and pinned blocks that keep their size
    (torch >= 2.13 knows the key); torch reads both from the environment the entry point sets."""
    from streamer.cli.launch import PROCESS_ENV

    assert PROCESS_ENV["OMP_WAIT_POLICY"] == "PASSIVE"
    assert PROCESS_ENV["PYTORCH_ALLOC_CONF"] == "pinned_max_round_threshold_mb:64"  # constraints.txt's torch
    # The entry point with a stand-in for the commands, which loads torch only once the entry point has run.
    probe = ("import os, sys, types; from streamer.cli.launch import main; m = types.ModuleType('streamer.cli.main'); "
             "m.main = lambda: print(os.environ['OMP_WAIT_POLICY'], __import__('torch')._C."
             "_accelerator_getAllocatorSettings()) or 0; sys.modules[m.__name__] = m; sys.exit(main())")
    env = {k: v for k, v in os.environ.items() if k not in PROCESS_ENV}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["PASSIVE", "pinned_max_round_threshold_mb:64"]
    done = subprocess.run([sys.executable, "-c", probe], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                          capture_output=True, text=True, check=True)
    assert done.stdout.split()[0] == "ACTIVE"
