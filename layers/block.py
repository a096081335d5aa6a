"""What every family's units share: the embedding table, scaled-dot-product attention over a sequence, packed
rows or a KV cache (grouped-query heads included, over the whole past or a sliding window of it), the KV cache
itself, RMSNorm (Llama's, and Gemma's about 1 + weight), the head's logits or loss, and HF's initialisation."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from layers.config import ModelConfig
from layers.loss import Objective, TokenMean, chunked_objective_loss


def embedding(vocab_size: int, dim: int, padding_idx: int | None = None) -> nn.Embedding:
    """An embedding table left uninitialised: every model's weights are loaded or set by `init_weights`, and
    nn.Embedding's own normal_ draw on `meta` imports torch._dynamo (about 1.2 s of CPU in every process).
    `padding_idx`: the row whose gradient is always zero (transformers' pad_token_id, where its class uses it)."""
    return nn.Embedding(vocab_size, dim, padding_idx, _weight=torch.empty(vocab_size, dim))


@dataclass
class KVCache:
    """One block's keys and values for positions [0, length); preallocated to max_len, one row per key/value
    head (fewer than the query heads under grouped-query attention)."""

    keys: torch.Tensor  # (B, H_kv, max_len, D)
    values: torch.Tensor  # (B, H_kv, max_len, D)
    length: int = 0

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype,
              device: torch.device | str) -> "KVCache":
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"KV cache holds {self.keys.shape[2]} positions; {end} were asked for")
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


def full_attention_only(cfg: ModelConfig, layer_type: str) -> None:
    """A block of a family whose every layer attends causally over the whole sequence."""
    if layer_type != "full_attention":
        raise ValueError(f"{cfg.model_type} has no {layer_type!r} layers; its layers are 'full_attention'")


def example_mask(positions: torch.Tensor) -> torch.Tensor:
    """The attention mask (B, 1, T, T) of rows of packed examples, from their positions (B, T), which restart at
    0 in each example: a query sees the keys of its own example up to itself (causal, block-diagonal)."""
    example = (positions == 0).cumsum(1)  # (B, T): which example of its row each token belongs to
    T = positions.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return ((example[:, :, None] == example[:, None, :]) & causal).unsqueeze(1)


def visible_keys(queries: int, keys: int, start_pos: int, window: int | None, device: torch.device) -> torch.Tensor:
    """The causal mask (queries, keys): query i, at position start_pos + i, sees key j where j <= start_pos + i
    and, within a sliding window, start_pos + i - window < j (transformers' sliding_window_overlay)."""
    query = torch.arange(queries, device=device)[:, None] + start_pos
    key = torch.arange(keys, device=device)[None, :]
    seen = key <= query
    return seen if window is None else seen & (key > query - window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
           positions: torch.Tensor | None = None, window: int | None = None,
           scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q (B, H, T, D) over k, v (B, H_kv, T, D), H a multiple of H_kv; returns (B, T, H * D).

    `positions` (B, T): packed rows' positions (restarting at 0 per example), so examples do not see each other;
    `cache`: the keys and values of positions before start_pos, appended to first; `window`: each query sees
    only its `window` latest keys, itself included (a sliding-window layer); `scale`: the scores' factor,
    1/sqrt(D) where None; `sinks` (H,): each head's logit that joins every query's softmax denominator and gives
    no value (gpt-oss's attention sinks)."""
    if cache is not None:
        if cache.length != start_pos:
            raise ValueError(f"KV cache holds {cache.length} positions but start_pos is {start_pos}; "
                             "they must agree or queries would see the wrong keys")
        k, v = cache.append(k, v)  # (B, H_kv, start_pos + T, D)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # each key/value head serves `groups` query heads (HF's repeat_kv)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    B, _, T, _ = q.shape
    if window is not None and k.shape[2] <= window:
        window = None  # the window holds every earlier key: plain causal attention
    if sinks is not None:  # SDPA has no sink term: the scores are made whole, as transformers' eager kernel does
        mask = visible_keys(T, k.shape[2], start_pos, window, q.device)
        if positions is not None:
            mask = mask & example_mask(positions)
        out = attention_with_sinks(q, k, v, mask, sinks, q.shape[-1] ** -0.5 if scale is None else scale)
    elif cache is None and positions is None and window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # A bool mask: SDPA turns it into a compute-dtype bias it saves for the backward (T x T, or B x T x T
        # for packed rows).
        mask = visible_keys(T, k.shape[2], start_pos, window, q.device)
        if positions is not None:
            mask = mask & example_mask(positions)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(B, T, -1)


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax over [scores, sink] of each query, the sink's share dropped, times v: q (B, H, T, D), k and v
    (B, H, S, D), mask (T, S) or (B, 1, T, S) (True: visible), sinks (H,) -> (B, H, T, D). As transformers'
    `eager_attention_forward` computes it: the row's maximum subtracted first. No name holds a T x T tensor past
    its use, so at most two are live at once (a checkpointed block's recompute stays below its backward)."""
    sink = sinks.to(q.dtype).view(1, -1, 1, 1).expand(*q.shape[:-1], 1)
    logits = torch.cat([(q @ k.transpose(2, 3) * scale).masked_fill(~mask, float("-inf")), sink], dim=-1)
    logits -= logits.detach().amax(dim=-1, keepdim=True)  # in place: cat's backward keeps nothing of it
    probs = torch.softmax(logits, dim=-1)
    del logits
    return probs[..., :-1] @ v


def language_model_output(x: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor | None, vocab_chunk: int,
                          objective: Objective | None) -> torch.Tensor:
    """A head's output from its final norm's output x: float32 logits (B, T, vocab); given labels (B, T), the
    loss instead, its logits `vocab_chunk` vocabulary rows at a time (layers.loss.chunked_objective_loss) so that
    neither they nor their gradient exist whole: `objective`'s, or without one the mean cross-entropy of the
    learned tokens."""
    if labels is None:
        return lm_head(x).float()
    return chunked_objective_loss(x, lm_head.weight, lm_head.bias, labels, vocab_chunk or lm_head.out_features,
                                  objective or TokenMean())


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back before the weight (HF's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (1 + weight), all in fp32 and cast back after the weight (HF's Gemma3RMSNorm):
    the weight is the scale's offset from 1, zero at initialisation."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """HF's initialisation: normal(0, 0.02) matrices (a Linear's, an embedding's, fused experts'), zero biases
    and padding rows, unit norm weights (LayerNorm, RMSNorm), zero offsets of an OffsetRMSNorm and zero LayerNorm
    biases; a module with its own rule (transformers' `_init_weights` for its class) by its `init_parameters`."""
    for sub in module.modules():
        bias, own_init = getattr(sub, "bias", None), getattr(sub, "init_parameters", None)
        if own_init is not None:
            own_init(std)
        elif isinstance(sub, (nn.Linear, nn.Embedding)):
            nn.init.normal_(sub.weight, mean=0.0, std=std)
            if bias is not None:
                nn.init.zeros_(bias)
            if isinstance(sub, nn.Embedding) and sub.padding_idx is not None:
                with torch.no_grad():
                    sub.weight[sub.padding_idx].zero_()
        elif isinstance(sub, OffsetRMSNorm):
            nn.init.zeros_(sub.weight)
        elif isinstance(sub, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(sub.weight)
            if bias is not None:
                nn.init.zeros_(bias)
        else:  # a module's own stacks of matrices (a mixture of experts' fused expert weights)
            for p in sub.parameters(recurse=False):
                if p.dim() >= 2:
                    nn.init.normal_(p, mean=0.0, std=std)
