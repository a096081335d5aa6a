"""The Llama family through the rest of the tools GPT-J has: `streamer eval` against transformers' loss, data
parallel (replicated and sharded) equal to one process, `--budget` advice, `plan --compare`, LoRA planned to
the byte, the `local` calibration on the family's own units, and `streamer bench --model` on a tiny Llama."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

from layers import PRESETS, LlamaConfig, ModelConfig, Qwen3Config, learned_tokens
from memory_model import PlanConfig, device_spec, plan
from streamer.calibration import calibrate
from streamer.cli.generate import open_trainer
from streamer.io.data import load_dataset
from streamer.io.tokenizer import load_tokenizer
from streamer.run_dir import RunDir
from tests.test_cli import fails, run_cli
from tests.test_devices import TINY
from tests.test_llama import CONFIGS, hf_model

LLAMA = PRESETS["llama-debug"]


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, object]:
    """A Llama checkpoint folder transformers wrote (GQA, llama3 RoPE, biases), of the tiny tokenizer's
    vocabulary."""
    cfg = dataclasses.replace(CONFIGS["llama-llama3-biases"], vocab_size=512, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("llama") / "hf"
    hf_model(cfg).save_pretrained(folder)
    return cfg, folder


def _train(capsys, folder, tiny_setup, run, *extra: object) -> None:
    rc, _, err = run_cli(capsys, "train", "--from-pretrained", folder, "--data", tiny_setup / "train.txt",
                         "--tokenizer", tiny_setup / "tok", "--run-dir", run, "--batch", 2, "--seq", 16,
                         "--dtype", "fp32", "--sample-tokens", 0, "--eval-fraction", 0, "--eval-every", 0, *extra)
    assert rc == 0, err


def test_eval_is_the_loss_transformers_computes(capsys, tmp_path, tiny_setup, llama_folder):
    """`streamer eval` of a trained Llama run: transformers' loss of the same weights on the same sequences,
    weighted by their predicted tokens."""
    cfg, folder = llama_folder
    run, held_out = tmp_path / "run", tmp_path / "held-out.txt"
    held_out.write_text((tiny_setup / "train.txt").read_text()[:1500])
    _train(capsys, folder, tiny_setup, run, "--steps", 1)
    rc, out, err = run_cli(capsys, "eval", run, "--data", held_out, "--batch", 3)
    assert rc == 0, err
    loss = float(re.search(r"loss ([\d.]+), perplexity", out).group(1))
    with open_trainer(RunDir(run)) as trainer:
        state = trainer.state_dict()
    hf = hf_model(cfg)
    hf.load_state_dict(state)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids, labels, _, _ in load_dataset(held_out, load_tokenizer(RunDir(run).tokenizer), 16).batches(3):
            count = learned_tokens(labels)
            total, tokens = total + hf(ids, labels=labels).loss.item() * count, tokens + count
    assert tokens > 100 and math.isfinite(loss)
    assert loss == pytest.approx(total / tokens, abs=1e-4)  # eval prints 4 decimals


@pytest.mark.slow
@pytest.mark.parametrize("data_parallel,store", [("replicated", "disk"), ("sharded", "ram")])
def test_two_gloo_ranks_equal_one_process(tmp_path, data_parallel, store):
    """Two data-parallel processes training llama-debug (grouped-query attention) equal one process on the same
    global batch, and each rank's device peak is the planner's."""
    from tests.test_distributed import TC, _max_diff, run_data_parallel, single_process

    tc = TC.replace(data_parallel=data_parallel, store=store)
    ranks = run_data_parallel(tmp_path, [("new", 2)], tc, LLAMA)
    reference = single_process(tmp_path, 2, tc.replace(data_parallel="replicated"), LLAMA)
    assert _max_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0
    assert _max_diff(ranks[0]["state"], reference["state"]) <= 1e-5  # as GPT-J's (test_distributed.py)
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], abs=2e-6)
    planned = plan(LLAMA, device_spec("h100-sxm"), PlanConfig.of(
        batch=4, seq=32, compute_dtype="fp32", store=store, update_chunk=10_000, devices=2,
        data_parallel=data_parallel)).peak_device_bytes
    assert [r["peak"] for r in ranks] == [planned, planned]


def test_a_budget_too_small_is_advised_and_the_first_alternative_trains(capsys, tmp_path):
    base = ["train", "--model", "llama-debug", "--batch", 8, "--seq", 64, "--run-dir", tmp_path / "run", "--steps",
            1, "--sample-tokens", 0, "--eval-every", 0, "--dtype", "fp32"]
    message = fails(capsys, *base, "--budget", "1MiB")
    assert "by the planner" in message and not (tmp_path / "run").exists()
    first = re.search(r"one of: (--[a-z-]+ [^;\s]+)", message).group(1).split()
    budget = ["--budget", first[1]] if first[0] == "--budget" else ["--budget", "1MiB", *first]
    rc, _, err = run_cli(capsys, *base, *budget)
    assert rc == 0, err


def test_plan_compare_replays_a_llama_run(capsys, tmp_path, tiny_setup, llama_folder, monkeypatch):
    """`plan --compare` on a Llama run: the planner's device peak is the run's to the byte, and its step time
    is priced on the `local` calibration of the Llama's own units."""
    monkeypatch.setattr(calibrate, "DEFAULT_SIZES", TINY)
    monkeypatch.chdir(tmp_path)  # the local calibration is cached under ./runs
    _, folder = llama_folder
    run = tmp_path / "run"
    _train(capsys, folder, tiny_setup, run, "--steps", 2)
    rc, out, err = run_cli(capsys, "plan", "--compare", run, "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["predicted_step_s"] > 0 and result["measured_step_s"] > 0
    assert result["predicted_peak_bytes"] == result["measured_peak_bytes"]
    cached = json.loads((tmp_path / "runs" / calibrate.CACHE_NAME).read_text())["entries"]
    assert [json.loads(key)["probe"]["model_type"] for key in cached] == ["llama"]


def test_calibration_measures_the_familys_own_units(tmp_path):
    """`local` measures a Llama's kernel costs on a Llama block narrowed in whole groups of query heads, and its
    fixed costs on tiny Llamas: a GPT-J probe would time LayerNorm and GELU instead of RMSNorm and SwiGLU."""
    from streamer.calibration.host_costs import (HostCosts, _tiny, measure_fixed_costs, measure_flush,
                                                 measure_page_cache)

    sizes = calibrate.CalibrationSizes()
    probe = calibrate.probe_shape(PRESETS["llama-3.1-8b"], sizes)
    assert isinstance(probe, LlamaConfig) and probe.rope == PRESETS["llama-3.1-8b"].rope
    assert (probe.hidden_size, probe.num_attention_heads, probe.num_key_value_heads, probe.head_dim,
            probe.intermediate_size, probe.vocab_size, probe.num_hidden_layers) == (1024, 8, 2, 128, 3584, 128256, 1)
    qwen3 = calibrate.probe_shape(PRESETS["qwen3-8b"], sizes)
    assert isinstance(qwen3, Qwen3Config) and qwen3.num_attention_heads == 8
    tiny = _tiny(PRESETS["qwen3-8b"], 5)
    assert isinstance(tiny, Qwen3Config) and (tiny.num_hidden_layers, tiny.num_key_value_heads) == (5, 1)
    fixed = measure_fixed_costs(LLAMA, torch.float32, tmp_path, 1e9, steps=1)
    assert fixed["ram"][2] == 0.0 and fixed["disk"][2] > 0.0  # only the disk tier writes state files
    host = HostCosts(*fixed["ram"][:2], *fixed["disk"][:2], measure_page_cache(tmp_path, 2**16, 1),
                     measure_flush(tmp_path, 1), fixed["disk"][2])
    costs = calibrate.measure_kernel_costs("fp32", 1e10, 2**12, 1, calibrate.probe_shape(LLAMA, TINY), 16, host)
    assert costs.attention_forward_flops > 0 and costs.embedding_backward_s > 0 and costs.event_s == fixed["ram"][0]


def test_bench_runs_every_contender_on_a_llama(tmp_path):
    """`streamer bench --quick --model llama-debug`: its settings keep the family (the second size and the scale
    run included), and each kind of contender (streamed, resident, transformers' LlamaForCausalLM) measures a step of
    it."""
    import argparse

    from benchmarks import bench
    from benchmarks.worker import RunSpec, measure

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    settings = bench.Settings.from_args(parser.parse_args(["--quick", "--model", "llama-debug"]))
    assert settings.model == "llama-debug" and isinstance(settings.second, LlamaConfig)
    assert (settings.second.hidden_size, settings.second.num_hidden_layers, settings.second.num_key_value_heads) \
        == (48, 1, 1)
    assert settings.scale_model == "llama-debug"
    specs, _ = bench._main_specs(LLAMA, settings)
    assert {ModelConfig.from_dict(s.model) for s in specs} == {LLAMA}
    for contender in ("stream", "resident", "hf"):
        spec = RunSpec(label=contender, contender=contender, model=LLAMA.to_dict(), batch=1, seq=16, dtype="fp32",
                       warmup=0, steps=1, workdir=str(tmp_path / contender))
        result = measure(spec)
        assert result.ok and len(result.step_s) == 1 and math.isfinite(result.losses[0]), contender
        assert result.params == LLAMA.num_params()
