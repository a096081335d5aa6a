"""Offline byte-level BPE tokenizers: train one in seconds, or load GPT-2-style files from a folder.

Nothing here downloads: a tokenizer is either trained on text the user has
(or on `pydoc_data`, which every Python ships) or read from files on disk.
"""
from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from streamer.errors import TokenizerError

EOS_TOKEN = "<|endoftext|>"
# 256 byte symbols plus the end-of-text token: the smallest vocabulary that can
# encode every string.
MIN_VOCAB = 257
# (vocab, merges) file names: Hugging Face's, then OpenAI's original GPT-2 names.
_BPE_FILE_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))
# A loaded tokenizer's own files, copied verbatim into the run and from there into an export, so that
# transformers.AutoTokenizer reads the chat template, special tokens, model_max_length and padding side the
# user chose. chat_template.jinja is where recent transformers keep the template (it wins over the config's).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "encoder.json", "vocab.bpe", "chat_template.jinja",
                   "chat_template.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` with the few operations training and generation need."""

    backend: tokenizers.Tokenizer
    eos_token: str = EOS_TOKEN
    bos_token: str | None = None  # None: it has none (a chat template's bos_token is then empty, as in transformers)
    chat_template: str | None = None  # Jinja, as transformers' apply_chat_template renders it
    source: Path | None = None  # the folder it was loaded from, whose files `save` copies verbatim

    def __post_init__(self) -> None:
        for name, token in (("end-of-text", self.eos_token), ("beginning-of-text", self.bos_token)):
            if token is not None and self.backend.token_to_id(token) is None:
                raise TokenizerError(f"the tokenizer has no {name} token {token!r}; "
                                     "add it to the vocabulary or name the right one in tokenizer_config.json")

    @property
    def eos_id(self) -> int:
        token_id = self.backend.token_to_id(self.eos_token)
        assert token_id is not None  # __post_init__ checked that the vocabulary has it
        return token_id

    @property
    def bos_id(self) -> int:
        token_id = self.backend.token_to_id(self.bos_token or self.eos_token)
        assert token_id is not None  # __post_init__ checked that the vocabulary has it
        return token_id

    def with_chat_template(self, path: str | Path) -> Tokenizer:
        """This tokenizer rendering chats with the Jinja template in `path` (`--chat-template FILE`)."""
        try:
            return replace(self, chat_template=Path(path).read_text(encoding="utf-8-sig"))
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"cannot read --chat-template {path} ({_brief(exc)}); pass a UTF-8 Jinja "
                                 "template file") from None

    @property
    def vocab_size(self) -> int:
        """Ids run from 0 to vocab_size - 1, special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """The text's own tokens, without the special tokens the tokenizer adds around a whole text."""
        return self.backend.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def affixes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(before, after): the special tokens the tokenizer's post-processor adds around a text, as
        transformers' `tokenizer(text)` adds them: Llama 3's <|begin_of_text|> before; nothing for Qwen, GPT-2 or
        GPT-J. Read off one encoding with them and one without, so any post-processor is read as it runs."""
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return tuple(full[:start]), tuple(full[start + len(plain):])
        raise TokenizerError("the tokenizer's post-processor changes a text's own tokens, not only adds special "
                             "tokens around them; use a tokenizer.json whose post_processor only adds tokens")

    def prompt_ids(self, prompt: str) -> list[int]:
        """A prompt's ids as training saw its examples begin: the tokens the tokenizer adds before a text (BOS)
        unless the prompt already starts with them (a chat template's rendering holds its own BOS)."""
        ids, before = self.encode(prompt), list(self.affixes[0])
        return ids if ids[:len(before)] == before else before + ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        # Keep the end-of-text token unless asked: a decoded sample should show where it ended.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | Path) -> None:
        """A loaded tokenizer's own files, copied verbatim; a trained one's (or what a loaded one's lack)
        tokenizer.json plus the two small files `transformers.AutoTokenizer` reads beside it. A chat template
        that is not the files' own (one from --chat-template) goes into chat_template.jinja, which transformers
        prefers to tokenizer_config.json's."""
        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
            copied: list[str] = []
            if self.source is not None:
                copied = [name for name in TOKENIZER_FILES if (self.source / name).is_file()]
                for name in copied:
                    shutil.copyfile(self.source / name, path / name)
            # What the source lacks (OpenAI's encoder.json + vocab.bpe have no tokenizer.json, which
            # AutoTokenizer needs, nor a config naming the special tokens) is written as for a trained one.
            if "tokenizer.json" not in copied:
                self.backend.save(str(path / "tokenizer.json"))
            if "tokenizer_config.json" not in copied:
                self._write_config(path)
            if self.chat_template is not None and self.chat_template != _chat_template(path):
                (path / CHAT_TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")
        except OSError as exc:
            raise TokenizerError(f"cannot save the tokenizer to {path} ({exc}); choose a writable folder") from None

    def _write_config(self, path: Path) -> None:
        specials = {"bos_token": self.bos_token or self.eos_token, "eos_token": self.eos_token,
                    "unk_token": self.eos_token}
        (path / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_prefix_space": False,
                  "clean_up_tokenization_spaces": False, **specials}
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


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
    return Tokenizer(backend, bos_token=EOS_TOKEN)  # GPT-2's: end-of-text begins a text too


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Read `tokenizer.json`, or a GPT-2-style vocab.json + merges.txt (or encoder.json + vocab.bpe) pair."""
    path = Path(directory)
    if not path.is_dir():
        raise TokenizerError(f"{path} is not a folder; pass the folder that holds tokenizer.json")
    eos, bos = _special_token(path, "eos_token") or EOS_TOKEN, _special_token(path, "bos_token")
    if not any((path / name).is_file() for name in ("tokenizer_config.json", "special_tokens_map.json")):
        bos = eos  # GPT-2's files name no special tokens; `save` writes a config that names end-of-text for both
    found: dict[str, Any] = {"eos_token": eos, "bos_token": bos, "chat_template": _chat_template(path),
                             "source": path.resolve()}
    if (path / "tokenizer.json").is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises plain Exception for every parse error
            raise TokenizerError(f"{path / 'tokenizer.json'} is not a valid tokenizer ({_brief(exc)}); "
                                 "replace it or delete it to use vocab.json + merges.txt") from None
        return Tokenizer(backend, **found)
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
            return Tokenizer(backend, **found)
    raise TokenizerError(f"{path} holds no tokenizer: expected tokenizer.json, or vocab.json + merges.txt "
                         "(or encoder.json + vocab.bpe); copy the model's tokenizer files there")


def _byte_level(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _json_object(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text(encoding="utf-8-sig"))  # a byte-order mark (Notepad) is no error
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{file} is not a JSON object ({_brief(exc)}); fix or delete it") from None
    if not isinstance(raw, dict):
        raise TokenizerError(f"{file} is not a JSON object (it holds a {type(raw).__name__}); fix or delete it")
    return raw


def _special_token(path: Path, key: str) -> str | None:
    """The token (eos_token, bos_token) a folder's tokenizer_config.json or special_tokens_map.json names."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        token = _json_object(path / name).get(key)
        if isinstance(token, dict):  # transformers' serialized AddedToken
            token = token.get("content")
        if isinstance(token, str) and token:
            return token
    return None


def _chat_template(path: Path) -> str | None:
    """The folder's chat template: chat_template.jinja, else tokenizer_config.json's (a string, or transformers'
    list of named templates, of which "default" is the one apply_chat_template uses)."""
    if (path / CHAT_TEMPLATE_FILE).is_file():
        return (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8-sig")
    template = _json_object(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


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
