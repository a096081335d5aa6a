"""Text generation with streamed layers: greedy, temperature, top-k and top-p sampling, with a KV cache.

A model larger than the device budget cannot stay on the device, so every forward pass (the prompt's
prefill, then one pass per new token) runs the executor's "infer" events: the units stream in with
prefetch, in order, and the ledger charges their weights as in training. Each block's KV cache stays on
the device between passes (charged as activations), so a new token costs one position of compute per
block instead of the whole sequence; `use_cache=False` recomputes the whole sequence each time (the
reference the cache is tested against). `resident=True` keeps every unit on the device from its first load to
the end of the generation: the prompt's prefill loads each unit once and every later pass computes with them
(GRPO's rollout does so where the planner finds they fit beside the cache, memory_model.rollout).

Where the sequence grows past the length at which the rotary tables of every position change
(`AttentionLayout.regime_change`: longrope's long factors), the cache is filled again from the whole sequence
once, as transformers' `generate` does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from layers import KVCache
from memory_model.schedule import inference_events
from streamer.errors import StreamerError
from streamer.runtime.step import StepContext

if TYPE_CHECKING:
    from streamer.io.tokenizer import Tokenizer
    from streamer.trainer import StreamingTrainer


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature 0 is greedy (argmax); top_k 0 and top_p 1 are off."""

    max_new_tokens: int = 40
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    use_cache: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise StreamerError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise StreamerError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise StreamerError(f"top_k must be an integer >= 0 (0 is off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise StreamerError(f"top_p must be in (0, 1] (1 is off), got {self.top_p}")


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """(B, vocab) float logits -> (B,) next token ids."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    if sampling.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p: the most likely token always stays.
        beyond = probs.cumsum(dim=-1) - probs >= sampling.top_p
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, ordered.masked_fill(beyond, -math.inf))
    probs = logits.softmax(dim=-1)
    # The draw on the host, by the seeded generator; a dry run's meta tensors draw a token of the same shape and
    # dtype there, values having none.
    return torch.multinomial(probs if probs.is_meta else probs.cpu(), 1, generator=generator).squeeze(-1).to(
        logits.device)


@torch.no_grad()
def generate(trainer: StreamingTrainer, input_ids: torch.Tensor, sampling: Sampling = Sampling(),
             stop_id: int | None = None, resident: bool = False) -> torch.Tensor:
    """(B, T) prompt ids -> (B, T + n) with n <= max_new_tokens; stops early once every row emitted stop_id.
    `resident`: the units stay on the device from their first load to the end (else each pass streams them). On a
    meta trainer (the dry run), every pass runs and charges as a real one; the tokens are meta's, and stay there."""
    cfg, device, dtype = trainer.cfg, trainer.executor.device, trainer.tc.compute_dtype
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise StreamerError(f"the prompt must be (batch, tokens) with at least one token, got {tuple(input_ids.shape)}")
    batch, prompt_len = input_ids.shape
    total = prompt_len + sampling.max_new_tokens
    context, _ = cfg.attention().context()
    if total > context:
        raise StreamerError(f"the prompt ({prompt_len} tokens) plus {sampling.max_new_tokens} new tokens exceeds the "
                            f"model's context of {context}; shorten the prompt or lower --max-new-tokens")
    caches, handles = None, []
    if sampling.use_cache:
        caches = [KVCache.empty(cfg, batch, total, dtype, device) for _ in range(cfg.num_hidden_layers)]
        handles = [trainer.ledger.allocate("activations", f"block.{i}", 2 * c.keys.numel() * c.keys.element_size(),
                                           "KV cache") for i, c in enumerate(caches)]
    try:
        generator = torch.Generator().manual_seed(sampling.seed)
        tokens = input_ids.to(device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        step_input, start_pos = tokens, 0
        # A cache filled before the sequence grows past this length is recomputed there, as transformers'
        # generate does (longrope's long factors), unless the prompt is past it already.
        change = cfg.attention().regime_change()
        stale_at = change if change is not None and prompt_len <= change else None
        for _ in range(sampling.max_new_tokens):
            logits = _streamed_forward(trainer, step_input, start_pos, caches, resident)
            chosen = sample_next(logits, sampling, generator)
            if stop_id is not None:
                chosen = chosen.masked_fill(finished, stop_id)  # a finished row only pads
                finished |= chosen == stop_id
            tokens = torch.cat([tokens, chosen[:, None]], dim=1)
            if stop_id is not None and finished.all():
                break
            if caches is not None and tokens.shape[1] - 1 != stale_at:
                step_input, start_pos = chosen[:, None], tokens.shape[1] - 1
            else:  # no cache, or its keys' rotary tables no longer those of the sequence: the whole of it again
                step_input, start_pos = tokens, 0
                for cache in caches or ():
                    cache.length = 0
    finally:
        if resident:
            trainer.executor.release_kept()
        for handle in handles:
            trainer.ledger.free(handle)
    return tokens if tokens.is_meta else tokens.cpu()


def _streamed_forward(trainer: StreamingTrainer, ids: torch.Tensor, start_pos: int,
                      caches: list[KVCache] | None, resident: bool = False) -> torch.Tensor:
    """One pass of every unit over `ids` (at positions start_pos...); the last position's logits (B, vocab)."""
    held: dict[str, Any] = {}

    def infer(unit: str, run: Any) -> None:
        if unit == "embed":
            held["h"] = run(ids)  # (B, T, d)
            held["handle"] = trainer.ledger.allocate("workspace", unit, held["h"].numel() * held["h"].element_size(),
                                                     "hidden state")
        elif unit == "head":
            held["logits"] = run(held["h"][:, -1:])[:, -1]  # (B, vocab): only the next token is needed
        else:
            block = int(unit.split(".", 1)[1])
            held["h"] = run(held["h"], start_pos, None if caches is None else caches[block])

    try:
        trainer.executor.run(inference_events(trainer.units), StepContext([], trainer.step_count, 0.0, infer=infer,
                                                                        keep_loaded=resident))
    finally:
        if "handle" in held:
            trainer.ledger.free(held["handle"])
    return held["logits"]


def complete(trainer: StreamingTrainer, tokenizer: Tokenizer, prompt: str, sampling: Sampling = Sampling()) -> str:
    """The text generated after `prompt` (begun with the tokens the tokenizer adds before a text, as training
    began each example; an empty prompt of a tokenizer that adds none starts from end-of-text), up to
    end-of-text."""
    ids = tokenizer.prompt_ids(prompt) or [tokenizer.eos_id]
    return continue_ids(trainer, tokenizer, ids, sampling)


def continue_ids(trainer: StreamingTrainer, tokenizer: Tokenizer, ids: list[int],
                 sampling: Sampling = Sampling()) -> str:
    """The text generated after the prompt `ids`, up to end-of-text."""
    out = generate(trainer, torch.tensor([ids]), sampling, stop_id=tokenizer.eos_id)[0, len(ids):].tolist()
    if out and out[-1] == tokenizer.eos_id:
        out = out[:-1]
    return tokenizer.decode(out)
