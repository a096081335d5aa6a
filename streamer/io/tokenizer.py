"""Offline byte-level BPE tokenizers: train one in seconds, or load GPT-2-style files from a folder.

Nothing here downloads: a tokenizer is either trained on text the user has
(or on `pydoc_data`, which every Python ships) or read from files on disk.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from streamer.errors import TokenizerError

EOS_TOKEN = "<|endoftext|>"
# 256 byte symbols plus the end-of-text token: the smallest vocabulary that can
# encode every string.
MIN_VOCAB = 257
# (vocab, merges) file names: Hugging Face's, then OpenAI's original GPT-2 names.
_BPE_FILE_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))


@dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` with the few operations training and generation need."""

    backend: tokenizers.Tokenizer
    eos_token: str = EOS_TOKEN

    def __post_init__(self) -> None:
        if self.backend.token_to_id(self.eos_token) is None:
            raise TokenizerError(f"the tokenizer has no end-of-text token {self.eos_token!r}; "
                                 "add it to the vocabulary or name the right one in tokenizer_config.json")

    @property
    def eos_id(self) -> int:
        return self.backend.token_to_id(self.eos_token)

    @property
    def vocab_size(self) -> int:
        """Ids run from 0 to vocab_size - 1, special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        # Keep the end-of-text token: a decoded sample should show where it ended.
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json plus the two small files `transformers.AutoTokenizer` reads beside it."""
        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
            self.backend.save(str(path / "tokenizer.json"))
            specials = {"bos_token": self.eos_token, "eos_token": self.eos_token, "unk_token": self.eos_token}
            (path / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_prefix_space": False,
                      "clean_up_tokenization_spaces": False, **specials}
            (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        except OSError as exc:
            raise TokenizerError(f"cannot save the tokenizer to {path} ({exc}); choose a writable folder") from None


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2's scheme) learned from `texts`, with `<|endoftext|>` as id 0."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_VOCAB:
        raise TokenizerError(f"vocab_size must be an integer >= {MIN_VOCAB} (256 bytes + end-of-text), "
                             f"got {vocab_size!r}")
    backend = _byte_level(tokenizers.Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
        # Every byte gets a token even if the corpus lacks it, so no input is ever unencodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    seen = _Counted(texts)
    backend.train_from_iterator(seen, trainer)
    if not seen.characters:
        raise TokenizerError("no text to train the tokenizer on; pass a non-empty corpus")
    return Tokenizer(backend)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Read `tokenizer.json`, or a GPT-2-style vocab.json + merges.txt (or encoder.json + vocab.bpe) pair."""
    path = Path(directory)
    if not path.is_dir():
        raise TokenizerError(f"{path} is not a folder; pass the folder that holds tokenizer.json")
    eos = _eos_token(path)
    if (path / "tokenizer.json").is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises plain Exception for every parse error
            raise TokenizerError(f"{path / 'tokenizer.json'} is not a valid tokenizer ({_brief(exc)}); "
                                 "replace it or delete it to use vocab.json + merges.txt") from None
        return Tokenizer(backend, eos)
    for vocab, merges in _BPE_FILE_PAIRS:
        if (path / vocab).is_file() and (path / merges).is_file():
            try:
                model = models.BPE.from_file(str(path / vocab), str(path / merges))
            except Exception as exc:
                raise TokenizerError(f"{path / vocab} + {path / merges} are not valid GPT-2 BPE files "
                                     f"({_brief(exc)}); replace them") from None
            backend = _byte_level(tokenizers.Tokenizer(model))
            # The end-of-text token is an ordinary vocab entry in these files;
            # registering it as special stops BPE from splitting it in text.
            backend.add_special_tokens([tokenizers.AddedToken(eos, special=True)])
            return Tokenizer(backend, eos)
    raise TokenizerError(f"{path} holds no tokenizer: expected tokenizer.json, or vocab.json + merges.txt "
                         "(or encoder.json + vocab.bpe); train one with train_bpe or copy the files there")


def _byte_level(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _eos_token(path: Path) -> str:
    """The end-of-text token a folder's tokenizer_config.json or special_tokens_map.json names."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            token = json.loads(file.read_text()).get("eos_token")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise TokenizerError(f"{file} is not a JSON object ({_brief(exc)}); fix or delete it") from None
        if isinstance(token, dict):  # transformers' serialized AddedToken
            token = token.get("content")
        if isinstance(token, str) and token:
            return token
    return EOS_TOKEN


def _brief(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class _Counted:
    """Pass texts through to the trainer while noting whether any held a character."""

    def __init__(self, texts: Iterable[str]) -> None:
        self._texts = texts
        self.characters = 0

    def __iter__(self) -> Iterator[str]:
        for text in self._texts:
            if not isinstance(text, str):
                raise TokenizerError(f"train_bpe needs strings, got {type(text).__name__}")
            self.characters += len(text)
            yield text
