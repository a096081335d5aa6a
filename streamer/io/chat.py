"""Chat records (`{"messages": [{"role", "content"}, ...]}`) rendered with a tokenizer's chat template.

The template is Jinja, rendered as transformers' `apply_chat_template` renders it (a sandboxed environment,
`trim_blocks` and `lstrip_blocks`, `raise_exception`), so a model fine-tuned here sees the text it will be
prompted with after export. Only the assistant turns are learned. Templates mark no turn boundaries, so they are
found by rendering growing prefixes of the conversation: the text an assistant message adds after the prompt
that asks for it (`add_generation_prompt=True`) is learned; everything else (system, user, the assistant's role
header) is context.
"""
from __future__ import annotations

import functools
from typing import Any

from streamer.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


@functools.cache
def _compiled(template: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render(template: str, messages: list[dict[str, str]], specials: dict[str, str],
           add_generation_prompt: bool = False) -> str:
    """The conversation as the template writes it; `specials`: bos_token and eos_token, which templates use (one
    the tokenizer lacks is left out, and renders empty, as in transformers)."""
    from jinja2 import TemplateError
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           **specials)
    except TemplateError as exc:
        raise DataError(f"the chat template failed ({' '.join(str(exc).split())}); fix the template or the "
                        "conversation") from None


def chat_pieces(messages: Any, template: str | None, specials: dict[str, str],
                where: str) -> tuple[tuple[str, bool], ...]:
    """(text, learned) pieces whose concatenation is the rendered conversation; learned = an assistant turn."""
    if template is None:
        raise DataError(f"{where} is a chat record but the tokenizer has no chat_template; pass --chat-template "
                        "FILE (a Jinja template) or a --tokenizer whose tokenizer_config.json has one")
    checked = check_messages(list(messages), where)
    pieces: list[tuple[str, bool]] = []
    done = ""
    for k, message in enumerate(checked):
        if message["role"] == "assistant":
            prompt = render(template, checked[:k], specials, add_generation_prompt=True)
            pieces.append((_after(done, prompt, where, k), False))
            done = prompt
        text = render(template, checked[:k + 1], specials)
        pieces.append((_after(done, text, where, k), message["role"] == "assistant"))
        done = text
    if not any(learned and text for text, learned in pieces):
        raise DataError(f"{where}: 'messages' has no assistant turn with content; add one (only assistant turns "
                        "are learned)")
    return tuple((text, learned) for text, learned in pieces if text)


def _after(done: str, text: str, where: str, k: int) -> str:
    if not text.startswith(done):
        raise DataError(f"{where}: the chat template renders messages[:{k + 1}] as text that does not continue "
                        f"messages[:{k}]'s, so the assistant turns cannot be told apart; use a template that "
                        "renders each message in turn")
    return text[len(done):]


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """`messages` if it is a non-empty list of {"role", "content"} objects, else an error naming the field."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, message in enumerate(messages):
        field = f"{where}: 'messages'[{i}]"
        if not isinstance(message, dict):
            raise DataError(f"{field} must be an object with 'role' and 'content', got {type(message).__name__}")
        if message.get("role") not in ROLES:
            raise DataError(f"{field} 'role' must be one of {', '.join(ROLES)}, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise DataError(f"{field} 'content' must be a string, got {type(message.get('content')).__name__}")
    return messages
