"""Reading fine-tuning data files into `Example`s: documents, prompt/completion pairs and conversations.

`.txt`: documents separated by blank lines (or the whole file as one). `.jsonl`, one record per line, and
`.parquet` / `.csv` files or a folder a Hugging Face `datasets.Dataset.save_to_disk` wrote, one record per row
(read through the optional `datasets` package, without the hub). A record is one of
- `{"text": ...}`: a document, learned whole;
- `{"prompt": ..., "completion": ...}`: only the completion is learned;
- `{"instruction": ..., "input": ..., "output": ...}` (Alpaca; `input` may be empty or absent): written with
  Alpaca's own prompt, only the output is learned;
- `{"messages": [{"role": ..., "content": ...}, ...]}`: a conversation, rendered with the tokenizer's chat
  template when it is tokenized; only the assistant turns are learned.
A record that fits none of them, or a field of the wrong type, is an error naming the file, line (row) and field.
"""
from __future__ import annotations

import csv
import itertools
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from streamer.errors import DataError
from streamer.io.chat import check_messages

TEXT_SUFFIXES = (".txt", ".jsonl")
TABLE_SUFFIXES = (".parquet", ".csv")
# Stanford Alpaca's prompts (github.com/tatsu-lab/stanford_alpaca, train.py), so a model tuned on Alpaca data
# here is prompted the way the data's authors intended.
ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
# The most bytes one line of a .jsonl file may hold: a million tokens of text, about 4 MB, is far beyond any
# model's context; a record is read at most this far, so a file of one huge line is refused before it fills RAM.
MAX_RECORD_BYTES = 4 * 2**20
RECORD_KINDS = ('{"text"}, {"prompt", "completion"}, {"instruction", "input", "output"} (Alpaca) or '
                '{"messages"} (chat)')


@dataclass(frozen=True)
class Example:
    """One document (`completion is None`), one prompt/completion pair, or one conversation (`messages`, whose
    `text` is its contents joined, for training a tokenizer), with where it came from."""

    text: str
    completion: str | None = None
    where: str = "text"  # for error messages: "train.jsonl line 7"
    messages: tuple[dict[str, Any], ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not isinstance(self.completion, (str, type(None))):
            raise DataError(f"{self.where}: text, prompt and completion must be strings")


def read_examples(path: str | Path, whole_file: bool = False) -> list[Example]:
    """The examples a data file or `datasets` folder holds; `whole_file` makes a `.txt` file one document."""
    path = Path(path)
    if path.is_dir():
        examples = [_record_example(r, w) for r, w in _dataset_rows(path)]
    elif path.suffix in TABLE_SUFFIXES:
        if not path.is_file():
            raise DataError(f"{path} does not exist; pass an existing {path.suffix} file")
        examples = [_record_example(r, w) for r, w in _dataset_rows(path)]
    elif path.suffix == ".jsonl":
        examples = _read_jsonl(path)
    elif path.suffix in TEXT_SUFFIXES:
        examples = _read_text(path, _read_text_file(path), whole_file)
    else:
        raise DataError(f"{path}: unknown data format {path.suffix!r}; use a .txt, .jsonl, .parquet or .csv file "
                        "or a datasets save_to_disk folder")
    if not examples:
        raise DataError(f"{path} holds no text; add documents to it or choose another file")
    return examples


@contextmanager
def _reading(path: Path, where: str = "") -> Iterator[None]:
    """A text data file's read errors as one line each."""
    try:
        yield
    except FileNotFoundError:
        raise DataError(f"{path} does not exist; pass an existing .txt or .jsonl file") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({where}byte {exc.start}: {exc.reason}); "
                        "re-encode it as UTF-8") from None
    except OSError as exc:
        raise DataError(f"cannot read {path} ({exc.strerror}); check the path and its permissions") from None


def _read_text_file(path: Path) -> str:
    with _reading(path):
        return path.read_text(encoding="utf-8-sig")  # Excel and Notepad start UTF-8 with a byte-order mark


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(number, text) of each line, read a line at a time and at most MAX_RECORD_BYTES of one: a record of
    hundreds of megabytes is refused before it is read whole (a 50 MB line took 12 GB to train on)."""
    with _reading(path), open(path, "rb") as file:
        for number in itertools.count(1):
            raw = file.readline(MAX_RECORD_BYTES + 1)
            if not raw:
                return
            if len(raw.rstrip(b"\r\n")) > MAX_RECORD_BYTES:
                raise DataError(f"{path} line {number} is longer than {MAX_RECORD_BYTES // 2**20} MiB, the most one "
                                "record may hold (about a million tokens); split it into several records")
            with _reading(path, f"line {number}, "):
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")


def _read_text(path: Path, content: str, whole_file: bool) -> list[Example]:
    if whole_file:
        return [Example(content, where=str(path))] if content.strip() else []
    lines: list[str] = []
    examples, start = [], 1
    for number, line in enumerate([*content.split("\n"), ""], start=1):
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            examples.append(Example("\n".join(lines), where=f"{path} line {start}"))
            lines = []
    return examples


def _read_jsonl(path: Path) -> list[Example]:
    examples = []
    for number, line in _jsonl_lines(path):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where} is not valid JSON ({exc.msg} at column {exc.colno}); "
                            "write one JSON object per line") from None
        except RecursionError:
            raise DataError(f"{where} nests its JSON deeper than Python's parser goes; write one flat record "
                            f"per line, such as {RECORD_KINDS}") from None
        examples.append(_record_example(record, where))
    return examples


def _record_example(record: Any, where: str) -> Example:
    if not isinstance(record, dict):
        raise DataError(f"{where} holds a JSON {type(record).__name__}; each record must be an object like "
                        f"{RECORD_KINDS}")
    if "messages" in record:
        messages = check_messages(record["messages"], where)
        return Example("\n".join(m["content"] for m in messages), where=where, messages=tuple(messages))
    if "instruction" in record and "output" in record:
        fields = _strings(record, ("instruction", "input", "output"), where, optional=("input",))
        template = ALPACA_WITH_INPUT if fields.get("input") else ALPACA_NO_INPUT
        return Example(template.format(instruction=fields["instruction"], input=fields.get("input", "")),
                       fields["output"], where)
    if "prompt" in record and "completion" in record:
        fields = _strings(record, ("prompt", "completion"), where)
        return Example(fields["prompt"], fields["completion"], where)
    if "text" in record:
        return Example(_strings(record, ("text",), where)["text"], where=where)
    raise DataError(f"{where} is none of {RECORD_KINDS} (its fields: {sorted(record)[:6]}); give each record "
                    "one of them")


def _strings(record: dict, names: tuple[str, ...], where: str, optional: tuple[str, ...] = ()) -> dict[str, str]:
    out = {}
    for name in names:
        value = record.get(name)
        if value is None and name in optional:
            continue
        if not isinstance(value, str):
            raise DataError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
        out[name] = value
    return out


def _dataset_rows(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    """(record, "FILE row N") for each row of a .parquet/.csv file or a `save_to_disk` folder, via `datasets`."""
    datasets = _import_datasets(path)
    cache = tempfile.mkdtemp(prefix="ws-datasets-")  # datasets' Arrow cache; gone once the rows are read
    try:
        try:
            if path.is_dir():
                table = datasets.load_from_disk(str(path), keep_in_memory=True)
            else:
                # A CSV cell is text: " 2" stays a string, an empty cell stays "" (pandas would make 2 and NaN).
                as_text = {"features": _text_columns(datasets, path), "keep_default_na": False} \
                    if path.suffix == ".csv" else {}
                table = datasets.load_dataset(path.suffix[1:], data_files=str(path), split="train", cache_dir=cache,
                                              keep_in_memory=True, **as_text)
        except (FileNotFoundError, ValueError, OSError, datasets.exceptions.DatasetGenerationError) as exc:
            raise DataError(f"cannot read {path} with datasets ({' '.join(str(exc).split())[:200]}); pass a "
                            ".parquet or .csv file or a folder Dataset.save_to_disk wrote") from None
        if isinstance(table, datasets.DatasetDict):
            if "train" not in table:
                raise DataError(f"{path} holds the splits {sorted(table)} and no 'train'; pass the folder of one "
                                "split (DatasetDict.save_to_disk writes one per split)")
            table = table["train"]
        for number, row in enumerate(table, start=1):
            yield row, f"{path} row {number}"
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _text_columns(datasets: Any, path: Path) -> Any:
    """Every column of a CSV file's header as a string column."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as file:  # a byte-order mark is not in the header
            header = next(csv.reader(file), [])
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"cannot read {path} ({exc}); pass a UTF-8 CSV file with a header row") from None
    return datasets.Features({name: datasets.Value("string") for name in header})


def _import_datasets(path: Path) -> Any:
    # Data is read from local files only: the hub is never asked, even for a builder's scripts.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading {path} needs the `datasets` package: pip install 'weight-streaming[data]' "
                        "(or convert the data to .jsonl)") from None
    return datasets


Messages = tuple[dict[str, str], ...]


@dataclass(frozen=True)
class Pair:
    """A preference pair as TRL's DPOTrainer reads one: a prompt and two completions of it, the chosen one
    preferred; plain text, or conversational (each a list of messages: the prompt's turns, then each
    completion's assistant turns)."""

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages
    where: str = ""

    @property
    def conversational(self) -> bool:
        return not isinstance(self.chosen, str)


def _json_records(path: Path, what: str) -> list[tuple[Any, str]]:
    """(record, where it is) of each record of a .jsonl file (each line bounded as `_jsonl_lines` bounds it), a
    table or a datasets folder; `what` the records are, for the line refusing another kind of file."""
    if path.is_dir() or path.suffix in TABLE_SUFFIXES:
        if not path.exists():
            raise DataError(f"{path} does not exist; pass an existing {path.suffix or 'datasets'} file")
        return list(_dataset_rows(path))
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: {what} are read from .jsonl, .parquet, .csv or a datasets folder, not "
                        f"{path.suffix!r}")
    records = []
    for number, line in _jsonl_lines(path):
        if line.strip():
            try:
                records.append((json.loads(line), f"{path} line {number}"))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {number} is not valid JSON ({exc.msg} at column {exc.colno}); "
                                "write one JSON object per line") from None
    return records


def read_pairs(path: str | Path) -> list[Pair]:
    """The preference pairs a .jsonl file (or a table or datasets folder) holds: each record's `chosen` and
    `rejected`, and its `prompt`, or without one the prompt both share (TRL's implicit prompt)."""
    records = _json_records(Path(path), "preference pairs")
    pairs = [_pair(record, where) for record, where in records]
    if not pairs:
        raise DataError(f"{path} holds no pairs; add records with chosen and rejected")
    return pairs


def _pair(record: Any, where: str) -> Pair:
    if not isinstance(record, dict):
        raise DataError(f"{where} holds a JSON {type(record).__name__}; each record must be an object like "
                        '{"prompt": ..., "chosen": ..., "rejected": ...}')
    for name in ("chosen", "rejected"):
        if name not in record:
            raise DataError(f"{where} has no {name!r} field; a preference pair needs prompt, chosen and rejected")
    names = ("chosen", "rejected") if "prompt" not in record else ("prompt", "chosen", "rejected")
    fields: Mapping[str, str | Messages]
    if isinstance(record["chosen"], list):  # conversational: every field a list of messages
        fields = {name: tuple(check_messages(record[name], f"{where}: {name!r}")) for name in names}
    else:
        fields = _strings(record, names, where)
    if "prompt" not in record:
        return _implicit_prompt(fields["chosen"], fields["rejected"], where)
    return Pair(fields["prompt"], fields["chosen"], fields["rejected"], where)


def _implicit_prompt(chosen: str | Messages, rejected: str | Messages, where: str) -> Pair:
    """TRL's extract_prompt: the prompt is the common start of both (characters, or a conversation's messages),
    less a space it ends with (where the two never differ, all but the shorter one's last item, as TRL's loop
    leaves it)."""
    index = 0
    for index in range(min(len(chosen), len(rejected))):
        if chosen[index] != rejected[index]:
            if chosen[index - 1] == " ":
                index -= 1
            break
    return Pair(chosen[:index], chosen[index:], rejected[index:], where)


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """GRPO's records, TRL's prompt-only format: each a `prompt`, a text or a conversation (a list of {"role",
    "content"} messages), and any other columns, which the reward functions get by name; from a .jsonl file, a
    table or a datasets folder."""
    path = Path(path)
    rows = _json_records(path, "GRPO's prompts")
    for record, where in rows:
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if isinstance(prompt, list):
            check_messages(prompt, f"{where}: 'prompt'")
        elif not isinstance(prompt, str):
            raise DataError(f"{where} has no 'prompt' field, a text or a list of messages; each record must be an "
                            'object like {"prompt": "..."} or {"prompt": [{"role": "user", "content": "..."}]} '
                            "(its other fields go to the reward functions)")
    if not rows:
        raise DataError(f"{path} holds no prompts; add records with a 'prompt' field")
    return [dict(record) for record, _ in rows]
