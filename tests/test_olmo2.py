"""What is OLMo 2's own (tests/test_families.py holds its example against transformers like every family's): its
presets' counts, the padding row transformers never trains, its fp32 norms and RoPE under bf16, and a config's
padding row where a probe's vocabulary is smaller."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F

from layers import PRESETS, ConfigError, ModelConfig, Olmo2Config, build_unit, resident_model
from layers.olmo2 import units
from layers.rotary import apply_rotary_halves, positions_sincos
from streamer import StreamingTrainer, TrainerConfig
from tests.test_families import hf_model

HUB = Path(__file__).parent / "hub_configs"


def test_presets_have_the_published_parameter_counts():
    """OLMo-2-1124-7B is 7.30B and 13B 13.7B (tests/test_layers.py checks every preset against transformers' own
    class); the 7B preset is the published config.json's model."""
    counts = {"olmo-2-7b": 7_298_617_344, "olmo-2-13b": 13_716_198_400}
    assert {name: PRESETS[name].num_params() for name in counts} == counts
    assert ModelConfig.from_hf(HUB / "olmo-2-1124-7b.json") == PRESETS["olmo-2-7b"]


def test_the_padding_row_gets_no_gradient_and_starts_at_zero_as_in_transformers():
    """pad_token_id's embedding row: zero at initialisation and never a gradient, as transformers' nn.Embedding
    with padding_idx; the other rows' gradients are transformers'."""
    cfg = Olmo2Config.example()
    assert not resident_model(cfg).model.embed_tokens.weight[cfg.pad_token_id].any()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ids[:, ::5] = cfg.pad_token_id
    theirs = hf_model(cfg, torch.float64)
    ours = resident_model(cfg, init=False)
    ours.load_hf_state_dict(hf_model(cfg).state_dict())

    def embedding_gradient(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
        F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), ids[:, 1:].flatten()).backward()
        return model.model.embed_tokens.weight.grad.double()

    mine, exact = embedding_gradient(ours, ours(ids)), embedding_gradient(theirs, theirs(ids).logits)
    assert not mine[cfg.pad_token_id].any() and not exact[cfg.pad_token_id].any()
    assert exact.abs().max() > 1e-3 and (mine - exact).abs().max() <= 1e-6 * exact.abs().max()


def test_a_streamed_step_leaves_the_padding_row_alone(tmp_path: Path):
    """The runtime's embedding unit is the same nn.Embedding: without weight decay, a streamed AdamW step on
    rows half of the padding token moves every other row it sees and not the padding row."""
    cfg = Olmo2Config.example()
    tc = TrainerConfig.of(lr=1e-2, weight_decay=0.0, dtype="fp32", store="ram")
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ids[:, ::2] = cfg.pad_token_id
    start = {k: v.clone() for k, v in hf_model(cfg).state_dict().items()}
    with StreamingTrainer(cfg, tc, store_dir=tmp_path / "run") as trainer:
        trainer.load_state_dict(start)
        trainer.step(ids, ids)
        moved = trainer.state_dict()["model.embed_tokens.weight"] != start["model.embed_tokens.weight"]
    assert not moved[cfg.pad_token_id].any()
    # (a row's last token predicts nothing: its embedding has no gradient either)
    assert all(moved[token].all() for token in ids[:, :-1].unique().tolist() if token != cfg.pad_token_id)


def test_bf16_logits_are_transformers_within_its_own_bf16_noise():
    """In bf16 the logits are within twice transformers' own bf16 error (eager and sdpa against float64). The
    bound is loose (measured 0.05 of 0.05 to 0.09): the fp32 norms and RoPE are checked apart below."""
    cfg = Olmo2Config.example()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        exact = hf_model(cfg, torch.float64)(ids).logits
        noise = max((hf_model(cfg, torch.bfloat16, attn)(ids).logits.double() - exact).abs().max().item()
                    for attn in ("eager", "sdpa"))
        ours = resident_model(cfg, init=False)
        ours.load_hf_state_dict(hf_model(cfg).state_dict())
        error = (ours.to(torch.bfloat16)(ids).double() - exact).abs().max().item()
    assert error <= 2 * noise, (error, noise)


def test_the_padding_row_must_be_in_the_vocabulary_and_a_smaller_probe_has_none():
    message = "pad_token_id must be a token id below vocab_size (96) or null, got 96"
    with pytest.raises(ConfigError, match=re.escape(message)):
        dataclasses.replace(Olmo2Config.example(), pad_token_id=96)
    probe = PRESETS["olmo-2-7b"].resized(vocab_size=64, hidden_size=32)
    assert probe.pad_token_id is None and probe.vocab_size == 64
    assert PRESETS["olmo-2-7b"].resized(vocab_size=100300).pad_token_id == 100277


def _bf16_match(ours: torch.Tensor, exact: torch.Tensor) -> float:
    """The share of bf16 elements equal to the float64 result rounded once to bf16."""
    return (ours == exact.to(torch.bfloat16)).double().mean().item()


def test_in_bf16_the_norm_and_rope_round_once():
    """transformers' Olmo2RMSNorm multiplies its weight in fp32 and its RoPE rotates with fp32 tables, each
    rounding once to bf16. Measured: q after q_norm is the float64 result rounded once in every element, after
    RoPE in all but 0.03% (fp32's own rounding), where Llama's norm (cast before the weight) matches 74% and a
    rotation with bf16 tables 82%."""
    cfg = Olmo2Config.example()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, cfg.hidden_size, generator=g).to(torch.bfloat16)
    block = build_unit(cfg, "block.0", "cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + noise / 4 if p.ndim == 1 else noise / p.shape[1] ** 0.5)  # norm gains about 1
    attention = block.self_attn
    seen: dict[str, torch.Tensor] = {}
    attention.q_norm.register_forward_hook(lambda m, args, out: seen.update(q_in=args[0], q_normed=out))
    with torch.no_grad(), patch.object(units, "attend", lambda q, *rest: seen.update(q=q) or q.new_zeros(
            q.shape[0], q.shape[2], cfg.attention_width)):
        attention(x)
    q_in = seen["q_in"].double()
    normed = attention.q_norm.weight.double() * q_in * (q_in.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps).rsqrt()
    assert _bf16_match(seen["q_normed"], normed) == 1.0
    sin, cos = (t.double() for t in positions_sincos(cfg.max_position_embeddings, cfg.head_dim, 0, 24,
                                                         torch.float32, torch.device("cpu"), cfg.rope_parameters))
    q = seen["q_normed"].double().view(2, 24, cfg.num_attention_heads, cfg.head_dim)
    rotated = apply_rotary_halves(q, sin, cos).transpose(1, 2)
    assert _bf16_match(seen["q"], rotated) > 0.999
