"""What is Gemma 3's own; tests/test_families.py holds its parity with transformers (logits, gradients, streamed
training, the planner) by its example. Here: the presets' published counts, the older config.json form, and its
sliding window at lengths past the window, in the parity tests' logits, in generation with the KV cache and in
packed rows."""
from __future__ import annotations

import dataclasses

import torch
import transformers

from layers import PRESETS, Gemma3TextConfig, KVCache, ModelConfig, resident_model
from tests.test_families import hf_model
from tests.test_hub_configs import published

EXAMPLE = Gemma3TextConfig.example()


def test_presets_have_the_published_parameter_counts() -> None:
    """transformers' counts of the published text decoders (tests/test_layers.py checks each preset against
    transformers' Gemma3ForCausalLM on the meta device). The 1B's is Google's 999,885,952; the 4B's and 12B's
    tables have 262,208 rows, 64 more than the tokenizer's 262,144."""
    counts = {"gemma-3-1b": 999_885_952, "gemma-3-4b": 3_880_263_168, "gemma-3-12b": 11_766_034_176}
    assert {name: PRESETS[name].num_params() for name in counts} == counts


def test_the_published_file_in_its_older_form_is_the_1b_preset() -> None:
    """google/gemma-3-1b-it's config.json names its layers by sliding_window_pattern and its RoPE bases by
    rope_theta and rope_local_base_freq. It reads as the gemma-3-1b preset, and our config.json of it (layer_types,
    rope_parameters per layer type) gives transformers the same layers and RoPE as the published file."""
    raw = published("gemma-3-1b-it")
    cfg = ModelConfig.from_hf(raw)
    assert cfg == PRESETS["gemma-3-1b"]
    theirs, ours = transformers.AutoConfig.for_model(**raw), transformers.AutoConfig.for_model(**cfg.adapter().to_hf())
    assert ours.layer_types == theirs.layer_types
    assert ours.layer_types.count("full_attention") == 4  # layers 6, 12, 18 and 24 of 26
    assert ours.rope_parameters == theirs.rope_parameters
    assert ModelConfig.from_hf(cfg.adapter().to_hf()) == cfg


def test_the_window_changes_the_parity_tests_logits() -> None:
    """The example's window (6) is shorter than the parity tests' sequences: from position 6 on, transformers'
    logits differ from those of the same weights with a window as long as the sequence, so the parity tests hold
    the band itself."""
    ids = torch.randint(0, EXAMPLE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    windowed = hf_model(EXAMPLE)
    unbounded = hf_model(dataclasses.replace(EXAMPLE, sliding_window=16))
    unbounded.load_state_dict(windowed.state_dict())
    with torch.no_grad():
        difference = (windowed(ids).logits - unbounded(ids).logits).abs().amax(dim=(0, 2))
    window = EXAMPLE.sliding_window
    assert difference[:window].max() == 0
    assert difference[window:].min() > 1e-3


def test_generation_past_the_window_with_the_kv_cache_is_transformers_greedy_generate() -> None:
    """A 4-token prompt and 20 new tokens, the window 6: each new token is one position through the resident
    model with the KV cache (the sliding layers mask all but their window's keys), and the tokens are those of
    transformers' greedy `generate` (its sliding layers' cache keeps only the window)."""
    theirs = hf_model(EXAMPLE)
    ours = resident_model(EXAMPLE, init=False).eval()
    ours.load_hf_state_dict(theirs.state_dict())
    prompt = torch.randint(0, EXAMPLE.vocab_size, (1, 4), generator=torch.Generator().manual_seed(2))
    new = 20
    assert prompt.shape[1] + new > 3 * EXAMPLE.sliding_window
    caches = [KVCache.empty(EXAMPLE, 1, prompt.shape[1] + new, torch.float32, "cpu")
              for _ in range(EXAMPLE.num_hidden_layers)]
    tokens = prompt
    with torch.no_grad():
        logits = ours(prompt, 0, caches)
        for _ in range(new):
            next_token = logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
            logits = ours(next_token, tokens.shape[1] - 1, caches)
        expected = theirs.generate(prompt, max_new_tokens=new, do_sample=False)
    assert tokens.tolist() == expected.tolist()


def test_packed_examples_each_see_their_own_window() -> None:
    """A row of two packed examples (positions restarting at 0), both longer than the window: each one's logits
    are those of the example alone (in float64, where the two masks' kernels agree to rounding)."""
    ours = resident_model(EXAMPLE).double().eval()
    ids = torch.randint(0, EXAMPLE.vocab_size, (1, 19), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(10), torch.arange(9)])[None]
    with torch.no_grad():
        packed = ours(ids, positions=positions)
        alone = torch.cat([ours(ids[:, :10]), ours(ids[:, 10:])], dim=1)
    assert torch.allclose(packed, alone, rtol=0, atol=1e-10)
