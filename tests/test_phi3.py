"""What is Phi-3's own beyond tests/test_families.py: longrope's two sets of frequencies against transformers on
both sides of original_max_position_embeddings (whole sequences, packed rows, and generation whose KV cache
crosses it), the embedding's padding row, LoRA's default targets for a family with no q_proj, and the presets'
published parameter counts."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from layers import PRESETS, GPTJConfig, KVCache, ModelConfig, Phi3Config, resident_model
from layers.rotary import positions_sincos, rows_sincos
from memory_model.lora import LoraConfig, targets_of
from streamer import StreamingTrainer, TrainerConfig
from streamer.generate import Sampling, generate
from tests.test_cli import run_cli
from tests.test_families import hf_model

HUB = Path(__file__).parent / "hub_configs"


def longrope_example() -> Phi3Config:
    """Phi-3.5-mini's published longrope factors on a tiny model pretrained on 16 positions, extended to 64."""
    published = ModelConfig.from_hf(HUB / "phi-3.5-mini-instruct.json")
    head_dim = 2 * len(published.rope["short_factor"])  # 96, as published
    return dataclasses.replace(published, vocab_size=96, hidden_size=2 * head_dim, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=head_dim, max_position_embeddings=64, original_max_position_embeddings=16,
                               sliding_window=None, pad_token_id=0)


@pytest.mark.parametrize("length", [1, 16, 17, 40, 64])
def test_longrope_tables_are_transformers_on_both_sides_of_the_original_context(length: int) -> None:
    """sin and cos of the short factors up to 16 positions, of the long ones past it, both times the attention
    factor sqrt(1 + ln(64/16) / ln 16): transformers' Phi3RotaryEmbedding for the whole sequence, and for packed
    rows (picked by the batch's longest position). Measured: equal to the last bit; held within one float32
    rounding of the largest value."""
    cfg = longrope_example()
    theirs = Phi3RotaryEmbedding(transformers.AutoConfig.for_model(**cfg.adapter().to_hf()))
    half = cfg.rotary_dim // 2
    bound = 2 * torch.finfo(torch.float32).eps * 1.2  # the attention factor is 1.2247
    cos_hf, sin_hf = (t[0, :, :half] for t in theirs(torch.zeros(1, length, 1), torch.arange(length)[None]))
    sin, cos = positions_sincos(cfg.max_position_embeddings, cfg.rotary_dim, 0, length, torch.float32,
                                torch.device("cpu"), cfg.rope_parameters)
    assert (sin - sin_hf).abs().max() <= bound and (cos - cos_hf).abs().max() <= bound
    assert cos.abs().max().item() > 1.2  # the attention factor is there
    rows = torch.arange(length).flip(0)[None]  # positions out of order: the longest one picks the set
    sin_rows, cos_rows = rows_sincos(cfg.max_position_embeddings, cfg.rotary_dim, rows, torch.float32,
                                     cfg.rope_parameters)
    cos_hf, sin_hf = (t[0, :, :half] for t in theirs(torch.zeros(1, length, 1), rows))
    assert (sin_rows[0] - sin_hf).abs().max() <= bound and (cos_rows[0] - cos_hf).abs().max() <= bound


def test_older_names_of_longrope_are_longrope() -> None:
    """Phi-3's first files call it `su` (and some `yarn`); transformers' Phi-3 reads both as longrope."""
    raw = json.loads((HUB / "phi-3.5-mini-instruct.json").read_text())
    for name in ("su", "yarn"):
        renamed = {**raw, "rope_scaling": {**raw["rope_scaling"], "type": name}}
        assert ModelConfig.from_hf(renamed) == ModelConfig.from_hf(raw)


def test_the_two_sets_differ() -> None:
    """The test above could not pass with one set for both regimes: the long factors move position 15's angles."""
    cfg = longrope_example()
    short = positions_sincos(64, cfg.rotary_dim, 15, 1, torch.float32, torch.device("cpu"), cfg.rope_parameters)
    long = positions_sincos(64, cfg.rotary_dim, 15, 2, torch.float32, torch.device("cpu"), cfg.rope_parameters)
    assert (short[0][0] - long[0][0]).abs().max().item() > 0.1


def phi4_mini_like(**sizes: int) -> Phi3Config:
    """Phi-4-mini's variations as its config.json spells them (reconstructed: no published copy was found):
    `partial_rotary_factor` 0.75 at the top level, longrope under `rope_scaling`, tied embeddings."""
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    half = int(head_dim * 0.75) // 2
    return ModelConfig.from_hf({  # type: ignore[return-value]
        "model_type": "phi3", **sizes, "max_position_embeddings": 32, "original_max_position_embeddings": 16,
        "partial_rotary_factor": 0.75, "tie_word_embeddings": True, "pad_token_id": 0, "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                         "long_factor": [1.5 + 2.0 * i for i in range(half)]}})


def test_phi4_mini_s_shape_is_transformers() -> None:
    """At Phi-4-mini's sizes: 96 of each head's 128 dims rotated, and transformers' parameter count."""
    cfg = phi4_mini_like(vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                         num_attention_heads=24, num_key_value_heads=8)
    assert cfg.rotary_dim == 96
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**cfg.adapter().to_hf()))
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters()) == 3_836_021_760


TINY_PHI4_MINI = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("model", ["example", "phi4-mini-like"])
@pytest.mark.parametrize("length", [16, 24])
def test_logits_are_transformers_below_and_above_the_original_context(length: int, model: str) -> None:
    """The example (longrope on half of each head, a pretrained context of 16) and a tiny Phi-4-mini (three
    quarters rotated, tied) in both regimes, against transformers in float64, within twice transformers' own
    fp32 error (eager and sdpa). Measured for the example: ours 2.6e-6 and 2.0e-6, transformers' sdpa the same,
    its eager 1.5e-6 and 2.4e-6, at 16 and 24 positions."""
    cfg = Phi3Config.example() if model == "example" else phi4_mini_like(**TINY_PHI4_MINI)
    ids = torch.randint(0, cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        exact = hf_model(cfg, torch.float64)(ids).logits
        noise = max((hf_model(cfg, attn=attn)(ids).logits.double() - exact).abs().max().item()
                    for attn in ("eager", "sdpa"))
        ours = resident_model(cfg, init=False)
        ours.load_hf_state_dict(hf_model(cfg).state_dict())
        error = (ours(ids).double() - exact).abs().max().item()
    assert error <= 2 * noise, (error, noise)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_crossing_the_original_context_is_transformers_generate(tmp_path: Path, use_cache: bool) -> None:
    """A prompt of 6 tokens and 20 new ones over a pretrained context of 16: transformers' generate recomputes
    its cache once the sequence passes 16 positions (its long factors change every position's rotation), and so
    does ours; without a cache every step is the whole sequence. Greedy tokens equal."""
    cfg = Phi3Config.example().resized(max_position_embeddings=64)
    theirs = hf_model(cfg)
    with StreamingTrainer(cfg, TrainerConfig.of(dtype="fp32", store="ram"), store_dir=tmp_path / "run") as trainer:
        trainer.load_state_dict(theirs.state_dict())
        prompt = torch.randint(2, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(8))
        ours = generate(trainer, prompt, Sampling(20, temperature=0.0, use_cache=use_cache))
    with torch.no_grad():
        expected = theirs.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert ours.tolist() == expected.tolist()


def test_a_cache_kept_across_the_original_context_would_not_be_transformers(tmp_path: Path) -> None:
    """Why the cache is recomputed: keys rotated with the short factors, then queries with the long ones (what
    transformers' forward gives for a cache carried across) are not the whole sequence's long rotation."""
    cfg = Phi3Config.example().resized(max_position_embeddings=64)
    model = resident_model(cfg, init=False)
    model.load_hf_state_dict(hf_model(cfg).state_dict())
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        caches = [KVCache.empty(cfg, 1, 20, torch.float32, "cpu") for _ in range(cfg.num_hidden_layers)]
        model(ids[:, :16], 0, caches)
        carried = model(ids[:, 16:], 16, caches)[0, -1]
        whole = model(ids)[0, -1]
    assert (carried - whole).abs().max().item() > 1e-3


def test_the_padding_row_gets_no_gradient_and_starts_at_zero() -> None:
    """transformers' nn.Embedding(padding_idx=pad_token_id): the row's gradient is zero however often the token
    occurs, as ours; HF's initialisation zeroes it."""
    cfg = Phi3Config.example()
    ids = torch.tensor([[cfg.pad_token_id, 5, cfg.pad_token_id, 7, 9, cfg.pad_token_id]])
    theirs = hf_model(cfg)
    ours = resident_model(cfg, init=False)
    ours.load_hf_state_dict(theirs.state_dict())
    for model, logits_of in ((theirs, lambda m: m(ids).logits), (ours, lambda m: m(ids))):
        F.cross_entropy(logits_of(model)[0, :-1], ids[0, 1:]).backward()
    grad = ours.model.embed_tokens.weight.grad
    assert grad[cfg.pad_token_id].abs().max().item() == 0 and grad[5].abs().max().item() > 0
    assert theirs.model.embed_tokens.weight.grad[cfg.pad_token_id].abs().max().item() == 0
    assert resident_model(cfg).model.embed_tokens.weight[cfg.pad_token_id].abs().max().item() == 0


def test_lora_targets_default_to_the_family_s_own() -> None:
    """No --lora-targets: PEFT's q_proj,v_proj where the family has them, the fused qkv_proj for Phi-3 (PEFT
    names no default for phi3); named targets are kept as named."""
    lora = LoraConfig(rank=4)
    assert targets_of(Phi3Config.example(), lora) == ("qkv_proj",)
    assert targets_of(GPTJConfig.preset("gptj-debug"), lora) == ("q_proj", "v_proj")
    assert targets_of(Phi3Config.example(), LoraConfig(rank=4, targets="o_proj,down_proj")) == ("o_proj", "down_proj")


def test_a_projection_phi3_fuses_is_one_line(capsys, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.replace(Phi3Config.example(), vocab_size=512).adapter().to_hf()))
    rc, _, err = run_cli(capsys, "train", "--model", path, "--lora-rank", 4, "--lora-targets", "q_proj,v_proj",
                         "--seq", 16)
    assert rc == 2 and err.strip() == ("error: --lora-targets q_proj,v_proj is not a projection of phi3; choose "
                                       "among qkv_proj,o_proj,gate_up_proj,down_proj")


def test_presets_are_the_published_files_with_transformers_counts() -> None:
    """phi-4 (14.66B) and Phi-3-mini-4k (3.82B) as their published config.json files give them; tests/test_layers.py
    checks every preset's count and tensors against transformers' own class."""
    assert PRESETS["phi-4"] == ModelConfig.from_hf(HUB / "phi-4.json")
    assert PRESETS["phi-3-mini-4k"] == ModelConfig.from_hf(HUB / "phi-3-mini-4k-instruct.json")
    assert {name: PRESETS[name].num_params() for name in ("phi-4", "phi-3-mini-4k")} == {
        "phi-4": 14_659_507_200, "phi-3-mini-4k": 3_821_079_552}
    # Phi-3-mini-4k's window of 2047 caps the sequences whose attention is the model's
    assert PRESETS["phi-3-mini-4k"].attention().context()[0] == 2047


def test_streamer_plan_takes_the_presets(capsys) -> None:
    for name in ("phi-4", "phi-3-mini-4k"):
        rc, out, err = run_cli(capsys, "plan", "--model", name, "--target", "h100-sxm", "--batch", 1, "--seq", 2047,
                               "--json")
        assert rc == 0, err
        assert json.loads(out)["params"] == PRESETS[name].num_params()
