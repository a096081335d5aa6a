"""The work besides the big matmuls: attention, elementwise kernels, the loss, the gradient fold.

On a GPU they are memory-bound: the presets price them by the HBM bytes they move (gpu_elementwise_bytes). On a
CPU they are most of a block's time: a GPT-J-350M block's forward spends about 6 ms in matmuls and 13 ms in
LayerNorm, rotary, GELU, casts, residual adds and the attention kernel. The `local` spec measures each on
a real layers.GPTJBlock / GPTJHead / GPTJEmbedding (calibrate.measure_kernel_costs) and the planner scales
them to other shapes with the counts below. Derivation in docs/MEMORY_MODEL.md ("Kernel costs").
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from layers.config import ModelConfig
from memory_model.tiers import Tier


def attention_flops(shape: ModelConfig, batch: int, seq: int) -> int:
    """QK^T and AV of one block's forward, the full T x T (the convention forward_flops uses too)."""
    return 4 * batch * seq * seq * shape.attention_width


def elementwise_width(shape: ModelConfig) -> int:
    """What a block's elementwise traffic scales with per token: the d-wide tensors of the attention side
    (LayerNorm, q/k/v rotary and transposes, residual adds) and the f-wide ones of the MLP (GELU, bias), f the
    width a token goes through (a mixture's k experts together)."""
    return shape.hidden_size + shape.costs().active_mlp_width()


@dataclass(frozen=True)
class KernelCosts:
    """Measured costs of one compute dtype. Rates are FLOP/s, the rest seconds per counted element."""

    attention_forward_flops: float  # causal scaled_dot_product_attention, forward
    attention_backward_flops: float  # and its backward
    elementwise_forward_s: float  # per token x elementwise_width of a block's forward
    elementwise_backward_s: float  # and of its backward
    logits_forward_s: float  # per logit (token x vocab): the fp32 cast and the loss
    logits_backward_s: float  # per logit: each chunk's logits again (and their matmul), the loss's backward, bias grad
    embedding_backward_s: float  # per element of the dense embedding gradient (zeroed, then scattered into)
    gradient_fold_bytes_per_s: float  # the host folding a gradient into its fp32 accumulator, and the norm
    # An update's new compute weights: its fp32 master cast to the compute dtype (4 + es bytes per parameter),
    # as costly as AdamW itself on a CPU; none in fp32, where the master is the compute copy.
    compute_cast_bytes_per_s: float
    # What an event costs whatever its size (the runtime's hand-offs and bookkeeping, each small kernel's
    # dispatch), measured on models too small for their kernels to take time: per forward, backward or
    # update event, and per step besides its events (streamer/calibration/host_costs.py). On the RAM tier,
    # then on the disk tier, whose events also read and write the store's files and whose commit flushes the
    # manifest; each state file's own cost is `state_file_s`, on the disk's queue.
    event_s: float
    step_s: float
    disk_event_s: float
    disk_step_s: float
    # The host's cores moving a disk-tier byte through the page cache (written into it, read from it): on a
    # cpu device the same cores compute, so the bytes a disk-tier step writes, and the gradient files it reads
    # back, take this time from its compute. Its state files are read past the page cache (no copy).
    page_cache_bytes_per_s: float
    # One flush (fsync) of a small file just written: what a commit pays per file it makes durable beyond the
    # flushes the disk tier's fixed costs hold (a journaled step's gradient files and journal, LoRA's adapters).
    flush_s: float
    # A disk-tier state file's cost beyond its bytes: opened, then sealed after its unit's last write-back
    # (flushed, its trailer written and flushed, renamed, its folder flushed), on the write worker.
    state_file_s: float = 0.0
    # The opt-in precisions' elementwise work, per parameter: an int8 moment quantized for its write-back and
    # dequantized at its load, on the I/O worker; a bf16 master's stochastic rounding, in the update.
    quantize_s: float = 0.0
    dequantize_s: float = 0.0
    round_s: float = 0.0
    # Attention's cost per token and query head besides its FLOPs, forward and backward: a CPU's flash attention
    # works in blocks of queries and keys, so short sequences pay for whole blocks (its bf16 backward at
    # 16 x 32 tokens took as long as at 1 x 512, a sixteenth of the FLOPs).
    attention_forward_token_s: float = 0.0
    attention_backward_token_s: float = 0.0

    def fixed_s(self, store: Tier) -> tuple[float, float]:
        """(per event, per step) fixed seconds on store tier `store`: the disk's where its bytes cross a link."""
        return (self.disk_event_s, self.disk_step_s) if store.crosses_link else (self.event_s, self.step_s)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            rate = f.name.endswith(("_flops", "_per_s"))
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or value < 0 or (rate and value == 0)):
                raise ValueError(f"KernelCosts.{f.name} must be a finite number {'> 0' if rate else '>= 0'}, "
                                 f"got {value!r}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "KernelCosts":
        known = {f.name for f in fields(cls)}
        if set(raw) != known:
            raise ValueError(f"KernelCosts needs exactly the fields {sorted(known)}, got {sorted(raw)}")
        return cls(**raw)

    def forward_s(self, shape: ModelConfig, unit: str, batch: int, seq: int) -> float:
        """Seconds of one forward beyond its matmuls (attention's included here, not in the matmuls)."""
        n = batch * seq
        if unit == "embed":
            return 0.0
        if unit == "head":
            return self.logits_forward_s * n * shape.vocab_size
        return (attention_flops(shape, batch, seq) / self.attention_forward_flops
                + self.attention_forward_token_s * n * shape.num_attention_heads
                + self.elementwise_forward_s * n * elementwise_width(shape))

    def backward_s(self, shape: ModelConfig, unit: str, batch: int, seq: int) -> float:
        """Seconds of one backward beyond its matmuls (the weight gradients leave as they are, per parameter)."""
        n = batch * seq
        if unit == "embed":
            return self.embedding_backward_s * shape.vocab_size * shape.hidden_size
        if unit == "head":
            return self.logits_backward_s * n * shape.vocab_size
        return (2 * attention_flops(shape, batch, seq) / self.attention_backward_flops
                + self.attention_backward_token_s * n * shape.num_attention_heads
                + self.elementwise_backward_s * n * elementwise_width(shape))


def gpu_elementwise_bytes(shape: ModelConfig, unit: str, phase: str, batch: int, seq: int, es: int) -> int:
    """HBM bytes of one forward or backward's kernels beside the matmuls and attention on a GPU: normalizations,
    rotary, activations, residual adds, the loss and the embedding's gather. Each is memory-bound, so its time is
    these bytes over the HBM bandwidth. Counted for GPT-J's block, and used for every family's, per token of a
    block's forward: LayerNorm reads and writes d, rotary q and k 2 x 2d, the GELU (with its bias) f in and out,
    the residual sum three d in and one out (10d + 2f elements).
    The head's LayerNorm moves 2d; its loss casts each logit to fp32 and reads it for the softmax (es + 8 bytes a
    logit), and its backward writes the logit's gradient from the fp32 probabilities (4 + es). The embedding
    writes d a token; its backward zeroes the dense vocab x d gradient and adds each token's row into it. A
    backward moves twice its forward's elements (the saved input and the incoming gradient in, one gradient out).
    f is the MLP's width a token goes through: a mixture's k chosen experts together."""
    n, d, f, vocab = batch * seq, shape.hidden_size, shape.costs().active_mlp_width(), shape.vocab_size
    backward = phase == "backward"
    if unit == "embed":
        return (vocab * d + 2 * n * d) * es if backward else 2 * n * d * es
    if unit == "head":
        norm = (2 if backward else 1) * 2 * n * d * es
        return norm + n * vocab * ((4 + es) if backward else (es + 8))
    return (2 if backward else 1) * n * (10 * d + 2 * f) * es
