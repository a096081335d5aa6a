"""Preference pairs to DPO's rows as TRL's DPOTrainer makes them (`--method dpo`).

A conversation is rendered by the chat template (the prompt with the assistant's header), and its text's tokens
taken. Plain text is tokenized whole, with the special tokens the tokenizer adds around a text (transformers'
`tokenizer(text)`); end-of-text is appended to a completion that lacks it, as text. The completion starts where
the prompt's tokens and the prompt-and-completion's part (tokens may merge across the boundary). A batch is every
chosen row, then every rejected row: prompt and completion cut to `max_length` as TRL's collator cuts them
(keep_start: the row's first tokens, a pair whose prompt fills them dropped; keep_end: its last tokens), padded on
the right; the labels are the completion's tokens, -100 elsewhere. `max_prompt_length` (TRL's before 1.0) cuts a
longer prompt to its last tokens under keep_end; keep_start, which cuts no prompt, refuses it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from layers import IGNORE_INDEX
from streamer.errors import DataError
from streamer.io.data import TokenizerLike, chat_prompt
from streamer.io.records import Pair


@dataclass(frozen=True)
class PairIds:
    """A pair's token ids: its prompt's, and each completion's after it."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def tokenize_pair(pair: Pair, tokenizer: TokenizerLike) -> PairIds:
    """TRL's tokenization of a pair: a conversation rendered by the chat template (the prompt with the assistant's
    header) and its text's tokens; plain text tokenized whole, end-of-text appended to each completion."""
    if pair.conversational:
        assert not isinstance(pair.prompt, str) and not isinstance(pair.chosen, str) \
            and not isinstance(pair.rejected, str)  # every field a conversation

        def rendered(messages: tuple, header: bool) -> list[int]:
            return tokenizer.encode(chat_prompt(list(messages), tokenizer, pair.where, add_generation_prompt=header))

        prompt = rendered(pair.prompt, True)
        chosen, rejected = rendered(pair.prompt + pair.chosen, False), rendered(pair.prompt + pair.rejected, False)
    else:
        assert isinstance(pair.prompt, str) and isinstance(pair.chosen, str) and isinstance(pair.rejected, str)
        before, after = tokenizer.affixes

        def ids(text: str) -> list[int]:
            return [*before, *tokenizer.encode(text), *after]

        def ended(text: str) -> str:
            return text if text.endswith(tokenizer.eos_token) else text + tokenizer.eos_token

        prompt = ids(pair.prompt)
        chosen, rejected = ids(pair.prompt + ended(pair.chosen)), ids(pair.prompt + ended(pair.rejected))
    start = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    return PairIds(prompt[:start], chosen[start:], rejected[start:])


def tokenize_pairs(pairs: Sequence[Pair], tokenizer: TokenizerLike, max_length: int,
                   truncation_mode: str = "keep_start", max_prompt_length: int | None = None) -> list[PairIds]:
    """Every pair tokenized. A prompt over `max_prompt_length` tokens keeps its last ones under keep_end and is
    refused in one line under keep_start. Under keep_start a pair whose prompt alone fills `max_length` is left
    out (no completion token would be left: TRL drops it too)."""
    out = []
    for pair in pairs:
        ids = tokenize_pair(pair, tokenizer)
        if max_prompt_length is not None and len(ids.prompt) > max_prompt_length:
            if truncation_mode == "keep_start":
                raise DataError(f"{pair.where}: its prompt is {len(ids.prompt)} tokens, over --max-prompt-length "
                                f"{max_prompt_length}, and --truncation-mode keep_start cuts no prompt; raise "
                                "--max-prompt-length, or keep a prompt's last tokens with --truncation-mode keep_end")
            ids = PairIds(ids.prompt[-max_prompt_length:], ids.chosen, ids.rejected)
        if truncation_mode == "keep_end" or len(ids.prompt) < max_length:
            out.append(ids)
    return out


def pair_rows(pairs: Sequence[PairIds], pad_id: int, max_length: int, seq: int | None = None,
              truncation_mode: str = "keep_start") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), (2 x pairs, T): TRL's DataCollatorForPreference, each row cut to `max_length` as
    `truncation_mode` says. T is the longest row, or `seq`."""
    rows = [(p.prompt + c, [IGNORE_INDEX] * len(p.prompt) + c) for c_of in ("chosen", "rejected")
            for p in pairs for c in (getattr(p, c_of),)]
    kept = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
    rows = [(ids[kept], labels[kept]) for ids, labels in rows]
    length = seq if seq is not None else max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        input_ids[i, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        labels[i, :len(row_labels)] = torch.tensor(row_labels, dtype=torch.long)
    return input_ids, labels


def _common_prefix(ids: list[int], other: list[int]) -> int:
    length = 0
    for token, other_token in zip(ids, other, strict=False):
        if token != other_token:
            break
        length += 1
    return length
