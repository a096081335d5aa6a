"""Offline tokenizers: train, round-trip, save for transformers, load GPT-2-style files."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from pydoc_data.topics import topics

from streamer.errors import TokenizerError
from streamer.io.tokenizer import EOS_TOKEN, Tokenizer, load_tokenizer, train_bpe

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "The quick brown fox jumps over the lazy dog.  Twice!",
    "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🙂🚀, tabs\tand\r\nnewlines",
    "   leading spaces and trailing   ",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(topics.values(), vocab_size=4096)


def test_trains_on_pydoc_topics_in_seconds():
    start = time.perf_counter()
    tok = train_bpe(topics.values(), vocab_size=4096)
    assert time.perf_counter() - start < 10
    assert tok.vocab_size == 4096
    assert tok.eos_id == 0 and tok.decode([tok.eos_id]) == EOS_TOKEN
    # The merges are learned: English prose costs well under one token per character.
    text = topics["if"]
    assert len(tok.encode(text)) < len(text) / 2.5


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_every_byte_is_encodable_with_a_tiny_vocab():
    tok = train_bpe(["aaa bbb"], vocab_size=300)
    text = "".join(map(chr, range(1, 2000)))
    assert tok.decode(tok.encode(text)) == text


def test_end_of_text_is_one_token(tok):
    ids = tok.encode(f"one{EOS_TOKEN}two")
    assert ids.count(tok.eos_id) == 1
    assert tok.decode(ids) == f"one{EOS_TOKEN}two"


def test_saved_tokenizer_loads_here_and_in_transformers(tok, tmp_path):
    import transformers

    tok.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"tokenizer.json", "tokenizer_config.json",
                                                   "special_tokens_map.json"}
    again = load_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token == EOS_TOKEN and hf.eos_token_id == tok.eos_id
    assert len(hf) == tok.vocab_size == again.vocab_size
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text


@pytest.mark.parametrize("names", [("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")])
def test_loads_gpt2_style_vocab_and_merges(tok, tmp_path, names):
    vocab, merges = tok.backend.model.save(str(tmp_path))
    Path(vocab).rename(tmp_path / names[0])
    Path(merges).rename(tmp_path / names[1])
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_id == tok.eos_id and loaded.vocab_size == tok.vocab_size
    for text in [*TEXTS, f"a{EOS_TOKEN}b"]:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    # Saved: its own files verbatim, and the tokenizer.json + config transformers needs that they lack.
    loaded.save(tmp_path / "saved")
    assert (tmp_path / "saved" / names[0]).read_bytes() == (tmp_path / names[0]).read_bytes()
    assert load_tokenizer(tmp_path / "saved").encode(TEXTS[2]) == tok.encode(TEXTS[2])
    import transformers
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert hf(TEXTS[1], add_special_tokens=False)["input_ids"] == tok.encode(TEXTS[1])


def test_eos_token_named_by_tokenizer_config(tmp_path):
    tok = train_bpe(["hello world </s> hello"], vocab_size=300)
    tok.backend.add_special_tokens(["</s>"])
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_token == "</s>" and loaded.eos_id == tok.backend.token_to_id("</s>")


def test_missing_and_broken_files(tok, tmp_path):
    with pytest.raises(TokenizerError, match="not a folder"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(TokenizerError, match="holds no tokenizer: .*; copy the model's tokenizer files there$"):
        load_tokenizer(tmp_path)
    tok.backend.model.save(str(tmp_path))
    (tmp_path / "merges.txt").unlink()
    with pytest.raises(TokenizerError, match="merges.txt"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "merges.txt").write_text("#version: 0.2\nzz qq\n")
    with pytest.raises(TokenizerError, match="not valid GPT-2 BPE"):
        load_tokenizer(tmp_path)


def test_tokenizer_without_end_of_text(tmp_path):
    tok = train_bpe(["hello"], vocab_size=300)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<eos>"}))
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="'<eos>'"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("texts,vocab,match", [
    (["abc"], 256, "vocab_size must be"),
    (["abc"], "4096", "vocab_size must be"),
    ([], 1000, "no text"),
    (["", ""], 1000, "no text"),
    ([b"bytes"], 1000, "needs strings"),
])
def test_training_errors(texts, vocab, match):
    with pytest.raises(TokenizerError, match=match):
        train_bpe(texts, vocab)
