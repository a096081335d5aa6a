"""Fine-tuning data: text and prompt/completion files to fixed-length token sequences, and a resumable batch order.

Sources: a `.txt` file (documents separated by blank lines, or the whole file as
one document) or a `.jsonl` file with `{"text": ...}` or
`{"prompt": ..., "completion": ...}` records. Text is concatenated with an
end-of-text token between documents and cut into sequences of exactly `seq`
tokens. A prompt/completion example stays whole in one sequence and only its
completion (and end-of-text) is learned.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Protocol

import torch

from layers import IGNORE_INDEX
from memory_model.settings import Integer, Number, Switch, Text, check_settings, flag, setting
from streamer.errors import DataError


def _setting_error(key: str, problem: str) -> DataError:
    return DataError(f"{flag(key)} {problem}")


@dataclass(frozen=True)
class DataConfig:
    """What a run trains and evaluates on, and the tokenizer that reads it (each a `streamer train` flag)."""

    data: str | None = setting(None, "a .txt file, or .jsonl of {\"text\"} or {\"prompt\", \"completion\"} records "
                                     "(default: Python's own help topics)", Text(), "FILE")
    tokenizer: str | None = setting(None, "a folder with tokenizer.json or vocab.json + merges.txt "
                                          "(default: --from-pretrained's, else a BPE trained on the data)", Text(), "DIR")
    vocab_size: int | None = setting(None, "vocabulary of the trained BPE (default: the model's)",
                                     Integer(257, " (256 bytes + end-of-text)"))
    pack: bool = setting(False, "pack several prompt/completion examples into one sequence", Switch())
    eval_fraction: float = setting(0.05, "fraction of sequences held out for evaluation",
                                   Number(0.0, 1.0, high_open=True))

    def __post_init__(self) -> None:
        check_settings(self, _setting_error)


class TokenizerLike(Protocol):
    eos_id: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Example:
    """One document (`completion is None`) or one prompt/completion pair, with where it came from."""

    text: str
    completion: str | None = None
    where: str = "text"  # for error messages: "train.jsonl line 7"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not isinstance(self.completion, (str, type(None))):
            raise DataError(f"{self.where}: text, prompt and completion must be strings")


def demo_corpus() -> list[str]:
    """English prose every Python installation has offline: the interpreter's help topics."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def read_examples(path: str | Path, whole_file: bool = False) -> list[Example]:
    """The examples a `.txt` or `.jsonl` file holds; `whole_file` makes a `.txt` file one document."""
    path = Path(path)
    if path.suffix not in (".txt", ".jsonl"):
        raise DataError(f"{path}: unknown data format {path.suffix!r}; use a .txt or .jsonl file")
    try:
        content = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path} does not exist; pass an existing .txt or .jsonl file") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}); "
                        "re-encode it as UTF-8") from None
    except OSError as exc:
        raise DataError(f"cannot read {path} ({exc.strerror}); check the path and its permissions") from None
    examples = _read_jsonl(path, content) if path.suffix == ".jsonl" else _read_text(path, content, whole_file)
    if not examples:
        raise DataError(f"{path} holds no text; add documents to it or choose another file")
    return examples


def _read_text(path: Path, content: str, whole_file: bool) -> list[Example]:
    if whole_file:
        return [Example(content, where=str(path))] if content.strip() else []
    examples, lines, start = [], [], 1
    for number, line in enumerate([*content.split("\n"), ""], start=1):
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            examples.append(Example("\n".join(lines), where=f"{path} line {start}"))
            lines = []
    return examples


def _read_jsonl(path: Path, content: str) -> list[Example]:
    examples = []
    for number, line in enumerate(content.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where} is not valid JSON ({exc.msg} at column {exc.colno}); "
                            "write one JSON object per line") from None
        examples.append(_record_example(record, where))
    return examples


def _record_example(record: Any, where: str) -> Example:
    if not isinstance(record, dict):
        raise DataError(f"{where} holds a JSON {type(record).__name__}; each line must be an object "
                        'like {"text": ...} or {"prompt": ..., "completion": ...}')
    if "prompt" in record and "completion" in record:
        fields = {"prompt": record["prompt"], "completion": record["completion"]}
    elif "text" in record:
        fields = {"text": record["text"]}
    else:
        raise DataError(f"{where} has neither 'text' nor 'prompt' + 'completion' (keys: {sorted(record)[:5]}); "
                        "give each record one of them")
    for name, value in fields.items():
        if not isinstance(value, str):
            raise DataError(f"{where}: {name!r} must be a string, got {type(value).__name__}")
    return Example(fields.get("text", fields.get("prompt")), fields.get("completion"), where)


@dataclass(frozen=True)
class Dataset:
    """Token sequences of one fixed length: input_ids and labels, both LongTensor (N, seq); -100 = no loss."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if (self.input_ids.ndim != 2 or self.input_ids.shape != self.labels.shape
                or self.input_ids.dtype != torch.long or self.labels.dtype != torch.long):
            raise ValueError("input_ids and labels must be LongTensors of one shape (N, seq)")
        if len(self) == 0:
            raise DataError("the dataset holds no sequence; add data or lower --seq")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq(self) -> int:
        return self.input_ids.shape[1]

    def subset(self, indices: torch.Tensor) -> Dataset:
        return Dataset(self.input_ids[indices], self.labels[indices])

    def split(self, eval_fraction: float, seed: int = 0) -> tuple[Dataset, Dataset | None]:
        """(train, held-out) drawn by a seeded permutation; held-out is None only if it would be empty."""
        if not 0 <= eval_fraction < 1:
            raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
        if eval_fraction == 0 or len(self) < 2:
            return self, None
        n_eval = min(max(1, round(len(self) * eval_fraction)), len(self) - 1)
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        return self.subset(order[n_eval:].sort().values), self.subset(order[:n_eval].sort().values)

    def batches(self, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass in order (for evaluation); the last batch may be smaller."""
        for start in range(0, len(self), batch):
            yield self.input_ids[start:start + batch], self.labels[start:start + batch]


def tokenize(examples: Iterable[Example | str], tokenizer: TokenizerLike, seq: int,
             pack: bool = False) -> Dataset:
    """Text is packed end to end into `seq`-token sequences (the tail that does not fill one is dropped).

    Each prompt/completion example becomes prompt + completion + end-of-text,
    with labels -100 on the prompt; it gets a sequence of its own, padded
    (input end-of-text, label -100), or with `pack` shares one with the next
    examples that still fit. An example longer than `seq` is an error, never cut.
    """
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 2:
        raise DataError(f"seq must be an integer >= 2 (a token and the one it predicts), got {seq!r}")
    eos = tokenizer.eos_id
    stream: list[int] = []
    rows: list[tuple[list[int], list[int]]] = []
    for example in examples:
        example = example if isinstance(example, Example) else Example(example)
        if example.completion is None:
            stream += tokenizer.encode(example.text) + [eos]
            continue
        prompt, completion = tokenizer.encode(example.text), tokenizer.encode(example.completion) + [eos]
        length = len(prompt) + len(completion)
        if length > seq:
            raise DataError(f"{example.where}: prompt + completion is {length} tokens, longer than seq={seq}; "
                            "raise --seq or shorten the example")
        ids, labels = prompt + completion, [IGNORE_INDEX] * len(prompt) + completion
        if pack and rows and len(rows[-1][0]) + length <= seq:
            rows[-1][0].extend(ids)
            rows[-1][1].extend(labels)
        else:
            rows.append((ids, labels))
    n_text = len(stream) // seq
    if n_text == 0 and not rows:
        raise DataError(f"the data holds {len(stream)} tokens, fewer than one sequence of seq={seq}; "
                        "lower --seq or add data")
    text = torch.tensor(stream[:n_text * seq], dtype=torch.long).view(n_text, seq)
    padded = torch.full((len(rows), seq), eos, dtype=torch.long)
    masked = torch.full((len(rows), seq), IGNORE_INDEX, dtype=torch.long)
    for i, (ids, labels) in enumerate(rows):
        padded[i, :len(ids)] = torch.tensor(ids)
        masked[i, :len(labels)] = torch.tensor(labels)
    return Dataset(torch.cat([text, padded]), torch.cat([text.clone(), masked]))


def load_dataset(path: str | Path, tokenizer: TokenizerLike, seq: int, pack: bool = False,
                 whole_file: bool = False) -> Dataset:
    """read_examples + tokenize; a data file's name is in every error it can cause."""
    examples = read_examples(path, whole_file)
    try:
        return tokenize(examples, tokenizer, seq, pack)
    except DataError as exc:
        message = str(exc)
        raise DataError(message if str(path) in message else f"{path}: {message}") from None


class BatchStream:
    """Global batches of `batch` sequences, forever: epoch e visits the data in the order seeded by seed + e.

    A batch that reaches the end of an epoch continues into the next one, so
    every sequence is used once per epoch whatever the batch size. The state
    (epoch, position) is two integers: a run resumed from `state_dict()` sees
    exactly the batches an uninterrupted run would have seen.
    """

    def __init__(self, dataset: Dataset, batch: int, seed: int = 0) -> None:
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise DataError(f"batch must be a positive integer, got {batch!r}")
        self.dataset, self.batch, self.seed = dataset, batch, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        return torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        picked = []
        while sum(len(p) for p in picked) < self.batch:
            take = min(self.batch - sum(len(p) for p in picked), len(self._order) - self.position)
            picked.append(self._order[self.position:self.position + take])
            self.position += take
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
        indices = torch.cat(picked)
        return self.dataset.input_ids[indices], self.dataset.labels[indices]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batch": self.batch,
                "sequences": len(self.dataset)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        current = self.state_dict()
        try:
            saved = {key: state[key] for key in current}
        except (KeyError, TypeError):
            raise DataError(f"data state {state!r} lacks {sorted(current)}; resume from a checkpoint "
                            "this version wrote") from None
        changed = [f"{key} {saved[key]} -> {current[key]}" for key in ("seed", "batch", "sequences")
                   if saved[key] != current[key]]
        if changed:
            raise DataError(f"cannot resume the data order: {', '.join(changed)}; resume with the same "
                            "data, --seq, --batch and --seed")
        if not (isinstance(saved["epoch"], int) and saved["epoch"] >= 0
                and isinstance(saved["position"], int) and 0 <= saved["position"] < len(self.dataset)):
            raise DataError(f"data state epoch={saved['epoch']!r} position={saved['position']!r} is out of range; "
                            "the checkpoint is damaged")
        self.epoch, self.position = saved["epoch"], saved["position"]
        self._order = self._permutation()

