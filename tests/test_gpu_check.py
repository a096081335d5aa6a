"""benchmarks/gpu_check.py's parts that need no GPU, run on a CPU with tiny sizes: the time budget, the breakdown
of a step's time from a trace (synthetic, and a real CPU profile of a tiny step), the floor, the store's set-up,
the host's measurements and the report, and the whole script's path with the CUDA parts replaced. So the script
is known to run before a GPU session gets it."""
from __future__ import annotations

import math

import pytest
import torch

import benchmarks.gpu_check as check
from layers import PRESETS
from memory_model import DEVICE_PRESETS
from streamer import StreamingTrainer, TrainerConfig


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_each_section_gets_its_share_and_a_skip_says_why():
    clock = FakeClock()
    budget = check.Budget(100, {"a": 0.3, "b": 1.0}, now=clock)
    assert budget.allows("a", "first thing", 30) and budget.left("a") == 30
    clock.t += 25
    assert not budget.allows("a", "second thing", 10)
    assert budget.allows("b", "later", 70)  # a section ending early leaves its time to the next
    assert budget.skipped == ["a: second thing: needs about 10 s, 5 s were left of the section's time"]
    clock.t += 200
    assert not budget.allows("b", "too late", 1) and "0 s were left" in budget.skipped[-1]


def _x(name, ts, dur, cat, stream=None):
    event = {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}
    if stream is not None:
        event["args"] = {"stream": stream}
    return event


def test_the_breakdown_of_a_synthetic_trace():
    events = [_x(check.STEP, 0, 1000, "user_annotation"),
              _x("gemm", 0, 400, "kernel", 7), _x("gemm", 600, 300, "kernel", 7), _x("small", 100, 50, "kernel", 8),
              _x("Memcpy HtoD (Pinned -> Device)", 300, 400, "gpu_memcpy", 9),
              _x("Memcpy DtoH (Device -> Pinned)", 850, 100, "gpu_memcpy", 10),
              _x(check.HOST_COPY, 200, 300, "user_annotation"), _x(check.HOST_COPY, 250, 100, "user_annotation"),
              _x(check.HOST_COPY, 200, 300, "gpu_user_annotation"),  # its GPU twin: not the host's time
              _x(check.HOST_UPDATE, 950, 200, "user_annotation"),  # clipped at the step's end
              {"ph": "i", "name": "marker", "ts": 5}]
    parts = {p.name: p for p in check.time_breakdown(events)}
    assert all(p.step_s == pytest.approx(1e-3) for p in parts.values())
    assert parts["compute"].seconds == pytest.approx(700e-6)  # the busiest stream's kernels only
    assert parts["H2D"].seconds == pytest.approx(400e-6) and parts["H2D"].overlapped_s == pytest.approx(200e-6)
    assert parts["D2H"].seconds == pytest.approx(100e-6) and parts["D2H"].overlapped_s == pytest.approx(50e-6)
    assert parts["host copies (staging)"].seconds == pytest.approx(300e-6)
    assert parts["host update"].seconds == pytest.approx(50e-6)
    assert parts["gradient fold"].seconds == 0.0
    assert parts["waits (no compute kernel)"].seconds == pytest.approx(300e-6)
    table = check.breakdown_table(list(parts.values()))
    assert "| H2D | 0.000 | 40% | 50% |" in table and table[-1].startswith("| waits (no compute kernel) |")


def test_the_breakdown_of_a_profiled_cpu_step(tmp_path):
    """The same path the GPU check takes, on a CPU: one step under torch.profiler, its trace written, and the
    runtime's own ranges (the fold, the update on the host) found in it."""
    tc = TrainerConfig.of(dtype="fp32", store="ram", activations="checkpoint", update_on="host")
    with StreamingTrainer(PRESETS["gptj-debug"], tc, _initialize=False) as trainer:
        trainer.load_state_dict(check.random_weights(trainer.cfg))
        events = check.profile_step(trainer, 2, 16, tmp_path / "step.trace.json")
    assert (tmp_path / "step.trace.json").stat().st_size > 0
    parts = {p.name: p for p in check.time_breakdown(events)}
    step = parts["compute"].step_s
    assert 0 < step < 60 and parts["compute"].seconds == 0.0  # no GPU kernels: all of it "waits"
    assert 0 < parts["host update"].seconds < step and 0 < parts["gradient fold"].seconds < step
    assert parts["waits (no compute kernel)"].seconds == pytest.approx(step)


@pytest.mark.parametrize("model", ["gptj-debug", "llama-debug"])
def test_random_weights_fill_a_store_that_trains(model):
    cfg = PRESETS[model]
    weights = check.random_weights(cfg, block=4096)  # smaller than the embedding: it repeats
    assert all(t.is_contiguous() or t.dim() == 1 for t in weights.values())
    with StreamingTrainer(cfg, TrainerConfig.of(dtype="fp32"), _initialize=False) as trainer:
        trainer.load_state_dict(weights)
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        losses = [trainer.step(ids) for _ in range(2)]
    assert all(math.isfinite(x) for x in losses) and losses[1] < losses[0]


def test_the_moments_are_the_widest_the_hosts_ram_holds():
    cfg = PRESETS["llama-3.1-8b"]
    sizes = {m: check.store_bytes(cfg, m) for m in check.MOMENTS}
    assert sizes["fp32"] > sizes["bf16"] > sizes["int8"]
    for moments, size in sizes.items():
        assert check.choose_moments(cfg, size + check.RAM_RESERVE)[0] == moments
    moments, why = check.choose_moments(cfg, sizes["int8"])
    assert moments is None and "no RAM-tier store fits" in why


def test_the_floor_is_the_largest_of_link_host_update_and_compute():
    machine = check.Machine(gpu="NVIDIA H100 80GB HBM3", memory=80 * 2**30, matmul_peak=800e12, h2d=50e9,
                            d2h=40e9, host_copy={1: 5e9, 4: 20e9}, host_update=100e9, preset="h100-sxm")
    spec = check.gpu_spec(machine)
    assert spec.host_copy_bw == 20e9 and spec.flops["bf16"] == 800e12 and spec.matmul_efficiency == 1.0
    tc = TrainerConfig.of(dtype="bf16", store="ram", activations="checkpoint", pin_memory="staging")
    p = check.predict(PRESETS["gptj-1.3b"], spec, tc, 1, 2048)
    floor, binding = check.floor_s(p)
    link = max(p.link_bytes["h2d"] / 50e9, p.link_bytes["d2h"] / 40e9)
    compute = sum(r.forward_flops + r.backward_flops for r in p.rows) / 800e12
    assert (floor, binding) == ((link, "link") if link > compute else (compute, "compute"))
    assert p.step_time_s >= floor
    host = check.predict(PRESETS["gptj-1.3b"], spec, tc.replace(update_on="host"), 1, 2048)
    assert check.floor_s(host)[0] >= host.config.update_touched_bytes(host.params) / 100e9


def test_the_hosts_measurements_run_on_a_cpu():
    rates = check.host_copy_rates(8 * 2**20, [1, 2], pin=False)
    assert set(rates) == {1, 2} and all(r > 0 for r in rates.values())
    assert check.io_thread_count() == torch.get_num_threads()


def _result(spec) -> check.ModelResult:
    tc = TrainerConfig.of(dtype="bf16", store="ram", activations="checkpoint", pin_memory="register")
    cfg = PRESETS["gptj-1.3b"]
    one, host, many = (check.predict(cfg, spec, tc.replace(update_on=u), b, 2048)
                       for u, b in (("device", 1), ("host", 1), ("device", 8)))
    runs = [check.Run(1, "device", (2.0, 2.2), 5 * 2**30, int(1.1 * one.allocated_peak_bytes), one),
            check.Run(1, "host", (1.9,), 5 * 2**30, one.allocated_peak_bytes, host),
            check.Run(16, "device", prediction=many, error="CUDA out of memory"),
            check.Run(8, "device", (3.0,), 9 * 2**30, many.allocated_peak_bytes, many)]
    parts = [check.Part("compute", 0.5, 0.0, 2.0), check.Part("H2D", 1.5, 0.4, 2.0),
             check.Part("waits (no compute kernel)", 1.5, 0.0, 2.0)]
    return check.ModelResult("gptj-6b", ["- store: fp32 Adam moments"], runs, parts, "gptj-6b-step.trace.json")


def test_the_report_says_each_target_and_what_was_skipped():
    machine = check.Machine(gpu="NVIDIA H100 80GB HBM3", memory=80 * 2**30, cpus=16, ram=126 * 2**30,
                            matmul_peak=800e12, h2d=55e9, d2h=55e9, host_copy={1: 6e9, 4: 21e9}, host_update=250e9,
                            io_threads=16, preset="h100-sxm")
    spec = check.gpu_spec(machine)
    budget = check.Budget(480, check.SECTION_ENDS, now=FakeClock())
    budget.skipped.append("llama-3.1-8b: its store's set-up and one step: needs about 150 s, 20 s were left")
    tests = [check.TestRow("test_a", "passed", "x: 1", ""), check.TestRow("test_b", "failed", "", "assert 1 == 2")]
    text = check.report(machine, spec, [_result(spec)], tests, budget, 2048, ["a note"])
    assert text.startswith("# gpu-check\n")
    targets = text.split("## Targets")[1].split("## gptj-6b")[0]
    assert "| step at 1 x 2048 <= 1.25 x its floor | " in targets
    assert "| update on the host no slower than on the device | met: 1.90 s vs 2.10 s |" in targets
    assert "NOT met: worst +10% (1 x 2048, device)" in targets  # the allocator's peak over the planner's
    assert ">= 350 model TFLOP/s at the best batch | NOT met:" in targets
    assert "| 16 x 2048 | device | failed: CUDA out of memory |" in text
    assert "torch.profiler trace `gptj-6b-step.trace.json`" in text and "| H2D | 1.500 | 75% | 27% |" in text
    assert "- llama-3.1-8b: its store's set-up" in text and "- a note" in text
    assert "| test_b | failed: assert 1 == 2 |  |" in text
    assert "host copies pageable -> pinned (512 MiB): 6.0 GB/s on 1 thread, 21.0 GB/s on 4 threads" in text


def test_the_whole_script_runs_with_its_cuda_parts_replaced(monkeypatch, tmp_path):
    """main() as `make gpu-check` runs it, the GPU's measurements and model runs replaced: the budget skips the
    second model and the tests, the report says so, and it is written."""
    clock = FakeClock()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    machine = check.Machine(gpu="NVIDIA H100 80GB HBM3", memory=80 * 2**30, matmul_peak=800e12, h2d=55e9,
                            d2h=55e9, host_copy={1: 6e9}, host_update=250e9, preset="h100-sxm")
    monkeypatch.setattr(check, "measure_machine", lambda: machine)

    def one_model(model, machine, spec, budget, trace_dir, seq, profile, result):
        clock.t += 440  # the first model takes most of the budget
        filled = _result(spec)
        result.lines, result.runs, result.breakdown = filled.lines, filled.runs[:2], filled.breakdown
        raise RuntimeError("lost the GPU")  # what was measured before stays in the report

    monkeypatch.setattr(check, "check_model", one_model)
    budget = check.Budget(480, check.SECTION_ENDS, now=clock)
    monkeypatch.setattr(check, "Budget", lambda total, ends: budget)
    out = tmp_path / "GPU_CHECK.md"
    assert check.main(["--output", str(out), "--trace-dir", str(tmp_path / "traces")]) == 1
    text = out.read_text()
    assert "- gptj-6b failed: RuntimeError: lost the GPU" in text and "| 1 x 2048 | host | 1.90 s (1) |" in text
    assert "## gptj-6b" in text and "## llama-3.1-8b" not in text
    assert "- llama-3.1-8b: its store's set-up and one step: needs about 150 s" in text
    assert "- tests: tests/test_cuda.py: needs about 60 s" in text
    assert DEVICE_PRESETS["h100-sxm"].name in text or "preset h100-sxm" in text


def test_a_models_whole_check_on_a_cpu(tmp_path):
    """check_model's path (set-up, 1 x seq on the device's schedule, the profiled step, the update on the host,
    the planner's largest batch) on a CPU with a tiny model; its rows then make the report's targets."""
    # 90% of 900 MiB, less h100-sxm's CUDA context (723 MiB) and cuBLAS's workspaces (66 MiB): room for a few rows.
    machine = check.Machine(gpu="cpu", memory=900 * 2**20, matmul_peak=50e9, h2d=10e9, d2h=10e9,
                            host_copy={1: 5e9}, host_update=5e9, preset="h100-sxm")
    spec = check.gpu_spec(machine)
    budget = check.Budget(600, {"gptj-debug": 1.0})
    result = check.check_model("gptj-debug", machine, spec, budget, tmp_path, 16, profile=True, device="cpu")
    assert result.lines[0].startswith("- store: fp32 Adam moments") and "--pin-memory register" in result.lines[1]
    first, host = result.runs[:2]
    assert (first.batch, first.update_on, len(first.step_s)) == (1, "device", 2)
    assert (host.batch, host.update_on, len(host.step_s)) == (1, "host", 1)
    assert first.ledger_peak > 0 and first.prediction.config.seq == 16
    assert [r.batch for r in result.runs[2:]] and result.runs[-1].batch > 1 and result.runs[-1].step_s
    assert (tmp_path / result.trace_file).is_file()
    assert {p.name for p in result.breakdown} >= {"compute", "H2D", "host update", "waits (no compute kernel)"}
    rows = "\n".join(check.target_rows([result], 16))
    assert "unmeasured" not in rows and rows.count("met") >= 5
