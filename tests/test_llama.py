"""The Llama family (llama, mistral, qwen2, qwen3) against transformers' own classes: configs, logits, streamed
training, and a folder transformers wrote trained and exported through the CLI."""
from __future__ import annotations

import dataclasses
import json
import re
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from layers import PRESETS, ConfigError, LlamaConfig, MistralConfig, ModelConfig, Qwen2Config, Qwen3Config, resident_model
from memory_model import PlanConfig, device_spec, plan
from streamer import StreamingTrainer, TrainerConfig
from streamer.cli.generate import open_trainer
from streamer.generate import Sampling, generate
from streamer.run_dir import RunDir
from streamer.calibration.dryrun import dry_run
from tests.conftest import randomize_
from tests.test_cli import run_cli
from tests.test_runtime import hf_reference

_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)
LLAMA3 = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
# Each variation the family has: GQA with llama3, linear and dynamic RoPE and Llama's optional biases, Mistral's
# window (no shorter than the sequences here), Qwen2's q/k/v biases, Qwen3's q/k norms and head_dim.
CONFIGS = {
    "llama-llama3-biases": LlamaConfig(**_TINY, rope_parameters=LLAMA3, attention_bias=True, mlp_bias=True),
    "llama-linear": LlamaConfig(**_TINY, rope_parameters={"rope_theta": 10000.0, "rope_type": "linear",
                                                          "factor": 2.0}),
    "llama-dynamic": LlamaConfig(**_TINY, rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic",
                                                           "factor": 2.0}),
    "mistral": MistralConfig(**_TINY, sliding_window=32),
    "qwen2": Qwen2Config(**_TINY),
    "qwen3": Qwen3Config(**{**_TINY, "num_key_value_heads": 1}, head_dim=16),
}


def hf_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, attn: str = "eager",
             seed: int = 0) -> transformers.PreTrainedModel:
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attn).eval()
    randomize_(model, seed)
    return model.to(dtype)


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
    assert cfg.context() == (16, "sliding_window=16; attention over a sliding window is not supported")
    with StreamingTrainer(cfg, TrainerConfig.of(dtype="fp32", store="ram")) as trainer:
        with pytest.raises(Exception, match="sliding_window=16"):
            trainer.step(torch.zeros(1, 17, dtype=torch.int64), torch.zeros(1, 17, dtype=torch.int64))


@pytest.mark.parametrize("name", CONFIGS)
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


@pytest.mark.parametrize("name", CONFIGS)
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


@pytest.mark.parametrize("name", ["llama-llama3-biases", "qwen3"])
def test_cli_trains_a_transformers_folder_and_exports_what_transformers_loads(capsys, tmp_path, tiny_setup, name):
    """`streamer train --from-pretrained` on a folder transformers wrote, then `streamer export`: transformers
    loads the export with our logits, and greedy generation with the grouped-query KV cache is transformers'."""
    cfg = dataclasses.replace(CONFIGS[name], vocab_size=512, max_position_embeddings=64)
    hf_model(cfg).save_pretrained(tmp_path / "hf")
    run, out = tmp_path / "run", tmp_path / "out"
    rc, _, err = run_cli(capsys, "train", "--from-pretrained", tmp_path / "hf", "--data", tiny_setup / "train.txt",
                         "--tokenizer", tiny_setup / "tok", "--run-dir", run, "--steps", 2, "--batch", 2,
                         "--seq", 16, "--dtype", "fp32", "--sample-tokens", 0, "--eval-fraction", 0)
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "export", run, out)
    assert rc == 0, err
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(exported).__name__ == cfg.architecture
    assert_export_is_transformers(cfg, run, out, exported)


def assert_export_is_transformers(cfg: ModelConfig, run: Path, out: Path,
                                  exported: transformers.PreTrainedModel) -> None:
    """The run's weights are the export's; its logits are within 2x transformers' own fp32 noise against
    float64, and its greedy generation with the KV cache is transformers'."""
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    with open_trainer(RunDir(run)) as trainer:
        state = trainer.state_dict()
        ours_generated = generate(trainer, ids[:, :4], Sampling(12, temperature=0.0))
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in exported.state_dict().items()}
    exact = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    with torch.no_grad():
        reference = exact(ids).logits
        noise = (exported(ids).logits.double() - reference).abs().max().item()
        ours = resident_model(cfg, init=False)
        ours.load_hf_state_dict(state)
        error = (ours(ids).double() - reference).abs().max().item()
        theirs_generated = exported.generate(ids[:, :4], max_new_tokens=12, do_sample=False)
    assert error <= 2 * noise + 1e-6, (error, noise)
    assert ours_generated.tolist() == theirs_generated.tolist()


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


def test_lora_on_every_projection_exports_what_peft_loads(capsys, tmp_path, tiny_setup):
    """--lora-targets with the family's names (q/k/v/o_proj, gate/up/down_proj): PEFT loads the adapter on
    transformers' model with the logits of our merged weights."""
    peft = pytest.importorskip("peft")
    cfg = dataclasses.replace(CONFIGS["llama-llama3-biases"], vocab_size=512, max_position_embeddings=64)
    hf_model(cfg).save_pretrained(tmp_path / "hf")
    run, adapter = tmp_path / "run", tmp_path / "adapter"
    rc, _, err = run_cli(capsys, "train", "--from-pretrained", tmp_path / "hf", "--data", tiny_setup / "train.txt",
                         "--tokenizer", tiny_setup / "tok", "--run-dir", run, "--steps", 3, "--batch", 2,
                         "--seq", 16, "--dtype", "fp32", "--sample-tokens", 0, "--eval-fraction", 0, "--lr", "1e-2",
                         "--lora-rank", 4, "--lora-alpha", 8, "--lora-targets", ",".join(cfg.projections))
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "export", run, adapter, "--format", "peft")
    assert rc == 0, err
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        base_logits = base(ids).logits
    loaded = peft.PeftModel.from_pretrained(base, adapter).eval()
    with open_trainer(RunDir(run)) as trainer:
        ours = resident_model(cfg, init=False)
        ours.load_hf_state_dict(trainer.state_dict())
    with torch.no_grad():
        expected = ours(ids)
        assert (base_logits - expected).abs().max().item() > 1e-2  # the adapters changed the model
        error = (loaded(input_ids=ids).logits - expected).abs().max().item()
    assert error <= 1e-4, error


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
    (setup / "config.json").write_text(json.dumps(cfg.to_hf()))
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
