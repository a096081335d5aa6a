"""The dry run: the real schedule and ledger on `meta` tensors — no memory, no I/O, seconds even for 6B."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from layers import GPTJConfig
from memory_model import Ledger
from streamer.config import TrainerConfig


class FlashAttentionOnMeta(TorchFunctionMode):
    """On `meta`, SDPA falls back to the math kernel, which saves the (T x T) attention matrix; the CPU and
    CUDA training kernels save only q, k, v, the output and the log-sum-exp. Route to the flash kernel so the
    dry run charges what a real step saves."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is None and len(args) == 3:
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *args, 0.0, kwargs.get("is_causal", False))
            return out
        return func(*args, **kwargs)


def dry_run(cfg: GPTJConfig, tc: TrainerConfig, batch: int, seq: int) -> Ledger:
    """Run one full training step (grad_accum micro-batches and the update) on meta; returns its ledger."""
    from streamer.trainer import StreamingTrainer
    trainer = StreamingTrainer(cfg, tc.replace(device="meta", budget=None))
    with FlashAttentionOnMeta():
        trainer.step(torch.zeros(batch, seq, dtype=torch.long, device="meta"))
    trainer.close()
    return trainer.ledger
