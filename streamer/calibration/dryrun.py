"""The dry run: the real schedule and ledger on `meta` tensors — no memory, no I/O, seconds even for 6B: a training
step (`dry_run`), and a prompt's generation in GRPO's rollout (`dry_run_generation`)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from layers import ModelConfig
from memory_model import Ledger
from streamer.config import TrainerConfig
from streamer.generate import Sampling, generate
from streamer.trainer import StreamingTrainer


class FlashAttentionOnMeta(TorchFunctionMode):
    """On `meta`, SDPA falls back to the math kernel, which saves the (T x T) attention matrix; the CPU and
    CUDA training kernels save only q, k, v, the output and the log-sum-exp (and a mask, as a bias in the
    compute dtype: what the CPU's SDPA turns a bool mask into). Route to the CPU's flash kernel so the dry run
    charges what a real step saves."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and len(args) == 3:
            mask = kwargs.get("attn_mask")
            if mask is not None and mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=args[0].dtype, device=mask.device).masked_fill(
                    ~mask, float("-inf"))
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *args, 0.0, kwargs.get("is_causal", False), attn_mask=mask, scale=kwargs.get("scale"))
            return out
        return func(*args, **kwargs)


def dry_run(cfg: ModelConfig, tc: TrainerConfig, batch: int, seq: int, packed: bool = False,
            clipped: bool = False) -> Ledger:
    """Run one full training step (grad_accum micro-batches and the update) on meta; returns its ledger.
    `batch`: its rows (a DPO step's pairs twice).
    `packed`: rows of packed examples (their positions, hence masked attention). `clipped`: the step as one
    that clips after one that did (no speculative attempt), on the schedule --clipped-steps names (auto: after
    the backward, as a trainer with no target prices it): a norm-first step's norm pass and fused step, or the
    update after the backward."""
    trainer = StreamingTrainer(cfg, tc.replace(device="meta", budget=None))
    trainer.speculate = not clipped
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    # DPO's rows are pairs; full fine-tuning's reference comes from a pass before training, LoRA's from the step.
    precomputed = tc.objective.preference and not tc.objective.reference_in_step(tc.lora.enabled)
    with FlashAttentionOnMeta():
        trainer.step(ids, positions=ids if packed else None,
                     reference=torch.zeros(batch, device="meta") if precomputed else None)
    trainer.close()
    return trainer.ledger


def dry_run_generation(cfg: ModelConfig, tc: TrainerConfig, rows: int, prompt: int, resident: bool) -> Ledger:
    """A prompt's generation in GRPO's rollout (streamer.grpo.rollout) on meta: `rows` completions of
    --max-completion-length tokens after `prompt` tokens, sampled as the run samples (--temperature, --top-p), the
    KV cache on the device, the units streamed in each pass or `resident`; returns its ledger. Every pass runs:
    no completion ends early, as the planner prices it."""
    objective = tc.objective
    trainer = StreamingTrainer(cfg, tc.replace(device="meta", budget=None))
    sampling = Sampling(max_new_tokens=objective.max_completion_length, temperature=objective.temperature,
                        top_p=objective.top_p)
    with FlashAttentionOnMeta():
        generate(trainer, torch.zeros(rows, prompt, dtype=torch.long, device="meta"), sampling, resident=resident)
    trainer.close()
    return trainer.ledger
