"""Data formats beyond text and prompt/completion: Alpaca, chat with its template, parquet/csv/datasets folders."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import pytest

from layers import IGNORE_INDEX
from streamer.errors import DataError
from streamer.io.data import load_dataset, read_examples, tokenize
from streamer.io.records import ALPACA_NO_INPUT, ALPACA_WITH_INPUT

EOS = 256
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ByteTokenizer:
    """Token = UTF-8 byte, so every expected id can be written down by hand."""

    eos_id = EOS
    eos_token = "<eos>"
    bos_token = None
    affixes = ((), ())

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def _jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _learned(dataset, row: int = 0) -> str:
    pairs = zip(dataset.input_ids[row].tolist(), dataset.labels[row].tolist(), strict=True)
    ids = [i for i, label in pairs if label != IGNORE_INDEX]
    return bytes(i for i in ids if i != EOS).decode()


def test_alpaca_records_use_alpacas_prompt_and_learn_the_output(tmp_path):
    path = _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Add", "input": "1 2", "output": "3"},
                                               {"instruction": "Greet", "input": "", "output": "Hi"}])
    with_input, without = read_examples(path)
    assert with_input.text == ALPACA_WITH_INPUT.format(instruction="Add", input="1 2")
    assert without.text == ALPACA_NO_INPUT.format(instruction="Greet")
    data = load_dataset(path, ByteTokenizer(), seq=400)
    assert [_learned(data, 0), _learned(data, 1)] == ["3", "Hi"]
    assert data.labels[0].tolist().count(EOS) == 1  # the output's end-of-text is learned too


def test_chat_learns_only_the_assistant_turns(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Ciao."}]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    data = load_dataset(path, ByteTokenizer(CHATML), seq=300)
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    ids = data.input_ids[0].tolist()
    assert bytes(ids[:len(rendered.encode())]).decode() == rendered  # the template's text, whole
    # The assistant's content and its end of turn are learned; its role header and every other turn are not.
    assert _learned(data) == "Hello!<|im_end|>\nCiao.<|im_end|>\n"


def test_chat_without_a_template_is_one_clear_error(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                          {"role": "assistant", "content": "Hello"}]}])
    with pytest.raises(DataError, match=r"chat.jsonl line 1 is a chat record but the tokenizer has no "
                                        r"chat_template; pass --chat-template FILE"):
        load_dataset(path, ByteTokenizer(), seq=100)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # Renders the number of messages first: a longer conversation does not continue the shorter one's text.
    template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                          {"role": "assistant", "content": "b"}]}])
    with pytest.raises(DataError, match="does not continue"):
        load_dataset(path, ByteTokenizer(template), seq=100)


@pytest.mark.parametrize("record,match", [
    ({"messages": []}, r"bad.jsonl line 2: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"bad.jsonl line 2: 'messages'\[0\] 'role' must be"),
    ({"messages": [{"role": "user", "content": 5}]}, r"'messages'\[0\] 'content' must be a string, got int"),
    ({"instruction": "a", "output": 3}, r"bad.jsonl line 2: field 'output' must be a string, got int"),
    ({"prompt": "a", "completion": None}, r"bad.jsonl line 2: field 'completion' must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"bad.jsonl line 2: 'messages' has no assistant turn"),
])
def test_bad_records_name_file_line_and_field(tmp_path, record, match):
    path = _jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, record])
    with pytest.raises(DataError, match=match):
        load_dataset(path, ByteTokenizer(CHATML), seq=200)


@pytest.mark.parametrize("kind", ["parquet", "csv", "save_to_disk"])
def test_tables_and_datasets_folders_read_like_jsonl(tmp_path, kind):
    rows = [{"prompt": "Q: 1+1?", "completion": " 2"}, {"prompt": "Q: 2+2?", "completion": " 4"}]
    table = datasets.Dataset.from_list(rows)
    path = tmp_path / ("data" if kind == "save_to_disk" else f"data.{kind}")
    getattr(table, {"parquet": "to_parquet", "csv": "to_csv", "save_to_disk": "save_to_disk"}[kind])(str(path))
    expected = tokenize(read_examples(_jsonl(tmp_path / "same.jsonl", rows)), ByteTokenizer(), seq=16)
    got = load_dataset(path, ByteTokenizer(), seq=16)
    assert got.input_ids.equal(expected.input_ids) and got.labels.equal(expected.labels)


def test_a_bad_table_row_names_the_row_and_field(tmp_path):
    path = tmp_path / "data.parquet"
    datasets.Dataset.from_list([{"text": "fine", "prompt": None}, {"text": None, "prompt": "x"}]).to_parquet(str(path))
    with pytest.raises(DataError, match=r"data.parquet row 2: field 'text' must be a string, got NoneType"):
        read_examples(path)


def test_datasets_missing_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(DataError, match=r"needs the `datasets` package: pip install 'weight-streaming\[data\]'"):
        read_examples(path)
