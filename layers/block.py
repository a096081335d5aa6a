"""The three units the streamer runs one at a time: embedding, decoder block, final norm + head."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from layers.config import GPTJConfig
from layers.loss import chunked_lm_loss
from layers.rotary import apply_rotary, positions_sincos, rows_sincos


@dataclass
class KVCache:
    """One block's keys and values for positions [0, length); preallocated to max_len."""

    keys: torch.Tensor  # (B, H, max_len, D)
    values: torch.Tensor  # (B, H, max_len, D)
    length: int = 0

    @classmethod
    def empty(cls, cfg: GPTJConfig, batch: int, max_len: int, dtype: torch.dtype,
              device: torch.device | str) -> "KVCache":
        shape = (batch, cfg.n_head, max_len, cfg.head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"KV cache holds {self.keys.shape[2]} positions; {end} were asked for")
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


def example_mask(positions: torch.Tensor) -> torch.Tensor:
    """The attention mask (B, 1, T, T) of rows of packed examples, from their positions (B, T), which restart at
    0 in each example: a query sees the keys of its own example up to itself (causal, block-diagonal)."""
    example = (positions == 0).cumsum(1)  # (B, T): which example of its row each token belongs to
    T = positions.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return ((example[:, :, None] == example[:, None, :]) & causal).unsqueeze(1)


class GPTJEmbedding(nn.Module):
    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        # An uninitialised weight: nn.Embedding's own init draws normal_, which on `meta` imports torch._dynamo
        # (about 1.5 s of CPU per process). Every model's weights are loaded or set by init_weights anyway.
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, _weight=torch.empty(cfg.vocab_size, cfg.n_embd))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids)  # (B, T, d)


class GPTJAttention(nn.Module):
    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.n_embd
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` (B, T): each token's position in its example (packed rows restart at 0 per example), so
        examples neither see each other nor their offset in the row; None: 0..T-1 from start_pos, causal."""
        cfg = self.cfg
        B, T, _ = x.shape
        split = (B, T, cfg.n_head, cfg.head_dim)
        q, k, v = self.q_proj(x).view(split), self.k_proj(x).view(split), self.v_proj(x).view(split)  # (B, T, H, D)
        if positions is None:
            sin, cos = positions_sincos(cfg.n_positions, cfg.rotary_dim, start_pos, T, x.dtype, x.device)
        else:
            sin, cos = rows_sincos(cfg.n_positions, cfg.rotary_dim, positions, x.dtype)
        q, k = apply_rotary(q, sin, cos), apply_rotary(k, sin, cos)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if cache is None and positions is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif cache is None:
            # A bool mask: SDPA turns it into a compute-dtype bias it saves for the backward (B x T x T).
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=example_mask(positions))
        else:
            if cache.length != start_pos:
                raise ValueError(f"KV cache holds {cache.length} positions but start_pos is {start_pos}; "
                                 "they must agree or queries would see the wrong keys")
            k, v = cache.append(k, v)  # (B, H, start_pos + T, D)
            # Query i (absolute position start_pos + i) sees keys 0..start_pos + i.
            mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=start_pos)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(B, T, cfg.n_embd)  # (B, T, d)
        return self.out_proj(out)


class GPTJMLP(nn.Module):
    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.n_embd, cfg.inner_dim)
        self.fc_out = nn.Linear(cfg.inner_dim, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))  # tanh GELU == HF's gelu_new


class GPTJBlock(nn.Module):
    """Parallel attention and MLP on one shared LayerNorm: h + attn(ln_1(h)) + mlp(ln_1(h))."""

    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPTJAttention(cfg)
        self.mlp = GPTJMLP(cfg)

    def forward(self, h: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.ln_1(h)
        return h + self.attn(x, start_pos, cache, positions) + self.mlp(x)


class GPTJHead(nn.Module):
    """Final LayerNorm and the language-model head: float32 logits, or with labels the causal-LM loss."""

    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, vocab_chunk: int = 0,
                num_items: float | None = None) -> torch.Tensor:
        """Logits (B, T, vocab); given labels (B, T), the loss instead, its logits `vocab_chunk` vocabulary
        rows at a time (layers.loss.chunked_lm_loss) so that neither they nor their gradient exist whole;
        summed and divided by `num_items` where given (the step's learned tokens), else a mean."""
        x = self.ln_f(h)
        if labels is None:
            return self.lm_head(x).float()  # (B, T, vocab)
        chunk = vocab_chunk or self.lm_head.out_features
        return chunked_lm_loss(x, self.lm_head.weight, self.lm_head.bias, labels, chunk, num_items)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """HF's GPT-J initialisation: normal(0, 0.02) matrices and embeddings, zero biases, unit LayerNorm."""
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            nn.init.normal_(sub.weight, mean=0.0, std=std)
            if getattr(sub, "bias", None) is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.LayerNorm):
            nn.init.ones_(sub.weight)
            nn.init.zeros_(sub.bias)

