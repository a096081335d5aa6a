"""Fine-tuning data: examples to fixed-length token sequences, and a resumable batch order.

The files and their records are read by streamer/io/records.py. Text is concatenated with an end-of-text token
between documents and cut into sequences of exactly `seq` tokens. A prompt/completion example (Alpaca records are
ones) or a conversation stays whole in one sequence; only the completion (and end-of-text), or the assistant
turns, are learned.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Protocol, Sequence

import torch

from layers import IGNORE_INDEX
from memory_model.settings import Choice, Integer, Number, Text, check_settings, flag, setting
from streamer.errors import DataError
from streamer.io.chat import chat_pieces, check_messages, render
from streamer.io.records import Example, read_examples


def _setting_error(key: str, problem: str) -> DataError:
    return DataError(f"{flag(key)} {problem}")


PACKINGS = ("examples", "documents")
LONG_EXAMPLES = ("truncate", "drop")
TRUNCATION_MODES = ("keep_start", "keep_end")  # TRL's DPOConfig.truncation_mode


@dataclass(frozen=True)
class DataConfig:
    """What a run trains and evaluates on, and the tokenizer that reads it (each a `streamer train` flag)."""

    data: str | None = setting(None, "a .txt file; .jsonl, .parquet or .csv of {\"text\"}, {\"prompt\", "
                                     "\"completion\"}, Alpaca {\"instruction\", \"input\", \"output\"} or chat "
                                     "{\"messages\"} records; or a datasets save_to_disk folder (default: Python's "
                                     "own help topics)", Text(), "FILE")
    tokenizer: str | None = setting(None, "a folder with tokenizer.json or vocab.json + merges.txt "
                                          "(default: --from-pretrained's, else a BPE trained on the data)",
                                    Text(), "DIR")
    vocab_size: int | None = setting(None, "vocabulary of the trained BPE (default: the model's)",
                                     Integer(257, " (256 bytes + end-of-text)"))
    pack: str | None = setting(None, "pack several prompt/completion or chat examples into one sequence, each "
                                     "attending only to itself with positions from 0 (a bare --pack: examples); "
                                     "documents: also give each document of plain text its own attention and "
                                     "positions (default: examples padded one to a sequence, text documents "
                                     "attending across each other)", Choice(PACKINGS, bare="examples"), "WHAT")
    eval_fraction: float = setting(0.05, "fraction of sequences held out for evaluation (unused with "
                                         "--eval-data)", Number(0.0, 1.0, high_open=True))
    eval_data: str | None = setting(None, "held-out data to evaluate on, in any --data format (default: "
                                          "--eval-fraction of --data)", Text(), "FILE")
    chat_template: str | None = setting(None, "a Jinja chat template for {\"messages\"} records (default: the "
                                              "tokenizer's chat_template)", Text(), "FILE")
    long_examples: str = setting("truncate", "a prompt/completion or chat example longer than --seq: truncate keeps "
                                             "its first --seq tokens (as TRL and axolotl do; one left with nothing "
                                             "to learn is dropped), drop leaves it out", Choice(LONG_EXAMPLES), "WHAT")
    max_length: int | None = setting(None, "DPO: the most tokens of a pair's row, prompt and completion, cut as "
                                           "--truncation-mode says (TRL's max_length; default: --seq, at most --seq)",
                                     Integer(2), "N")
    truncation_mode: str = setting("keep_start", "DPO: keep_start keeps a row's first --max-length tokens and drops a "
                                                 "pair whose prompt fills them; keep_end keeps its last ones (TRL's "
                                                 "truncation_mode)", Choice(TRUNCATION_MODES), "MODE")
    max_prompt_length: int | None = setting(None, "DPO: the most tokens of a prompt (TRL's max_prompt_length, before "
                                                  "TRL 1.0): keep_end keeps a longer prompt's last ones; keep_start "
                                                  "cuts no prompt and refuses it (default: no limit)", Integer(), "N")

    def __post_init__(self) -> None:
        check_settings(self, _setting_error)


# input_ids, labels, positions (None: every row one sequence) and attention mask (None: no padding) of a batch of rows.
Batch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


class TokenizerLike(Protocol):
    # Read-only members, so that a frozen dataclass (Tokenizer) or a property satisfies them.
    @property
    def eos_id(self) -> int: ...
    @property
    def eos_token(self) -> str: ...
    @property
    def bos_token(self) -> str | None: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def affixes(self) -> tuple[tuple[int, ...], tuple[int, ...]]: ...  # the special tokens before and after a text

    def encode(self, text: str) -> list[int]: ...


def demo_corpus() -> list[str]:
    """English prose every Python installation has offline: the interpreter's help topics."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


@dataclass(frozen=True)
class Dataset:
    """Token sequences of one fixed length: input_ids and labels, both LongTensor (N, seq); -100 = no loss.

    positions (N, seq): each token's position in its example where rows hold packed examples (restarting at 0
    in each, so that they attend only to themselves); None: every row is one sequence, positions 0..seq-1.
    attention_mask (N, seq), bool: transformers' attention mask, False on the padding after a row's examples,
    which a mixture's load-balancing loss leaves out as transformers does; None: no row is padded.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    truncated: int = 0  # examples longer than seq that tokenize cut to seq tokens
    dropped: int = 0  # and those it left out (--long-examples drop, or nothing left to learn once cut)

    def __post_init__(self) -> None:
        tensors = (self.input_ids, self.labels) + (() if self.positions is None else (self.positions,))
        if self.input_ids.ndim != 2 or any(t.shape != self.input_ids.shape or t.dtype != torch.long for t in tensors):
            raise ValueError("input_ids, labels and positions must be LongTensors of one shape (N, seq)")
        mask = self.attention_mask
        if mask is not None and (mask.shape != self.input_ids.shape or mask.dtype != torch.bool):
            raise ValueError("attention_mask must be a BoolTensor of input_ids' shape (N, seq)")
        if len(self) == 0:
            raise DataError("the dataset holds no sequence; add data or lower --seq")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq(self) -> int:
        return self.input_ids.shape[1]

    def subset(self, indices: torch.Tensor) -> Dataset:
        return Dataset(*self.rows(indices))

    def split(self, eval_fraction: float, seed: int = 0) -> tuple[Dataset, Dataset | None]:
        """(train, held-out) drawn by a seeded permutation; held-out is None only if it would be empty."""
        if not 0 <= eval_fraction < 1:
            raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
        if eval_fraction == 0 or len(self) < 2:
            return self, None
        n_eval = min(max(1, round(len(self) * eval_fraction)), len(self) - 1)
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        return self.subset(order[n_eval:].sort().values), self.subset(order[:n_eval].sort().values)

    def rows(self, indices: torch.Tensor | slice) -> Batch:
        """input_ids, labels, positions (None: unpacked) and attention mask (None: no padding) of some rows."""
        return (self.input_ids[indices], self.labels[indices],
                None if self.positions is None else self.positions[indices],
                None if self.attention_mask is None else self.attention_mask[indices])

    def batches(self, batch: int) -> Iterator[Batch]:
        """One pass in order (for evaluation); the last batch may be smaller."""
        for start in range(0, len(self), batch):
            yield self.rows(slice(start, start + batch))


def tokenize(examples: Iterable[Example | str], tokenizer: TokenizerLike, seq: int,
             pack: str | None = None, long_examples: str = "truncate") -> Dataset:
    """Text is packed end to end into `seq`-token sequences (the tail that does not fill one is dropped).

    A text document and a prompt/completion example are tokenized as transformers' `tokenizer(text)` and TRL
    tokenize them: with the special tokens the tokenizer adds around a text (Llama 3's <|begin_of_text|>
    before it; none for GPT-2, GPT-J or Qwen), then end-of-text unless they already end with it. A
    conversation is its chat template's rendering alone, which holds its own special tokens, as TRL's
    `apply_chat_template` gives it.

    Each prompt/completion example becomes its prompt and completion, labels -100 on the prompt (and the
    tokens added before it); it gets a sequence of its own, padded (input end-of-text, label -100, attention
    mask False), or with
    `pack` shares one with the next examples that still fit. A conversation is its rendered pieces, labels -100
    on all but the assistant turns (the template writes its own end of turn). An example longer than `seq` is
    cut to its first `seq` tokens (`long_examples="truncate"`, as TRL and axolotl cut it) or left out
    ("drop"); the Dataset counts both. Packed examples are independent, as transformers'
    DataCollatorWithFlattening makes them: their positions restart at 0 (Dataset.positions), so each attends
    only to itself, and their first token is not learned (it would be predicted from the example before).
    With pack="documents" text documents are split the same way (a sequence's first token starts a piece of
    its own); otherwise they attend across each other with positions 0..seq-1, as they always have.
    """
    if pack is not None and pack not in PACKINGS:
        raise DataError(f"--pack must be one of {', '.join(PACKINGS)}, got {pack!r}")
    if long_examples not in LONG_EXAMPLES:
        raise DataError(f"--long-examples must be one of {', '.join(LONG_EXAMPLES)}, got {long_examples!r}")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 2:
        raise DataError(f"seq must be an integer >= 2 (a token and the one it predicts), got {seq!r}")
    eos = tokenizer.eos_id
    stream: list[int] = []
    document_starts: list[int] = []  # where each text document begins in the stream
    rows: list[tuple[list[int], list[int], list[int]]] = []  # ids, labels, positions
    truncated = dropped = 0
    for example in examples:
        example = example if isinstance(example, Example) else Example(example)
        if example.completion is None and example.messages is None:
            document_starts.append(len(stream))
            before, after = tokenizer.affixes
            stream += _ended([*before, *tokenizer.encode(example.text), *after], eos)
            continue
        ids, labels = _supervised(example, tokenizer)
        if len(ids) > seq:
            ids, labels = ids[:seq], labels[:seq]
            if long_examples == "drop" or all(label == IGNORE_INDEX for label in labels[1:]):
                dropped += 1
                continue
            truncated += 1
        length = len(ids)
        if pack and rows and len(rows[-1][0]) + length <= seq:
            rows[-1][0].extend(ids)
            rows[-1][1].extend([IGNORE_INDEX] + labels[1:])
            rows[-1][2].extend(range(length))
        else:
            rows.append((ids, labels, list(range(length))))
    n_text = len(stream) // seq
    if n_text == 0 and not rows:
        if dropped:
            raise DataError(f"the data holds {len(stream)} tokens of text, fewer than one sequence of seq={seq}, "
                            f"and {dropped} longer examples were dropped (--long-examples {long_examples}); raise "
                            "--seq or add data")
        raise DataError(f"the data holds {len(stream)} tokens, fewer than one sequence of seq={seq}; "
                        "lower --seq or add data")
    text = torch.tensor(stream[:n_text * seq], dtype=torch.long).view(n_text, seq)
    text_labels, text_positions = text.clone(), torch.arange(seq).expand(n_text, seq).clone()
    if pack == "documents":
        starts = torch.zeros(len(stream) + 1, dtype=torch.bool)
        starts[document_starts] = True
        starts = starts[:n_text * seq].view(n_text, seq)
        text_labels[starts] = IGNORE_INDEX  # predicted from the document before
        starts[:, 0] = True
        # Each token's distance from the last start at or before it.
        text_positions -= torch.where(starts, text_positions, 0).cummax(dim=1).values
    padded = torch.full((len(rows), seq), eos, dtype=torch.long)
    masked = torch.full((len(rows), seq), IGNORE_INDEX, dtype=torch.long)
    positions = torch.arange(seq).expand(len(rows), seq).clone()  # padding runs on from the last example
    real = torch.zeros((len(rows), seq), dtype=torch.bool)
    for i, (ids, labels, places) in enumerate(rows):
        padded[i, :len(ids)] = torch.tensor(ids)
        real[i, :len(ids)] = True
        masked[i, :len(labels)] = torch.tensor(labels)
        positions[i, :len(places)] = torch.tensor(places)
        positions[i, len(places):] += places[-1] + 1 - len(places)
    positions = torch.cat([text_positions, positions])
    # Rows that each hold one sequence train on the unmasked causal path, as without packing.
    unpacked = bool((positions == torch.arange(seq)).all())
    attention_mask = torch.cat([torch.ones_like(text, dtype=torch.bool), real])
    return Dataset(torch.cat([text, padded]), torch.cat([text_labels, masked]), None if unpacked else positions,
                   None if attention_mask.all() else attention_mask, truncated, dropped)


def long_examples_line(dataset: Dataset, seq: int, long_examples: str) -> str | None:
    """The one line that says what became of the examples longer than `seq`; None if there were none."""
    if not dataset.truncated and not dataset.dropped:
        return None
    done = [f"{dataset.truncated} truncated to their first {seq} tokens"] if dataset.truncated else []
    if dataset.dropped:
        why = "" if long_examples == "drop" else " (nothing left to learn once truncated)"
        done.append(f"{dataset.dropped} dropped{why}")
    other = "drop" if long_examples == "truncate" else "truncate"
    count = dataset.truncated + dataset.dropped
    return (f"{count} example{' is' if count == 1 else 's are'} longer than --seq {seq}: {' and '.join(done)} "
            f"(--long-examples {long_examples}; --long-examples {other} or a longer --seq to change that)")


def _ended(ids: list[int], eos: int) -> list[int]:
    """ids with end-of-text after them, unless they already end with it (a tokenizer that adds it)."""
    return ids if ids[-1:] == [eos] else [*ids, eos]


def _supervised(example: Example, tokenizer: TokenizerLike) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a prompt/completion pair or a conversation: only what the model answers is learned.
    A pair gets the tokens the tokenizer adds around a text, the context before it and learned after it."""
    if example.messages is None:
        before, after = tokenizer.affixes
        pieces: Sequence[tuple[str, bool]] = ((example.text, False), (example.completion or "", True))
    else:
        before, after = (), ()
        pieces = chat_pieces(example.messages, tokenizer.chat_template, _specials(tokenizer), example.where)
    ids, labels = list(before), [IGNORE_INDEX] * len(before)
    for text, learned in pieces:
        piece = tokenizer.encode(text)
        ids += piece
        labels += piece if learned else [IGNORE_INDEX] * len(piece)
    ids += after
    labels += after
    if example.messages is None:  # the template writes a conversation's own end of turn
        tail = _ended(ids, tokenizer.eos_id)[len(ids):]
        ids, labels = ids + tail, labels + tail
    return ids, labels


def _specials(tokenizer: TokenizerLike) -> dict[str, str]:
    """The special tokens chat templates use."""
    bos = {} if tokenizer.bos_token is None else {"bos_token": tokenizer.bos_token}
    return {"eos_token": tokenizer.eos_token, **bos}  # one the tokenizer lacks is undefined, as in transformers


def prompt_of(example: Example, tokenizer: TokenizerLike) -> str:
    """What a model trained on `example` is prompted with: a pair's prompt; a conversation up to its first
    assistant turn, rendered by the chat template with the assistant's header; else a document's first 8 words."""
    if example.messages is not None and tokenizer.chat_template is not None:
        asks = next((k for k, m in enumerate(example.messages) if m["role"] == "assistant"), len(example.messages))
        return render(tokenizer.chat_template, list(example.messages[:asks]), _specials(tokenizer),
                      add_generation_prompt=True)
    if example.completion is not None:
        return example.text
    return " ".join(example.text.split()[:8])


def chat_prompt(messages: list[dict[str, str]], tokenizer: TokenizerLike, where: str,
                add_generation_prompt: bool = True) -> str:
    """The conversation rendered by the chat template with the assistant's header after it, as transformers'
    apply_chat_template(messages, add_generation_prompt=True) writes it: the text a chat model answers
    (`add_generation_prompt` False: the conversation alone)."""
    if tokenizer.chat_template is None:
        raise DataError("the run's tokenizer has no chat template to render a conversation with; pass "
                        "--chat-template FILE (a Jinja template)")
    return render(tokenizer.chat_template, check_messages(messages, where), _specials(tokenizer),
                  add_generation_prompt=add_generation_prompt)


def load_dataset(path: str | Path, tokenizer: TokenizerLike, seq: int, pack: str | None = None,
                 whole_file: bool = False, long_examples: str = "truncate") -> Dataset:
    """read_examples + tokenize; a data file's name is in every error it can cause."""
    examples = read_examples(path, whole_file)
    try:
        return tokenize(examples, tokenizer, seq, pack, long_examples)
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

    def __next__(self) -> Batch:
        picked: list[torch.Tensor] = []
        while sum(len(p) for p in picked) < self.batch:
            take = min(self.batch - sum(len(p) for p in picked), len(self._order) - self.position)
            picked.append(self._order[self.position:self.position + take])
            self.position += take
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
        return self.dataset.rows(torch.cat(picked))

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

