"""Fine-tuning data: exact packing, completion-only labels, seeded order, bit-identical resume, clear errors."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.io.data import (BatchStream, Dataset, Example, demo_corpus, load_dataset, long_examples_line,
                              read_examples, tokenize)
from streamer.errors import DataError

EOS = 256


class ByteTokenizer:
    """Token = UTF-8 byte, so every expected id in these tests can be written down by hand."""

    eos_id = EOS
    affixes = ((), ())  # adds no special tokens around a text, as GPT-2's and Qwen's

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


TOK = ByteTokenizer()


def _ids(text: str) -> list[int]:
    return list(text.encode())


def _write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def _jsonl(path: Path, records: list[object]) -> Path:
    return _write(path, "\n".join(json.dumps(r) for r in records) + "\n")


def test_text_packs_into_exact_sequences(tmp_path):
    path = _write(tmp_path / "d.txt", "abc\ndef\n\n\n  \nghij\n\nk")
    assert [e.text for e in read_examples(path)] == ["abc\ndef", "ghij", "k"]
    stream = _ids("abc\ndef") + [EOS] + _ids("ghij") + [EOS] + _ids("k") + [EOS]  # 17 tokens
    data = load_dataset(path, TOK, seq=5)
    assert data.input_ids.shape == (3, 5) and data.input_ids.dtype == torch.long
    assert data.input_ids.flatten().tolist() == stream[:15]
    assert torch.equal(data.labels, data.input_ids)
    whole = load_dataset(path, TOK, seq=4, whole_file=True)
    whole_stream = _ids("abc\ndef\n\n\n  \nghij\n\nk") + [EOS]  # 21 tokens: 5 sequences, 1 dropped
    assert whole.input_ids.flatten().tolist() == whole_stream[:20]


def test_jsonl_text_and_demo_corpus(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "hello"}, {"text": "héllo", "meta": 1}])
    data = load_dataset(path, TOK, seq=3)
    assert data.input_ids.flatten().tolist() == (_ids("hello") + [EOS] + _ids("héllo") + [EOS])[:12]
    corpus = demo_corpus()
    assert len(corpus) > 50 and sum(map(len, corpus)) > 100_000 and corpus == demo_corpus()
    assert len(tokenize(corpus[:3], TOK, seq=64)) > 10


def test_completion_only_labels_and_padding(tmp_path):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: 1+1?", "completion": " 2"},
                                          {"prompt": "hi", "completion": " there"}])
    data = load_dataset(path, TOK, seq=12)
    assert data.input_ids.tolist() == [
        _ids("Q: 1+1? 2") + [EOS] + [EOS] * 2,
        _ids("hi there") + [EOS] + [EOS] * 3,
    ]
    assert data.labels.tolist() == [
        [-100] * 7 + _ids(" 2") + [EOS] + [-100] * 2,
        [-100] * 2 + _ids(" there") + [EOS] + [-100] * 3,
    ]


def test_prompt_examples_pack_without_splitting():
    examples = [Example("ab", "c"), Example("d", "ef"), Example("ghi", "j")]
    data = tokenize(examples, TOK, seq=8, pack="examples")
    assert data.input_ids.tolist() == [_ids("abc") + [EOS] + _ids("def") + [EOS],
                                       _ids("ghij") + [EOS] + [EOS] * 3]
    assert data.labels.tolist() == [[-100, -100, *_ids("c"), EOS, -100, *_ids("ef"), EOS],
                                    [-100] * 3 + _ids("j") + [EOS] + [-100] * 3]
    # Each example's positions start at 0 (it attends only to itself); padding runs on from the last one.
    assert data.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert tokenize(examples, TOK, seq=8).positions is None  # one example per row: the plain causal path
    assert data.subset(torch.tensor([1])).positions.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # transformers' attention mask: False on the padding after a row's examples alone.
    assert data.attention_mask.tolist() == [[True] * 8, [True] * 5 + [False] * 3]
    ids, labels, positions, mask = next(BatchStream(data, batch=2))
    assert sorted(positions.tolist()) == sorted(data.positions.tolist())
    assert sorted(mask.tolist()) == sorted(data.attention_mask.tolist())


def test_a_packed_example_learns_nothing_from_the_one_before():
    """An example whose first token is learned (no prompt) does not learn it from the example before it."""
    data = tokenize([Example("ab", "c"), Example("", "de")], TOK, seq=8, pack="examples")
    assert data.labels.tolist() == [[-100, -100, *_ids("c"), EOS, -100, *_ids("e"), EOS, -100]]


def test_text_documents_attend_across_each_other_unless_pack_documents():
    docs = ["abc", "de", "fghij"]  # with end-of-text: 4 + 3 + 6 = 13 tokens, two sequences of 6
    for pack in (None, "examples"):
        assert tokenize(docs, TOK, seq=6, pack=pack).positions is None
    data = tokenize(docs, TOK, seq=6, pack="documents")
    assert data.input_ids.flatten().tolist() == (_ids("abc") + [EOS] + _ids("de") + [EOS] + _ids("fghij"))[:12]
    # Positions restart at each document and at each sequence (the document's piece before is not seen).
    assert data.positions.tolist() == [[0, 1, 2, 3, 0, 1], [0, 0, 1, 2, 3, 4]]
    # A document's first token is not learned from the end of the one before.
    assert data.labels.tolist() == [[-100, *_ids("bc"), EOS, -100, *_ids("e")], [EOS, -100, *_ids("ghij")]]
    with pytest.raises(DataError, match="--pack must be one of examples, documents"):
        tokenize(docs, TOK, seq=6, pack="yes")


def test_an_example_longer_than_seq_is_truncated_or_dropped(tmp_path):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "ok", "completion": "!"},
                                          {"prompt": "x" * 4, "completion": "yyyyyy"},
                                          {"prompt": "z" * 9, "completion": "w"}])
    cut = load_dataset(path, TOK, seq=8)  # truncate, the default
    assert cut.input_ids.tolist() == [[*_ids("ok!"), EOS, EOS, EOS, EOS, EOS], _ids("xxxxyyyy")]
    assert cut.labels[1].tolist() == [-100] * 4 + _ids("yyyy")
    # The third keeps only prompt once cut: nothing to learn, so it is dropped, not trained on as 0 tokens.
    assert (cut.truncated, cut.dropped) == (1, 1)
    dropped = load_dataset(path, TOK, seq=8, long_examples="drop")
    assert dropped.input_ids.tolist() == cut.input_ids[:1].tolist() and (dropped.truncated, dropped.dropped) == (0, 2)
    assert "2 examples are longer than --seq 8: 1 truncated to their first 8 tokens and 1 dropped (nothing left " \
           "to learn once truncated) (--long-examples truncate" in long_examples_line(cut, 8, "truncate")
    assert long_examples_line(load_dataset(path, TOK, seq=16), 16, "truncate") is None
    with pytest.raises(DataError, match="2 longer examples were dropped .--long-examples drop."):
        load_dataset(_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 9, "completion": "y"}] * 2), TOK, seq=8,
                     long_examples="drop")


class BosTokenizer(ByteTokenizer):
    """Adds a beginning-of-text token before a whole text, as Llama 3's post-processor does."""

    affixes = ((300,), ())


def test_texts_and_prompts_begin_with_the_tokens_the_tokenizer_adds(tmp_path):
    pairs = load_dataset(_jsonl(tmp_path / "pc.jsonl", [{"prompt": "ab", "completion": "c"}]), BosTokenizer(), seq=6)
    assert pairs.input_ids.tolist() == [[300, *_ids("abc"), EOS, EOS]]
    assert pairs.labels.tolist() == [[-100, -100, -100, *_ids("c"), EOS, -100]]
    text = tokenize(["ab", "cd"], BosTokenizer(), seq=4)
    assert text.input_ids.tolist() == [[300, *_ids("ab"), EOS], [300, *_ids("cd"), EOS]]


def _dataset(n: int, seq: int = 4) -> Dataset:
    ids = torch.arange(n * seq, dtype=torch.long).view(n, seq)
    return Dataset(ids, ids.clone())


def test_split_is_seeded_disjoint_and_keeps_one_eval_sequence():
    data = _dataset(20)
    train, held = data.split(0.1, seed=3)
    assert len(train) == 18 and len(held) == 2
    rows = sorted(r[0] for r in torch.cat([train.input_ids, held.input_ids]).tolist())
    assert rows == data.input_ids[:, 0].tolist()
    assert torch.equal(data.split(0.1, seed=3)[1].input_ids, held.input_ids)
    assert not torch.equal(data.split(0.1, seed=4)[1].input_ids, held.input_ids)
    assert [len(d) for d in _dataset(2).split(0.01)] == [1, 1]
    assert _dataset(1).split(0.5)[1] is None and _dataset(5).split(0.0)[1] is None
    with pytest.raises(DataError, match="eval_fraction"):
        data.split(1.0)


def test_batches_are_seeded_and_reshuffled_each_epoch():
    data = _dataset(10)
    first = [next(BatchStream(data, batch=4, seed=7))[0] for _ in range(2)]
    assert torch.equal(first[0], first[1])
    stream = BatchStream(data, batch=5, seed=7)
    epoch0 = torch.cat([next(stream)[0], next(stream)[0]])
    epoch1 = torch.cat([next(stream)[0], next(stream)[0]])
    assert sorted(epoch0[:, 0].tolist()) == sorted(epoch1[:, 0].tolist()) == list(range(0, 40, 4))
    assert not torch.equal(epoch0, epoch1)
    assert not torch.equal(next(BatchStream(data, batch=4, seed=8))[0], first[0])


def test_batches_cross_epoch_boundaries_and_handle_tiny_data():
    stream = BatchStream(_dataset(3), batch=4, seed=0)
    seen = torch.cat([next(stream)[0][:, 0] for _ in range(3)]).tolist()  # 12 = 4 epochs of 3
    for epoch in range(4):
        assert sorted(seen[3 * epoch:3 * epoch + 3]) == [0, 4, 8]
    assert stream.state_dict()["epoch"] == 4 and stream.state_dict()["position"] == 0


def test_resume_mid_epoch_continues_identically():
    data = _dataset(11)
    reference = BatchStream(data, batch=3, seed=1)
    for _ in range(5):  # into the second epoch, mid-way
        next(reference)
    state = json.loads(json.dumps(reference.state_dict()))
    expected = [next(reference) for _ in range(10)]
    resumed = BatchStream(data, batch=3, seed=1)
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(10)]
    for (ids, labels, _, _), (want_ids, want_labels, _, _) in zip(got, expected, strict=True):
        assert torch.equal(ids, want_ids) and torch.equal(labels, want_labels)


@pytest.mark.parametrize("change,match", [
    ({"seed": 2}, "seed 2 -> 1"),
    ({"batch": 4}, "batch 4 -> 3"),
    ({"sequences": 12}, "sequences 12 -> 11"),
    ({"position": 11}, "out of range"),
    ({"epoch": -1}, "out of range"),
])
def test_resume_refuses_a_different_setup(change, match):
    stream = BatchStream(_dataset(11), batch=3, seed=1)
    with pytest.raises(DataError, match=match):
        stream.load_state_dict({**stream.state_dict(), **change})
    with pytest.raises(DataError, match="lacks"):
        stream.load_state_dict({"epoch": 0})


@pytest.mark.parametrize("name,content,match", [
    ("empty.txt", "", "holds no text"),
    ("blank.txt", "\n \n\t\n", "holds no text"),
    ("empty.jsonl", "\n\n", "holds no text"),
    ("bad.jsonl", '{"text": "a"}\n{"text": \n', r"bad.jsonl line 2 is not valid JSON"),
    ("list.jsonl", '{"text": "a"}\n[1, 2]\n', r"list.jsonl line 2 holds a JSON list"),
    ("keys.jsonl", '{"prompt": "a"}\n', r"keys.jsonl line 1 is none of .*\(its fields: \['prompt'\]\)"),
    ("type.jsonl", '{"text": 3}\n', r"type.jsonl line 1: field 'text' must be a string"),
    ("latin1.txt", "caf\xe9".encode("latin-1"), "not UTF-8"),
    ("short.txt", "abc", r"short.txt: the data holds 4 tokens, fewer than one sequence of seq=8"),
    ("data.xml", "a,b", "use a .txt, .jsonl, .parquet or .csv file"),
])
def test_data_errors_name_the_problem(tmp_path, name, content, match):
    path = _write(tmp_path / name, content)
    with pytest.raises(DataError, match=match):
        load_dataset(path, TOK, seq=8)


def test_missing_file_and_bad_settings(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(tmp_path / "absent.txt", TOK, seq=8)
    with pytest.raises(DataError, match="seq must be"):
        tokenize(["abc"], TOK, seq=1)
    with pytest.raises(DataError, match="batch must be"):
        BatchStream(_dataset(2), batch=0)


def test_with_a_trained_tokenizer(tmp_path):
    from streamer.io.tokenizer import train_bpe

    tok = train_bpe(demo_corpus(), vocab_size=512)
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "def f():", "completion": " return 1"}])
    data = load_dataset(path, tok, seq=16)
    prompt_len = len(tok.encode("def f():"))
    completion = tok.encode(" return 1") + [tok.eos_id]
    assert data.labels[0, :prompt_len].eq(-100).all()
    assert data.labels[0, prompt_len:prompt_len + len(completion)].tolist() == completion


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                         st.sampled_from(["text", "prompt", "completion", "x"]) | st.text(max_size=4), inner,
                         max_size=3), max_leaves=6)


@settings(max_examples=200, deadline=None)
@given(suffix=st.sampled_from([".txt", ".jsonl", ".json"]),
       content=st.binary(max_size=80) | st.lists(_JSON, max_size=5).map(
           lambda rows: "\n".join(json.dumps(r) for r in rows).encode()),
       seq=st.integers(1, 6), pack=st.sampled_from([None, "examples", "documents"]), whole_file=st.booleans())
def test_loader_raises_only_data_errors(suffix, content, seq, pack, whole_file):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"data{suffix}"
        path.write_bytes(content)
        try:
            data = load_dataset(path, TOK, seq, pack=pack, whole_file=whole_file)
        except DataError as exc:
            assert "\n" not in str(exc)
            return
        assert data.input_ids.shape[1] == seq and len(data) >= 1
        assert data.input_ids.min() >= 0 and data.input_ids.max() <= EOS
