"""The mixture-of-experts families' units: a Llama-family block whose MLP is sparse. The router's softmax picks
each token's top-k experts; each expert runs on the tokens routed to it only (one matmul per expert that has
tokens), and its output comes back to its tokens scaled by their routing weights. The experts' weights are
transformers' fused tensors, `experts.gate_up_proj` (E, 2f, d) and `experts.down_proj` (E, d, f), so the state
dict is transformers' key for key; an expert no token chose gets a zero gradient there, as in transformers."""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from layers.llama.units import Llama, LlamaBlock, LlamaEmbedding, LlamaHead
from layers.model import FamilyUnits
from layers.moe.config import MixtureOfExperts


class GroupedLinear(torch.autograd.Function):
    """Rows grouped by expert, `sizes[e]` rows for expert e in order, each times its expert's weight[e]^T:
    (n, in) x (E, out, in) -> (n, out). Its backward makes the weight's gradient once, whole, zero for the
    experts with no rows (autograd through `weight[e]` would make a whole zero tensor per expert). It saves
    its input only where the weight needs a gradient. `sizes` None: shapes only (the dry run's meta tensors,
    which hold no routing to group by). Not torch._grouped_mm: in torch 2.13 on the CPU it takes no float64, its
    own backward fails, its meta kernel takes bf16 only, and it was not faster (2048 tokens, 8 of 128 experts,
    d 512, f 256: its forward 0.8x (fp32) and 0.5x (bf16) this loop's time, its weight gradient 1.3x and 1.5x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
        ctx.sizes = sizes
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        out = x.new_empty(x.shape[0], weight.shape[1])
        if sizes is not None:
            for e, (rows, into) in enumerate(zip(x.split(sizes), out.split(sizes))):
                if rows.shape[0]:
                    torch.mm(rows, weight[e].t(), out=into)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        sizes = ctx.sizes
        grad_x = grad.new_empty(grad.shape[0], weight.shape[2]) if ctx.needs_input_grad[0] else None
        # Each expert's block written once: its matmul's product, or zeros where it has no rows (not a zero
        # fill of the whole gradient first, a pass over every expert's weight).
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        start = 0
        for e, size in enumerate(sizes or ()):
            rows = slice(start, start + size)
            start += size
            if size and grad_x is not None:
                torch.mm(grad[rows], weight[e], out=grad_x[rows])
            if size and grad_w is not None:
                torch.mm(grad[rows].t(), x[rows], out=grad_w[e])
            elif grad_w is not None:
                grad_w[e].zero_()
        return grad_x, grad_w, None


class Gather(torch.autograd.Function):
    """source[index], rows picked by an int64 index (N,) from (M, d). Its backward adds each row's gradient into
    its source row with index_add_: autograd's own, index_put_ with accumulate, took 13-50x as long on a 2-core
    CPU (8192 rows of 512 into 1024 or 8192). It keeps what autograd's keeps: the index, and a zero gradient of
    the source's shape to add into."""

    @staticmethod
    def forward(ctx, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.source_rows = source.shape[0]
        return source[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.source_rows, *grad.shape[1:]).index_add_(0, index, grad), None


class Experts(nn.Module):
    """E SwiGLU experts, fused: out_e(x) = down_e(silu(gate_e(x)) * up_e(x)), gate_e and up_e the two halves
    of gate_up_proj[e]."""

    def __init__(self, cfg: MixtureOfExperts) -> None:
        super().__init__()
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.expert_width
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, d); each token's chosen experts (N, k) and their routing weights (N, k) -> the sum over its
        chosen experts of weight x expert(x), (N, d)."""
        (n, k), experts = chosen.shape, self.gate_up_proj.shape[0]
        order = chosen.flatten().argsort(stable=True)  # the (token, choice) pairs grouped by expert
        sizes = None if x.is_meta else torch.bincount(chosen.flatten(), minlength=experts).tolist()
        gate, up = GroupedLinear.apply(Gather.apply(x, order // k), self.gate_up_proj, sizes).chunk(2, dim=-1)
        # The experts' outputs back in (token, choice) order: a gather, whose backward keeps only its indices
        # (index_add's would keep the whole routed output), and no name holds the grouped output past it.
        per_choice = Gather.apply(GroupedLinear.apply(F.silu(gate) * up, self.down_proj, sizes),
                                  order.argsort()).view(n, k, -1)
        return (per_choice * weights[..., None]).sum(dim=1).to(x.dtype)


class SparseMoe(nn.Module):
    """The router picks each token's top-k experts by softmax probability (in fp32); their weights are those
    probabilities, renormalised over the chosen ones where `norm_topk_prob`."""

    def __init__(self, cfg: MixtureOfExperts) -> None:
        super().__init__()
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])  # (N, d)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, chosen, weights.to(x.dtype)).view_as(h)


class MoeBlock(LlamaBlock):
    """A Llama-family block with a sparse MLP."""

    mlp_type: ClassVar[type[nn.Module]] = SparseMoe


UNITS = FamilyUnits(embed=LlamaEmbedding, block=MoeBlock, head=LlamaHead, model=Llama)
