"""The mixture-of-experts families' units: a Llama-family block whose MLP is sparse. The router's softmax picks
each token's top-k experts; each expert runs on the tokens routed to it only (one matmul per expert that has
tokens), and its output comes back to its tokens scaled by their routing weights. The experts' weights are
transformers' fused tensors, `experts.gate_up_proj` (E, 2f, d) and `experts.down_proj` (E, d, f), so the state
dict is transformers' key for key; an expert no token chose gets a zero gradient there, as in transformers. The
runtime may hand the experts their weights a group at a time (`ExpertSource`): the same matmuls, in the same order.
Where the config asks (`output_router_logits`), `RouterBalance` is the loss's load-balancing term."""
from __future__ import annotations

import contextlib
import itertools
from contextvars import ContextVar
from typing import Any, ClassVar, Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from layers.llama.units import Llama, LlamaBlock, LlamaEmbedding, LlamaHead
from layers.lora import expert_factors, init_adapters
from layers.quant4 import FrozenQuant, matrix, piece_key
from layers.model import AuxiliaryLoss, FamilyUnits
from layers.config import ModelConfig, SparseMlp


# Where torch._grouped_mm computes the experts: one kernel for every expert instead of a launch per expert. Not on
# the CPU: torch 2.13's CPU kernel takes no float64 (the tests' references) and was not faster over a step (2048
# tokens, 8 of 128 experts, d 512, f 256: its forward took 0.8x (fp32) and 0.5x (bf16) the loop's time, its
# weight gradient 1.3x and 1.5x). transformers' grouped experts ask the same of CUDA: compute capability 8.0 or above.
GROUPED_MM_DEVICES = {"cuda"}
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sparse_mlp(cfg: ModelConfig) -> SparseMlp:
    """The sparse MLP a mixture's config holds, which its units are built from."""
    if cfg.sparse_mlp is None:
        raise TypeError(f"{cfg.model_type} has a dense MLP: a mixture's units need a sparse one")
    return cfg.sparse_mlp


def grouped_mm_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm computes x's rows times the experts' `weight`: on a device it serves, in a dtype
    it takes, each expert's weight row- or column-major (not a LoRA B's strided columns), and with rows that start
    on 16 bytes, as its CUDA kernels require."""
    if x.device.type not in GROUPED_MM_DEVICES or not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    size = x.element_size()
    return (x.dtype == weight.dtype and x.dtype in GROUPED_MM_DTYPES and x.is_contiguous()
            and 1 in weight.stride()[1:] and all(n * size % 16 == 0 for n in (x.shape[1], weight.shape[1]))
            and all(t.data_ptr() % 16 == 0 for t in (x, weight)))


class GroupedLinear(torch.autograd.Function):
    """Rows grouped by expert, `sizes[e]` rows for expert e in order, each times its expert's weight[e]^T:
    (n, in) x (E, out, in) -> (n, out). Its backward makes the weight's gradient once, whole, zero for the
    experts with no rows (autograd through `weight[e]` would make a whole zero tensor per expert). It saves
    its input only where the weight needs a gradient, and the weight only where the input does (a LoRA adapter's
    compute-dtype copy is not kept for nothing). `sizes` None: shapes only (the dry run's meta tensors,
    which hold no routing to group by). The products are torch._grouped_mm's where it serves
    (`grouped_mm_serves`), else one torch.mm per expert that has rows; either way the same tensors are saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
        ctx.sizes, ctx.weight_shape = sizes, weight.shape
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        # A group with no rows at all has nothing to launch.
        ctx.grouped = sizes is not None and x.shape[0] > 0 and grouped_mm_serves(x, weight)
        if ctx.grouped and sizes is not None:  # (grouped only with sizes)
            return torch._grouped_mm(x, weight.transpose(1, 2), offs=_offsets(sizes, x.device))
        out = x.new_empty(x.shape[0], weight.shape[1])
        if sizes is not None:
            for e, (rows, into) in enumerate(zip(x.split(sizes), out.split(sizes), strict=True)):
                if rows.shape[0]:
                    torch.mm(rows, weight[e].t(), out=into)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        sizes = ctx.sizes
        if ctx.grouped and grad.is_contiguous() and grad.data_ptr() % 16 == 0:
            return (*_grouped_backward(grad, x, weight, sizes), None)
        grad_x = grad.new_empty(grad.shape[0], ctx.weight_shape[2]) if ctx.needs_input_grad[0] else None
        # Each expert's block written once: its matmul's product, or zeros where it has no rows (not a zero
        # fill of the whole gradient first, a pass over every expert's weight).
        grad_w = grad.new_empty(ctx.weight_shape) if ctx.needs_input_grad[1] else None
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


def _offsets(sizes: list[int], device: torch.device) -> torch.Tensor:
    """torch._grouped_mm's groups: where each expert's rows end, int32."""
    return torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32, device=device)


def _grouped_backward(grad: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor | None,
                      sizes: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """GroupedLinear's gradients through torch._grouped_mm: the input's, grad times each expert's weight, and the
    weight's, each expert's grad^T x over its rows, zeroed for an expert with none (as the loop writes it, whatever
    a kernel leaves in an empty group)."""
    offs = _offsets(sizes, grad.device)
    grad_x = None if weight is None else torch._grouped_mm(grad, weight, offs=offs)
    grad_w = None
    if x is not None:
        grad_w = torch._grouped_mm(grad.t(), x, offs=offs)
        empty = [e for e, size in enumerate(sizes) if not size]
        if empty:
            grad_w.index_fill_(0, torch.tensor(empty, device=grad.device), 0)
    return grad_x, grad_w


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


class GroupedLinear4bit(torch.autograd.Function):
    """GroupedLinear on a frozen fused tensor held quantized (`pieces`, layers.quant4's): each expert that has rows
    gets its weight dequantized for their matmul, one expert at a time, and again in the backward for the input's
    gradient, as bitsandbytes' MatMul4Bit does for a Linear. Autograd saves only the pieces (views of the unit's
    weights, packed as handles); the tensor takes no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int] | None, quant: FrozenQuant, shape: tuple[int, int, int],
                names: tuple[str, ...], *pieces: torch.Tensor) -> torch.Tensor:
        ctx.sizes, ctx.quant, ctx.shape, ctx.names = sizes, quant, shape, names
        ctx.save_for_backward(*pieces)
        out = x.new_empty(x.shape[0], shape[1])
        for e, (rows, into) in enumerate(zip(x.split(sizes), out.split(sizes), strict=True) if sizes else ()):
            if rows.shape[0]:
                torch.mm(rows, _expert_weight(ctx, pieces, e).to(x.dtype).t(), out=into)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x = grad.new_empty(grad.shape[0], ctx.shape[2])
        for e, (rows, into) in enumerate(zip(grad.split(ctx.sizes), grad_x.split(ctx.sizes), strict=True)
                                         if ctx.sizes else ()):
            if rows.shape[0]:
                torch.mm(rows, _expert_weight(ctx, ctx.saved_tensors, e).to(grad.dtype), out=into)
        return (grad_x, None, None, None, None, *(None for _ in ctx.names))


def _expert_weight(ctx: Any, pieces: tuple[torch.Tensor, ...], expert: int) -> torch.Tensor:
    """Expert `expert`'s (out, in) weight, dequantized from the fused tensor's pieces."""
    experts, rows, columns = ctx.shape
    return ctx.quant.dequantize_rows(dict(zip(ctx.names, pieces, strict=True)), (experts * rows, columns),
                                     expert * rows, rows)


class ExpertSource(Protocol):
    """Where the experts' weights come from when they are not on the module: `groups` groups of equal size,
    each loaded (its gate_up_proj and down_proj rows) before its experts run and released after (the runtime's
    streamed groups, memory_model.step.StepConfig.expert_group_size)."""

    groups: int

    def load(self, group: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def release(self, group: int) -> None: ...


class Experts(nn.Module):
    """E SwiGLU experts, fused: out_e(x) = down_e(silu(gate_e(x)) * up_e(x)), gate_e and up_e the two halves
    of gate_up_proj[e]. With a `source` their weights come from it a group at a time, each group's experts
    computed on their rows as the whole module computes them (the same matmuls in the same order). LoRA may adapt
    either fused tensor (`adapt`): expert e's weight is then W_e + scaling x B_e A_e, A and B in PEFT's
    ParamWrapper layout (layers/lora.py: `expert_factors`)."""

    adaptable: ClassVar[tuple[str, ...]] = ("gate_up_proj", "down_proj")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, f = sparse_mlp(cfg).num_experts, cfg.hidden_size, sparse_mlp(cfg).width
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()  # by the tensor they adapt; none: no LoRA
        self.scaling = 0.0
        self.source: ExpertSource | None = None  # set by the runtime around a call, else the parameters
        self.num_experts = e
        # A quantized base's tensors (`hold_quantized`): each one's (E, out, in) and piece names, and the dtype
        # its matmuls run in.
        self.quantized: dict[str, tuple[tuple[int, int, int], tuple[str, ...]]] = {}
        self.quant: FrozenQuant | None = None
        self.compute_dtype: torch.dtype | None = None

    def hold_quantized(self, name: str, quant: FrozenQuant, compute_dtype: torch.dtype) -> None:
        """Hold the fused tensor `name` as `quant`'s pieces, buffers by `layers.quant4.piece_key` (a shell of a
        4-bit base: the unit's pieces replace them at each call); each expert's weight is dequantized for its
        rows' matmuls (`GroupedLinear4bit`), in `compute_dtype` (bnb_4bit_compute_dtype)."""
        weight = getattr(self, name)
        experts, rows, columns = weight.shape
        delattr(self, name)
        names = []
        for piece, dtype, shape in quant.weight_pieces(matrix(weight.shape)):
            self.register_buffer(piece_key(name, piece), torch.empty(shape, dtype=dtype, device=weight.device))
            names.append(piece)
        self.quantized[name] = ((experts, rows, columns), tuple(names))
        self.quant, self.compute_dtype = quant, compute_dtype

    def adapt(self, name: str, rank: int, scaling: float) -> None:
        """Adapters on the fused tensor `name`, PEFT's initialisation, on its device and dtype."""
        weight = getattr(self, name)
        if name in self.quantized:  # (its pieces: the adapters take the 16-bit dtype, on their device)
            (experts, out_features, in_features), _ = self.quantized[name]
            weight = weight.new_empty((), dtype=self.quant.dtype if self.quant else weight.dtype)
        else:
            experts, out_features, in_features = weight.shape
        a, b = weight.new_empty(rank * experts, in_features), weight.new_empty(out_features, rank * experts)
        init_adapters(a, b)
        self.lora_A[name], self.lora_B[name], self.scaling = nn.Parameter(a), nn.Parameter(b), scaling

    def project(self, x: torch.Tensor, name: str, sizes: list[int] | None,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        """Rows grouped by expert times their expert's `name` weight, plus where adapted scaling x (x A_e^T) B_e^T:
        two rank-r grouped matmuls on the routed rows, never the (E, out, in) delta. `weight`: a group's part of
        it, from the source (a grouped block has no adapters: groups and LoRA are not combined)."""
        if name in self.quantized:
            shape, names = self.quantized[name]
            assert self.quant is not None and self.compute_dtype is not None  # (set with `quantized`)
            out = GroupedLinear4bit.apply(x.to(self.compute_dtype), sizes, self.quant, shape, names,
                                          *(getattr(self, piece_key(name, p)) for p in names)).to(x.dtype)
        else:
            weight = getattr(self, name) if weight is None else weight
            out = GroupedLinear.apply(x, weight, sizes)
        if name not in self.lora_A:
            return out
        a, b = expert_factors(self.lora_A[name], self.lora_B[name], self.num_experts)
        return out + self.scaling * GroupedLinear.apply(GroupedLinear.apply(x, a, sizes), b, sizes)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, d); each token's chosen experts (N, k) and their routing weights (N, k) -> the sum over its
        chosen experts of weight x expert(x), (N, d)."""
        (n, k), experts = chosen.shape, self.num_experts
        groups = 1 if self.source is None else self.source.groups
        order = chosen.flatten().argsort(stable=True)  # the (token, choice) pairs grouped by expert
        # Each group's rows are those routed to its experts; on meta, which holds no routing, an even share.
        sizes = None if x.is_meta else torch.bincount(chosen.flatten(), minlength=experts).tolist()
        share = experts // groups
        rows = ([n * k // groups] * (groups - 1) + [n * k - n * k // groups * (groups - 1)] if sizes is None
                else [sum(sizes[g * share:(g + 1) * share]) for g in range(groups)])
        routed = Gather.apply(x, order // k)
        outputs = []
        for g, inputs in enumerate(routed.split(rows) if groups > 1 else (routed,)):
            gate_up, down = (None, None) if self.source is None else self.source.load(g)
            counts = None if sizes is None else sizes[g * share:(g + 1) * share]
            hidden = self.activation(self.project(inputs, "gate_up_proj", counts, gate_up))
            outputs.append(self.project(hidden, "down_proj", counts, down))
            del gate_up, down, hidden
            if self.source is not None:
                self.source.release(g)
        grouped = outputs[0] if groups == 1 else torch.cat(outputs)
        del outputs
        # The experts' outputs back in (token, choice) order: a gather, whose backward keeps only its indices
        # (index_add's would keep the whole routed output), and no name holds the grouped output past it.
        per_choice = Gather.apply(grouped, order.argsort()).view(n, k, -1)
        del grouped
        return (per_choice * weights[..., None]).sum(dim=1).to(x.dtype)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the gate/up projection's output: silu(gate) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class RouterBalance(AuxiliaryLoss):
    """transformers' load-balancing loss (`load_balancing_loss_func`, Switch Transformer's) over one forward call,
    times `router_aux_loss_coef`. Over the R rows the routers saw that the attention mask keeps (every layer's N
    tokens less the padding, as transformers counts them given the mask; every token without one), C_e is how often
    expert e was among a row's top-k and S_e the sum of its probabilities p_re:

        loss = coef * E * sum_e (C_e / R) * (S_e / R)

    The counts are constants (top-k has no gradient), so d loss / d p_re = coef * E * C_e / R^2 for every kept row
    of every layer (0 for padding): known once every layer has counted, it joins each router's probabilities'
    gradient in that block's backward (`_Balanced`). On the device: C and S, fp32
    (SparseMlpCosts.auxiliary_loss_bytes), and the micro-batch's mask as fp32, held like its labels. The
    probabilities are the routing's fp32 ones; transformers takes the softmax of the router's logits again in the
    compute dtype (the same in fp32, a rounding apart in bf16)."""

    def __init__(self, cfg: ModelConfig, scale: float, device: torch.device,
                 attention_mask: torch.Tensor | None = None) -> None:
        mlp = sparse_mlp(cfg)
        self.coef = mlp.router_aux_loss_coef * scale
        self.state = torch.zeros(2, mlp.num_experts, dtype=torch.float32, device=device)  # C, S
        # Each row's weight (1 kept, 0 padding), in the routers' row order (B * T); None: every row counts.
        self.kept = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
        self.rows: float | torch.Tensor = 0  # R
        self.counting = False

    @classmethod
    def of(cls, cfg: ModelConfig, scale: float, device: torch.device,
           attention_mask: torch.Tensor | None) -> "RouterBalance | None":
        return cls(cfg, scale, device, attention_mask) if sparse_mlp(cfg).output_router_logits else None

    @contextlib.contextmanager
    def recording(self, counting: bool) -> Iterator[None]:
        self.counting = counting
        token = _RECORDING.set(self)
        try:
            yield
        finally:
            _RECORDING.reset(token)

    def add(self, probs: torch.Tensor, chosen: torch.Tensor) -> None:
        """A layer's routing: its probabilities (N, E) and the experts each row chose (N, k)."""
        if not self.counting:
            return
        counts, sums = self.state
        if self.kept is None:
            counts.index_add_(0, chosen.flatten(), counts.new_ones(()).expand(chosen.numel()))
            sums += probs.detach().sum(dim=0)
            self.rows += probs.shape[0]
            return
        for choice in chosen.unbind(dim=1):  # each row's j-th choice, weighted by the row's mask
            counts.index_add_(0, choice, self.kept)
        sums += self.kept @ probs.detach()
        self.rows = self.rows + self.kept.sum()

    def value(self) -> torch.Tensor:
        counts, sums = self.state
        return self.coef * counts.shape[0] * ((counts / self.rows) * (sums / self.rows)).sum()

    def add_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """grad (N, E), a router's probabilities', plus d loss / d p_re: the same for every kept row r, in place."""
        counts = self.state[0]
        per_expert = self.coef * counts.shape[0] * counts / self.rows ** 2  # (E,)
        return grad.add_(per_expert) if self.kept is None else grad.addcmul_(self.kept[:, None], per_expert)


_RECORDING: ContextVar[RouterBalance | None] = ContextVar("the forward's RouterBalance", default=None)


class _Balanced(torch.autograd.Function):
    """The router's probabilities unchanged; in the backward their gradient plus the load-balancing loss's.
    Added in place: the gradient is the one top-k's backward made for them alone."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, balance: RouterBalance) -> torch.Tensor:
        ctx.balance = balance
        return probs.view_as(probs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.balance.add_gradient(grad), None


class SparseMoe(nn.Module):
    """The router picks each token's top-k experts by softmax probability (in fp32); their weights are those
    probabilities, renormalised over the chosen ones where `norm_topk_prob`. Inside a `RouterBalance`'s
    recording the routing also goes to its load-balancing loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        mlp = sparse_mlp(cfg)
        self.top_k, self.renormalise = mlp.num_experts_per_tok, mlp.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, mlp.num_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])  # (N, d)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
        balance = _RECORDING.get()
        if balance is not None:
            probs = _Balanced.apply(probs, balance)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        if balance is not None:
            balance.add(probs, chosen)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, chosen, weights.to(x.dtype)).view_as(h)


class MoeBlock(LlamaBlock):
    """A Llama-family block with a sparse MLP."""

    mlp_type: ClassVar[type[nn.Module]] = SparseMoe


UNITS = FamilyUnits(embed=LlamaEmbedding, block=MoeBlock, head=LlamaHead, model=Llama,
                    auxiliary=RouterBalance.of)
