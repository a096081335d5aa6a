"""`streamer eval`: the loss and perplexity of a run's model on a data file, with streamed forward passes."""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from typing import Any

from memory_model.devices import budget_bytes
from streamer.cli.flags import add_run_flags, declare_command, given
from streamer.console import make_console
from streamer.io.data import load_dataset, long_examples_line
from streamer.run import RunError, SettingError
from streamer.run_dir import RunDir
from streamer.session import evaluate_dataset, open_trainer

DATA_FLAGS = ("pack", "chat_template", "long_examples")
EXAMPLES = """\
examples:
  streamer eval RUN --data train.jsonl
  streamer eval RUN --data train.jsonl --batch 2 --budget 32MiB
  streamer eval RUN --data train.jsonl --seq 64    longer examples than the run's --seq, up to the model's context"""


def declare(parser: argparse.ArgumentParser) -> None:
    declare_command(parser, eval_command, "Evaluate a run's model on held-out data (any --data format) with "
                    "streamed forward passes.", EXAMPLES)
    parser.add_argument("run", metavar="RUN", help="a run directory")
    parser.add_argument("--data", required=True, metavar="FILE", help="the data to evaluate on, read like the "
                        "run's --data at its --seq")
    parser.add_argument("--seq", type=int, help="tokens per sequence, up to the model's context (default: the "
                        "run's --seq)")
    parser.add_argument("--batch", type=int, help="sequences per forward pass (default: the run's micro-batch)")
    parser.add_argument("--budget", help="device budget (default: the run's)")
    parser.add_argument("--device", help="torch device (default: the run's)")
    # The data flags of `train` that say how the data is read; the tokenizer is the run's.
    add_run_flags(parser, only=DATA_FLAGS, help={
        "pack": "pack several examples into one sequence, as `train --pack` (default: the run's)",
        "chat_template": "a Jinja chat template for {\"messages\"} records (default: the run's)",
        "long_examples": "an example longer than --seq: truncate or drop it, as `train --long-examples` (default: "
                         "the run's)"})


def eval_command(args: argparse.Namespace) -> int:
    run = RunDir.open(args.run)
    cfg = run.read_config()
    overrides: dict[str, Any] = {}
    if args.device is not None:
        overrides["device"] = args.device
    if args.budget is not None:
        overrides["budget"] = budget_bytes(args.budget, SettingError)
    if args.batch is not None and args.batch < 1:
        raise RunError(f"--batch must be a positive integer, got {args.batch}")
    seq = cfg.seq if args.seq is None else args.seq
    if seq < 1:
        raise RunError(f"--seq must be a positive integer, got {seq}")
    data = replace(cfg.data, **{k: v for k, v in given(args).items() if k in DATA_FLAGS})  # checked as train's
    tokenizer = run.load_tokenizer()
    if data.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(data.chat_template)
    begin = time.perf_counter()
    # One micro-batch per call, of the run's micro-batch size unless --batch says otherwise: what its budget holds.
    with open_trainer(run, {**overrides, "grad_accum": 1}) as trainer:
        context, why = trainer.cfg.attention().context()
        if seq > context:
            raise RunError(f"--seq {seq} exceeds the model's context ({why}); use --seq {context} or less")
        dataset = load_dataset(args.data, tokenizer, seq, pack=data.pack, long_examples=data.long_examples)
        long = long_examples_line(dataset, seq, data.long_examples)
        if long is not None:
            make_console().print(f"{args.data}: {long}", markup=False, highlight=False)
        loss, tokens = evaluate_dataset(trainer, dataset, args.batch or cfg.batch // cfg.trainer.step.grad_accum)
        step = trainer.step_count
    if loss is None:
        raise RunError("the data holds no token to predict; pass data with text or completions")
    make_console().print(
        f"{args.data}: loss {loss:.4f}, perplexity {math.exp(min(loss, 700)):,.2f} over {len(dataset)} sequences "
        f"({tokens:,} predicted tokens) of {seq} tokens, step {step} of {run.root}, "
        f"{time.perf_counter() - begin:.1f} s", markup=False, highlight=False)
    return 0
