"""Chat records (`{"messages": [{"role", "content"}, ...]}`) rendered with a tokenizer's chat template.

The template is Jinja, rendered as transformers' `apply_chat_template` renders it (a sandboxed environment,
`trim_blocks` and `lstrip_blocks`, `raise_exception`, `strftime_now`, its `tojson`, loop controls, no `tools`),
so a model fine-tuned here sees the text it will be prompted with after export, and `streamer generate --chat`
prompts it with that text. Only the assistant turns are learned. Templates mark no turn boundaries, so they are
found by rendering growing prefixes of the conversation: the text an assistant message adds after the prompt
that asks for it (`add_generation_prompt=True`) is learned; everything else (system, user, the assistant's role
header) is context.

A template is bounded as it renders (`Bounded`): each render may take at most RENDER_STEPS iterations of `range`
and calls, RENDER_SECONDS of time and RENDER_CHARS characters of any string or list it multiplies, so a hostile
template is refused in one line instead of hanging or filling memory.
"""
from __future__ import annotations

import contextlib
import functools
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from streamer.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
# Far beyond what rendering a conversation takes (a few steps and microseconds per message), and small enough
# that a refusal comes at once: range's iterations and calls, seconds, and the length of a multiplied string or list.
RENDER_STEPS = 1_000_000
RENDER_SECONDS = 10.0
RENDER_CHARS = 2**24


class TemplateTooCostly(Exception):
    """A render went past its steps, time or size."""


class _Budget(threading.local):
    steps = 0
    deadline = float("inf")

    def charge(self, steps: int) -> None:
        self.steps -= steps
        if self.steps < 0:
            raise TemplateTooCostly(f"more than {RENDER_STEPS:,} loop iterations and calls")
        if time.monotonic() > self.deadline:
            raise TemplateTooCostly(f"more than {RENDER_SECONDS:g} s")


_BUDGET = _Budget()


@functools.cache
def _compiled(template: str) -> Any:
    """The template in transformers' environment: its globals, its `tojson` (no HTML escaping), loop controls,
    and its `{% generation %}` block (which only marks the assistant's text; its body renders as it is)."""
    from datetime import datetime

    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox, with each render's work bounded (`_BUDGET`): range charges its length, each call one step,
        and `*` and `**` may not build a string, list or number past RENDER_CHARS."""
        intercepted_binops = frozenset({"*", "**"})

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            _BUDGET.charge(1)
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

    def bounded_range(*args: int) -> range:
        numbers = range(*args)
        _BUDGET.charge(len(numbers))
        return numbers

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.globals["range"] = bounded_range
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env.from_string(template)


def render(template: str, messages: list[dict[str, str]], specials: dict[str, str],
           add_generation_prompt: bool = False) -> str:
    """The conversation as the template writes it; `specials`: bos_token and eos_token, which templates use (one
    the tokenizer lacks is left out, and renders empty, as in transformers). `tools` and `documents` are None, as
    apply_chat_template passes them without any."""
    from jinja2 import TemplateError
    try:
        with _bounded():
            return _compiled(template).render(messages=messages, tools=None, documents=None,
                                              add_generation_prompt=add_generation_prompt, **specials)
    except TemplateError as exc:
        raise DataError(f"the chat template failed ({' '.join(str(exc).split())}); fix the template or the "
                        "conversation") from None
    except TemplateTooCostly as exc:
        raise DataError(f"the chat template went past its bounds rendering {len(messages)} message(s) ({exc}), "
                        "far more than a chat template needs; fix the template (--chat-template, or the "
                        "tokenizer's)") from None


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*" and isinstance(left, int) and not isinstance(right, int):
        left, right = right, left
    size: float
    if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
        size = len(left) * right
    elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)) and abs(left) > 1:
        size = right  # bounds the digits of an integer power; a float's overflows at once
    else:
        return
    if size > RENDER_CHARS:
        raise TemplateTooCostly(f"a value of more than {RENDER_CHARS:,} elements from `{operator}`")


@contextlib.contextmanager
def _bounded() -> Iterator[None]:
    """Start a render's budget; on the main thread a timer also interrupts a loop that makes no calls (unless
    another timer is running, which is left as it is)."""
    _BUDGET.steps, _BUDGET.deadline = RENDER_STEPS, time.monotonic() + RENDER_SECONDS
    timed = threading.current_thread() is threading.main_thread() and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    if timed:
        def expire(*_: Any) -> None:
            raise TemplateTooCostly(f"more than {RENDER_SECONDS:g} s")
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, RENDER_SECONDS)
    try:
        yield
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        _BUDGET.deadline = float("inf")


def chat_pieces(messages: Any, template: str | None, specials: dict[str, str],
                where: str) -> tuple[tuple[str, bool], ...]:
    """(text, learned) pieces whose concatenation is the rendered conversation; learned = an assistant turn."""
    if template is None:
        raise DataError(f"{where} is a chat record but the tokenizer has no chat_template; pass --chat-template "
                        "FILE (a Jinja template)")
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


def read_messages(path: str | Path) -> list[dict[str, str]]:
    """A conversation from `--messages FILE`: a JSON list of {"role", "content"} objects (what transformers'
    apply_chat_template takes), a chat record {"messages": [...]}, or JSON Lines of one message each."""
    where = f"--messages {path}"
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        problem = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise DataError(f"cannot read {where} ({problem}); pass a JSON or JSON Lines file of "
                        "{\"role\", \"content\"} messages") from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError:
        loaded = []
        for number, line in enumerate(text.splitlines(), 1):
            try:
                loaded += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as exc:
                raise DataError(f"{where} is neither JSON nor JSON Lines (line {number}: {exc.msg}); write a JSON "
                                "list of {\"role\", \"content\"} messages or one message per line") from None
    if isinstance(loaded, dict):
        loaded = loaded["messages"] if "messages" in loaded else [loaded]
    return check_messages(loaded, where)
