"""Ordinary resident training of the same model: the reference the streamed runtime must equal and beat."""
from __future__ import annotations

from typing import Mapping

import torch

from layers import GPTJ, GPTJConfig, causal_lm_loss
from streamer.config import TrainerConfig


class ResidentTrainer:
    """layers.GPTJ with fp32 parameters, autocast to the compute dtype, torch AdamW (decay on matrices only)."""

    def __init__(self, cfg: GPTJConfig, tc: TrainerConfig, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.cfg, self.tc = cfg, tc
        self.model = GPTJ(cfg, init=False)
        self.model.load_hf_state_dict(dict(state_dict))
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=tc.lr, betas=tc.betas, eps=tc.eps, fused=True)
        self.steps = 0

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
        labels = input_ids if labels is None else labels
        self.steps += 1
        for group in self.optimizer.param_groups:
            group["lr"] = self.tc.schedule.lr_at(self.steps, self.tc.lr)
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        autocast = self.tc.compute_dtype != torch.float32
        for ids, lab in zip(input_ids.chunk(self.tc.grad_accum), labels.chunk(self.tc.grad_accum)):
            with torch.autocast("cpu", dtype=self.tc.compute_dtype, enabled=autocast):
                loss = causal_lm_loss(self.model(ids), lab)
            (loss / self.tc.grad_accum).backward()
            losses.append(loss.detach())
        if self.tc.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tc.max_grad_norm)
        self.optimizer.step()
        return float(torch.stack(losses).mean())
