"""Ordinary resident training of the same model: the reference the streamed runtime must equal and beat.

It holds what the streamer streams, all at once: compute weights in the compute dtype, fp32 master weights,
fused AdamW state, fp32 gradients. So "streamed vs resident" compares the same arithmetic, not autocast's
per-step weight casts against the streamer's bf16 copies.
"""
from __future__ import annotations

from typing import Mapping

import torch

from layers import ModelConfig, causal_lm_loss, learned_tokens, resident_model, weight_decayed
from streamer.config import TrainerConfig


class ResidentTrainer:
    def __init__(self, cfg: ModelConfig, tc: TrainerConfig, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.cfg, self.tc = cfg, tc
        self.model = resident_model(cfg, init=False)
        self.model.load_hf_state_dict(dict(state_dict))
        self.model.to(device=tc.device.device, dtype=tc.compute_dtype)
        params = list(self.model.parameters())
        # fp32 compute weights are the master weights; otherwise the masters are a separate fp32 copy.
        self.separate_masters = tc.compute_dtype != torch.float32
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in params] if self.separate_masters else params
        self.optimizer = torch.optim.AdamW(
            [{"params": [m for m in self.masters if weight_decayed(m.shape)],
              "weight_decay": tc.optimizer.weight_decay},
             {"params": [m for m in self.masters if not weight_decayed(m.shape)], "weight_decay": 0.0}],
            lr=tc.optimizer.lr, betas=tc.optimizer.betas, eps=tc.optimizer.eps, fused=True)
        self.steps = 0

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
        labels = input_ids if labels is None else labels
        input_ids, labels = input_ids.to(self.tc.device.device), labels.to(self.tc.device.device)
        self.steps += 1
        for group in self.optimizer.param_groups:
            group["lr"] = self.tc.schedule.lr_at(self.steps, self.tc.optimizer.lr)
        self.optimizer.zero_grad(set_to_none=True)
        params = list(self.model.parameters())
        losses, tokens = [], learned_tokens(labels)  # the step's loss is the mean over its learned tokens
        micro = self.tc.step.grad_accum
        for ids, lab in zip(input_ids.chunk(micro), labels.chunk(micro), strict=True):
            loss = causal_lm_loss(self.model(ids), lab, tokens)
            loss.backward()
            losses.append(loss.detach())
            if self.separate_masters:  # fold each micro-batch's gradient into fp32, as the streamer does
                for p, m in zip(params, self.masters, strict=True):
                    m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                    p.grad = None
        if self.tc.optimizer.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.masters, self.tc.optimizer.max_grad_norm)
        self.optimizer.step()
        if self.separate_masters:
            with torch.no_grad():
                for p, m in zip(params, self.masters, strict=True):
                    p.copy_(m)
        return float(torch.stack(losses).sum())
