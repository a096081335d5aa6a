"""Generation with streamed layers: the KV cache changes nothing but speed, sampling does what it says."""
from __future__ import annotations

import pytest
import torch

from layers import GPTJ, GPTJConfig
from streamer import StreamerError, StreamingTrainer, TrainerConfig
from streamer.generate import Sampling, complete, generate, sample_next
from streamer.io.tokenizer import train_bpe

DEBUG = GPTJConfig.preset("gptj-debug")
TINY = GPTJConfig(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)


@pytest.fixture(scope="module")
def trainer():
    """A debug model under a budget far below its 16 B/param training state: generation must stream."""
    budget = DEBUG.num_params() * 16 // 3
    with StreamingTrainer(DEBUG, TrainerConfig.of(dtype="fp32", budget=budget, seed=3)) as t:
        yield t


def prompts(batch: int = 2, length: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, DEBUG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def resident_greedy(trainer: StreamingTrainer, ids: torch.Tensor, new: int) -> torch.Tensor:
    model = GPTJ(trainer.cfg, init=False)
    model.load_hf_state_dict(trainer.state_dict())
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_greedy_with_cache_equals_without_and_the_resident_model(trainer):
    ids = prompts()
    cached = generate(trainer, ids, Sampling(max_new_tokens=12))
    recomputed = generate(trainer, ids, Sampling(max_new_tokens=12, use_cache=False))
    assert cached.shape == (2, 18)
    assert torch.equal(cached[:, :6], ids)
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached, resident_greedy(trainer, ids, 12))


def test_generation_streams_within_the_budget_and_frees_its_cache(trainer):
    trainer.ledger.reset_peak()
    generate(trainer, prompts(), Sampling(max_new_tokens=5))
    assert trainer.ledger.in_use == 0
    assert 0 < trainer.ledger.peak <= trainer.tc.device.budget_bytes() < 16 * DEBUG.num_params()
    spans = [e for e in trainer.trace.spans() if e.phase == "generate"]
    assert {e.layer for e in spans} == set(trainer.units)


def test_sampling_is_seeded_and_stays_in_the_top_k(trainer):
    ids = prompts(batch=1)
    settings = Sampling(max_new_tokens=12, temperature=1.5, top_k=3, seed=7)
    first, again = generate(trainer, ids, settings), generate(trainer, ids, settings)
    assert torch.equal(first, again)
    assert not torch.equal(first, generate(trainer, ids, Sampling(max_new_tokens=12, temperature=1.5, seed=8)))
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    allowed = logits.topk(3).indices
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        picked = sample_next(logits, Sampling(temperature=2.0, top_k=3), gen)
        assert (allowed == picked[:, None]).any(dim=1).all()


def test_narrow_sampling_reduces_to_greedy():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(0)
    greedy = logits.argmax(-1)
    assert torch.equal(sample_next(logits, Sampling(temperature=1.0, top_k=1), gen), greedy)
    assert torch.equal(sample_next(logits, Sampling(temperature=1.0, top_p=1e-6), gen), greedy)
    # top-p keeps the smallest set reaching p: with one token at 0.9 probability and p=0.5, only that one.
    peaked = torch.tensor([[10.0, 7.8, 0.0, 0.0]])
    assert all(sample_next(peaked, Sampling(temperature=1.0, top_p=0.5), gen).item() == 0 for _ in range(20))


def test_stop_token_ends_generation_and_pads_finished_rows(trainer):
    ids = prompts(batch=2)
    free_run = generate(trainer, ids, Sampling(max_new_tokens=10))
    stop = int(free_run[0, 8])  # row 0 reaches this token after 3 new tokens
    stopped = generate(trainer, ids, Sampling(max_new_tokens=10), stop_id=stop)
    first_stop = [int((row[6:] == stop).nonzero()[0]) if (row[6:] == stop).any() else None for row in stopped]
    assert first_stop[0] is not None and first_stop[0] <= 2
    for row, at in zip(stopped, first_stop):
        if at is not None:
            assert (row[6 + at:] == stop).all()


def test_bad_requests_are_one_line_errors(trainer):
    with pytest.raises(StreamerError, match="context of 64"):
        generate(trainer, prompts(length=60), Sampling(max_new_tokens=10))
    with pytest.raises(StreamerError, match="at least one token"):
        generate(trainer, torch.zeros(1, 0, dtype=torch.long))
    for bad in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"max_new_tokens": 0}):
        with pytest.raises(StreamerError):
            Sampling(**bad)


def test_complete_decodes_text_and_stops_at_end_of_text():
    from pydoc_data.topics import topics
    tokenizer = train_bpe(list(topics.values())[:40], vocab_size=TINY.vocab_size)
    with StreamingTrainer(TINY, TrainerConfig.of(dtype="fp32", seed=1)) as t:
        text = complete(t, tokenizer, "The for statement", Sampling(max_new_tokens=8, temperature=0.7, seed=1))
        assert isinstance(text, str) and "<|endoftext|>" not in text
        ids = tokenizer.encode("The for statement")
        greedy = generate(t, torch.tensor([ids]), Sampling(max_new_tokens=8))[0, len(ids):].tolist()
        if tokenizer.eos_id in greedy:
            greedy = greedy[:greedy.index(tokenizer.eos_id)]
        assert complete(t, tokenizer, "The for statement", Sampling(max_new_tokens=8)) == tokenizer.decode(greedy)
        assert isinstance(complete(t, tokenizer, "", Sampling(max_new_tokens=3)), str)  # starts from end-of-text
