"""`streamer generate`: sample text from a run, streaming its layers."""
from __future__ import annotations

import argparse
import time
from typing import Any

from memory_model import format_size
from memory_model.devices import budget_bytes
from streamer.cli.flags import declare_command
from streamer.console import make_console
from streamer.generate import Sampling, complete, continue_ids
from streamer.io.chat import read_messages
from streamer.io.data import chat_prompt
from streamer.io.tokenizer import Tokenizer
from streamer.run import RunError, SettingError
from streamer.run_dir import RunDir
from streamer.runtime.hardware import resolve_compute_dtype
from streamer.store.layout import dtype_name
from streamer.session import open_trainer

EXAMPLES = """\
examples:
  streamer generate RUN --prompt "The for statement"
  streamer generate RUN --prompt "Summary:" --temperature 0 --max-new-tokens 80
  streamer generate RUN --prompt Hi --top-k 40 --top-p 0.9 --seed 3 --budget 32MiB
  streamer generate RUN --chat "What does the for statement do?" --system "Be brief." --max-new-tokens 60

--chat and --messages render a conversation with the run's chat template and the assistant's header after it,
as transformers' apply_chat_template(messages, add_generation_prompt=True) does; --messages FILE is a JSON list
of {"role", "content"} messages (or JSON Lines), and --chat appends a user message to it."""


def declare(parser: argparse.ArgumentParser) -> None:
    declare_command(parser, generate_command, "Generate with streamed layers and a KV cache; works for models "
                    "larger than the budget.", EXAMPLES)
    parser.add_argument("run", metavar="RUN", help="a run directory")
    parser.add_argument("--prompt", help="the text to continue")
    parser.add_argument("--chat", metavar="TEXT", help="a user message for a chat model to answer (after --messages)")
    parser.add_argument("--messages", metavar="FILE", help="a conversation to answer: a JSON list of "
                        "{\"role\", \"content\"} messages, as apply_chat_template takes, or JSON Lines")
    parser.add_argument("--system", metavar="TEXT", help="a system message before the conversation")
    parser.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template (default: the run's)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="(default: 40)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (default: 0, off)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default: 0.95; 1 is off)")
    parser.add_argument("--seed", type=int, default=0, help="(default: 0)")
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every token")
    parser.add_argument("--budget", help="device budget (default: the run's)")
    parser.add_argument("--device", help="torch device (default: the run's)")


def generate_command(args: argparse.Namespace) -> int:
    run = RunDir.open(args.run)
    overrides: dict[str, Any] = {}
    if args.device is not None:
        overrides["device"] = args.device
    if args.budget is not None:
        overrides["budget"] = budget_bytes(args.budget, SettingError)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                        use_cache=not args.no_cache)
    tokenizer = run.load_tokenizer()
    chat = _chat_prompt(args, tokenizer)  # before the run opens: a conversation that cannot render fails at once
    console = make_console()
    with open_trainer(run, overrides) as trainer:
        # The run's recorded dtype (its store holds compute weights in it); say so where it is emulated.
        dtype = resolve_compute_dtype(trainer.tc.device.device, dtype_name(trainer.tc.compute_dtype))
        if dtype.emulated:
            console.print(dtype.reason, markup=False, highlight=False)
        begin = time.perf_counter()
        if chat is None:
            text = complete(trainer, tokenizer, args.prompt, sampling)
        else:
            text = continue_ids(trainer, tokenizer, tokenizer.encode(chat), sampling)  # the template holds any BOS
        elapsed = time.perf_counter() - begin
        console.print(args.prompt if chat is None else chat, style="dim", end="", markup=False, highlight=False)
        console.print(text, markup=False, highlight=False)
        budget = trainer.tc.device.budget_bytes()
        console.print(f"[dim]{len(tokenizer.encode(text))} tokens in {elapsed:.1f} s, every layer streamed per "
                      f"token; device peak {format_size(trainer.ledger.peak)} of "
                      f"{format_size(budget) if budget else 'no'} budget, model {trainer.cfg.num_params():,} params[/]")
    return 0


def _chat_prompt(args: argparse.Namespace, tokenizer: Tokenizer) -> str | None:
    """The conversation of --system, --messages and --chat rendered by the chat template; None for --prompt."""
    chat_flags = [flag for flag, value in (("--chat", args.chat), ("--messages", args.messages),
                                           ("--system", args.system), ("--chat-template", args.chat_template))
                  if value is not None]
    if args.prompt is not None:
        if chat_flags:
            raise RunError(f"--prompt continues text as it is and {chat_flags[0]} makes a chat; pass one or the other")
        return None
    if args.chat is None and args.messages is None:
        raise RunError("nothing to generate from; pass --prompt TEXT, or --chat TEXT (or --messages FILE) for a "
                       "chat model")
    messages = [] if args.messages is None else read_messages(args.messages)
    if args.system is not None:
        if messages[:1] and messages[0]["role"] == "system":
            raise RunError(f"--messages {args.messages} starts with a system message already; drop --system or "
                           "that message")
        messages.insert(0, {"role": "system", "content": args.system})
    if args.chat is not None:
        messages.append({"role": "user", "content": args.chat})
    if args.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(args.chat_template)
    return chat_prompt(messages, tokenizer, "the conversation")
