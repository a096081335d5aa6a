"""The Llama family (llama, mistral, qwen2, qwen3) beyond what tests/test_families.py holds for every family:
configs as transformers saves and publishes them, RoPE's linear and dynamic scalings, streamed training on each
tier and option against transformers, the planner over the option matrix, and a killed run continued."""
from __future__ import annotations

import dataclasses
import json
import re
import signal

import pytest
import torch
import torch.nn.functional as F

from layers.llama.config import TINY
from layers import (PRESETS, ConfigError, LlamaConfig, MistralConfig, ModelConfig, Qwen2Config, Qwen3Config,
                    resident_model)
from memory_model import PlanConfig, device_spec, plan
from streamer import StreamingTrainer, TrainerConfig
from streamer.calibration.dryrun import dry_run
from tests.test_cli import run_cli
from tests.test_families import hf_model
from tests.test_runtime import hf_reference

_TINY = TINY
LLAMA3 = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
# Each variation the family has: each model_type's example() (tests/test_families.py holds those to
# transformers), and the linear and dynamic RoPE scalings, held here.
CONFIGS = {
    "llama-llama3-biases": LlamaConfig.example(),
    "llama-linear": LlamaConfig(**_TINY, rope_parameters={"rope_theta": 10000.0, "rope_type": "linear",
                                                          "factor": 2.0}),
    "llama-dynamic": LlamaConfig(**_TINY, rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic",
                                                           "factor": 2.0}),
    "mistral": MistralConfig.example(),
    "qwen2": Qwen2Config.example(),
    "qwen3": Qwen3Config.example(),
}
SCALINGS = ["llama-linear", "llama-dynamic"]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_survives_transformers_save_and_read(tmp_path, name):
    cfg = CONFIGS[name]
    hf_model(cfg).config.save_pretrained(tmp_path)
    assert ModelConfig.from_hf(tmp_path) == cfg
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # the store manifest's round trip


def test_published_rope_scaling_keys_are_read():
    """Published configs carry rope_theta and rope_scaling (with `type` in older ones) instead of
    rope_parameters."""
    raw = {"model_type": "llama", **_TINY, "rope_theta": 500000.0,
           "rope_scaling": {**{k: v for k, v in LLAMA3.items() if k not in ("rope_theta", "rope_type")},
                            "type": "llama3"}}
    assert ModelConfig.from_hf(raw) == CONFIGS["llama-llama3-biases"].__class__(**_TINY, rope_parameters=LLAMA3)


@pytest.mark.parametrize("raw,message", [
    ({"model_type": "gpt2"}, "model_type is 'gpt2'; supported: 'gptj', 'llama', 'mistral', 'qwen2', 'qwen3'"),
    ({"model_type": "llama", **_TINY, "tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"model_type": "llama", **_TINY, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"model_type": "llama", **_TINY, "num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"model_type": "mistral", **_TINY, "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_unsupported_configs_get_one_line(raw, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        ModelConfig.from_hf(raw)
    assert "\n" not in str(info.value)


def test_a_sliding_window_shorter_than_the_sequence_is_refused():
    cfg = MistralConfig(**_TINY, sliding_window=16)
    assert cfg.attention().context() == (16, "sliding_window=16; attention over a sliding window is not supported")
    with StreamingTrainer(cfg, TrainerConfig.of(dtype="fp32", store="ram")) as trainer:
        with pytest.raises(Exception, match="sliding_window=16"):
            trainer.step(torch.zeros(1, 17, dtype=torch.int64), torch.zeros(1, 17, dtype=torch.int64))


@pytest.mark.parametrize("name", SCALINGS)
def test_logits_equal_transformers_within_its_fp32_noise(name):
    cfg = CONFIGS[name]
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    exact = hf_model(cfg, torch.float64)(ids).logits
    noise = max((hf_model(cfg, attn=attn)(ids).logits.double() - exact).abs().max().item()
                for attn in ("eager", "sdpa"))
    ours = resident_model(cfg, init=False)
    ours.load_hf_state_dict(hf_model(cfg).state_dict())
    with torch.no_grad():
        error = (ours(ids).double() - exact).abs().max().item()
    assert error <= 2 * noise, (error, noise)
    assert exact.abs().max() > 1.0  # logits of unit size: the comparison sees every part of the model


@pytest.mark.parametrize("name", SCALINGS)
def test_gradients_equal_transformers_within_its_fp32_noise(name):
    """Every variation's gradients, parameter by parameter. Weights after a few AdamW steps (the test below) are a
    noisier measure: where an element's gradients nearly cancel between steps, AdamW turns their rounding into
    its update, and transformers' own eager and sdpa kernels then differ from float64 by 1e-7 to 1e-4 with the
    seed of the data."""
    cfg = CONFIGS[name]
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))

    def gradients(model: torch.nn.Module, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        return {k: p.grad.double() for k, p in model.named_parameters()}

    def hf(dtype: torch.dtype, attn: str = "eager") -> dict[str, torch.Tensor]:
        model = hf_model(cfg, dtype, attn)
        return gradients(model, model(ids).logits)

    exact = hf(torch.float64)
    noise = [hf(torch.float32, attn) for attn in ("eager", "sdpa")]
    ours = resident_model(cfg, init=False)
    ours.load_hf_state_dict(hf_model(cfg).state_dict())
    mine = gradients(ours, ours(ids))
    for k in exact:
        bound = max((n[k] - exact[k]).abs().max().item() for n in noise)
        assert (mine[k] - exact[k]).abs().max().item() <= 2 * bound, k


@pytest.mark.parametrize("name,store,options", [
    ("llama-llama3-biases", "ram", {}), ("qwen2", "disk", {}), ("qwen3", "ram", {}), ("mistral", "disk", {}),
    ("qwen2", "ram", {"grad_accum": 2}), ("qwen3", "disk", {"activations": "checkpoint"}),
    ("llama-llama3-biases", "disk", {"update_on": "host", "activations": "checkpoint", "grad_accum": 2})])
def test_streamed_training_equals_transformers_and_adamw(tmp_path, name, store, options):
    cfg = CONFIGS[name]
    tc = TrainerConfig.of(lr=1e-3, max_grad_norm=1.0, weight_decay=0.1, dtype="fp32", store=store,
                          update_chunk=1000, **options)
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(3)]
    start = {k: v.clone() for k, v in hf_model(cfg).state_dict().items()}
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.load_state_dict(start)
        losses = [trainer.step(ids, ids) for ids in data]
        state = {k: v.double() for k, v in trainer.state_dict().items()}
    steps = [(ids, ids) for ids in data]
    exact, exact_losses = hf_reference(start, steps, tc, cfg)
    # k_proj's bias has an exact gradient of zero (it shifts all of a query's scores alike), so Adam turns
    # rounding noise into its update: it is held to lr per step instead.
    compared = [k for k in exact if not k.endswith("k_proj.bias")]
    assert all((state[k] - exact[k]).abs().max() <= 3 * tc.optimizer.lr for k in exact)
    # transformers' own fp32 noise: its eager and sdpa kernels against the same steps in float64.
    noise = max(max((s[k].double() - exact[k]).abs().max().item() for k in compared)
                for s, _ in (hf_reference(start, steps, tc, cfg, torch.float32, attn) for attn in ("eager", "sdpa")))
    error = max((state[k] - exact[k]).abs().max().item() for k in compared)
    assert error <= 2 * noise, (error, noise)
    assert losses == pytest.approx(exact_losses, abs=1e-5)


@pytest.mark.parametrize("dtype,activations,store", [("bf16", "resident", "ram"), ("fp32", "checkpoint", "ram"),
                                                     ("bf16", "checkpoint", "disk"), ("fp32", "resident", "disk"),
                                                     ("bf16", "offload", "ram"), ("fp32", "offload", "disk")])
def test_planner_dry_run_and_real_run_agree_to_the_byte(tmp_path, dtype, activations, store):
    """GQA, SwiGLU and RMSNorm in the planner's activation formulas: measured equal on every category."""
    cfg = PRESETS["llama-debug"]
    tc = TrainerConfig.of(dtype=dtype, activations=activations, update_chunk=20_000, store=store)
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.step(torch.randint(0, cfg.vocab_size, (2, 48)))
        real = trainer.ledger.peak, dict(trainer.ledger.peak_breakdown)
    dry = dry_run(cfg, tc, 2, 48)
    planned = plan(cfg, device_spec("h100-sxm"), PlanConfig.of(batch=2, seq=48, compute_dtype=dtype,
                                                           activations=activations, update_chunk=20_000, store=store))
    assert real[0] == dry.peak == planned.peak_device_bytes
    assert real[1] == dict(dry.peak_breakdown)


def test_presets_have_the_published_parameter_counts():
    """The counts the issue quotes for the published checkpoints; Qwen3-8B's card says 8.2B, and this is its
    shape's count (tests/test_layers.py checks every preset's count against transformers' own class)."""
    counts = {"llama-3.1-8b": 8_030_261_248, "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512,
              "qwen3-8b": 8_190_735_360}
    assert {name: PRESETS[name].num_params() for name in counts} == counts


def test_a_projection_of_another_family_is_one_line(capsys):
    rc, _, err = run_cli(capsys, "train", "--model", "llama-debug", "--lora-rank", 4, "--lora-targets", "fc_in")
    assert rc == 2 and err.strip() == ("error: --lora-targets fc_in is not a projection of llama; choose among "
                                       "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")


@pytest.mark.slow
def test_a_run_killed_mid_step_continues_bit_identically(tmp_path, tiny_setup):
    """SIGKILL after the first step's record, then the same command: the weights and losses of an
    uninterrupted run, bit for bit (grouped-query attention and Qwen3's q/k norms on the disk tier)."""
    from tests.test_lifecycle import assert_same_run, kill_when, metric_lines, streamer, train_argv

    setup = tmp_path / "setup"
    setup.mkdir()
    cfg = dataclasses.replace(CONFIGS["qwen3"], vocab_size=512, max_position_embeddings=64)
    (setup / "config.json").write_text(json.dumps(cfg.adapter().to_hf()))
    for name in ("train.txt", "tok"):
        (setup / name).symlink_to(tiny_setup / name)
    reference, run = tmp_path / "reference", tmp_path / "run"
    done = streamer(*train_argv(setup, reference))
    assert done.returncode == 0, done.stderr
    argv = train_argv(setup, run)
    assert kill_when(argv, lambda: metric_lines(run) >= 1).returncode == -signal.SIGKILL
    done = streamer(*argv)
    assert done.returncode == 0 and "continuing it to step" in done.stdout, done.stderr
    assert_same_run(run, reference)
