"""The optimizer's settings (`OptimizerConfig`), its learning-rate schedule (`LRSchedule`) and the AdamW update
of one chunk of a unit's flat state, with torch's own Adam kernels; a bf16 master's stochastic rounding."""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from torch.optim.adam import adam

from memory_model.settings import Choice, Integer, Number, Pair, check_settings, setting
from streamer import native
from streamer.compiled import kernel
from streamer.errors import ConfigError

NONFINITE_POLICIES = ("stop", "skip")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, gradient clipping and what a non-finite step does. The master's and the moments' dtypes are the
    step's (`StepConfig.precision`)."""

    lr: float = setting(1e-4, "peak learning rate", Number(0.0, low_open=True))
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW's moment decay rates, each in [0, 1): B1,B2 or B1 B2",
                                         Pair(Number(0.0, 1.0, high_open=True)))
    eps: float = setting(1e-8, "AdamW's epsilon, added to the root of the second moment", Number(0.0, low_open=True))
    weight_decay: float = setting(0.1, "AdamW weight decay (matrices only)", Number(0.0))
    max_grad_norm: float = setting(1.0, "clip gradients to this global norm (0: no clipping)", Number(0.0))
    nonfinite: str = setting("stop", "on a non-finite loss or gradient: stop the run, or skip the step "
                                     "(nothing is updated; the next batch follows)", Choice(NONFINITE_POLICIES),
                             "POLICY")

    def __post_init__(self) -> None:
        check_settings(self, ConfigError.of)


SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LRSchedule:
    """constant, or linear warmup then cosine / linear decay to min_lr_ratio * lr at total_steps."""

    kind: str = setting("constant", "learning-rate schedule after warmup: constant, cosine or linear",
                        Choice(SCHEDULES), "KIND")
    warmup_steps: int = setting(0, "linear warmup steps", Integer(0))
    total_steps: int | None = setting(None, "the step the decay ends at", Integer(0))
    min_lr_ratio: float = setting(0.0, "the cosine/linear schedule ends at this fraction of --lr", Number(0.0, 1.0))

    def __post_init__(self) -> None:
        check_settings(self, ConfigError.of)
        if self.kind != "constant" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ConfigError(f"a {self.kind} schedule needs total_steps > warmup_steps ({self.warmup_steps})")

    def lr_at(self, step: int, base_lr: float) -> float:
        """Learning rate of optimizer step `step` (1-based, as torch counts Adam steps).

        Identical to Hugging Face's schedulers (transformers.get_constant_schedule_with_warmup,
        get_linear_schedule_with_warmup, get_cosine_schedule_with_warmup and, with min_lr_ratio,
        get_cosine_with_min_lr_schedule_with_warmup(min_lr_rate=...)), whose lambda at scheduler index step - 1
        sets the lr of optimizer step `step`: so step 1 of a warmup trains at lr 0. The same float operations in
        the same order make the values bit-equal. HF has no linear schedule with a floor: ours scales the linear
        factor as its cosine does, factor * (1 - min_lr_ratio) + min_lr_ratio, so min_lr_ratio 0 is HF's
        linear exactly (and any ratio is get_polynomial_decay_schedule_with_warmup(power=1, lr_end=ratio * lr)
        up to rounding). Past total_steps the decay stays at its end value.
        """
        current = step - 1
        if current < self.warmup_steps:
            return base_lr * (float(current) / float(max(1, self.warmup_steps)))
        if self.kind == "constant":
            return base_lr * 1.0
        assert self.total_steps is not None
        current = min(current, self.total_steps)
        decay_steps = float(max(1, self.total_steps - self.warmup_steps))
        if self.kind == "cosine":
            progress = float(current - self.warmup_steps) / decay_steps
            factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
        else:
            factor = max(0.0, float(self.total_steps - current) / decay_steps)
        return base_lr * max(0, factor * (1 - self.min_lr_ratio) + self.min_lr_ratio)


def adamw_chunk(state: dict[str, torch.Tensor], start: int, decay_end: int, tc: OptimizerConfig,
                step: int, lr: float, clip_coef: float, rounding: int | None = None) -> None:
    """Update master/exp_avg/exp_avg_sq in place from grad for elements [start, start + n) of a unit.

    Elements before `decay_end` are matrices and embeddings (decayed); the rest are biases and LayerNorm
    parameters (not decayed). AdamW is elementwise, so a flat chunk gives what per-parameter tensors give.
    `rounding`: the unit's `rounding_key` where the master is stored in bf16: the fp32 result is then rounded
    stochastically to bf16 values (`round_to_bf16_`), which the store's cast keeps exactly.
    """
    grad = state["grad"]
    if clip_coef != 1.0:
        grad.mul_(clip_coef)
    count = grad.numel()
    split = min(max(decay_end - start, 0), count)
    device = grad.device
    # torch's fused kernel makes one pass over the state (6x the single-tensor path on this CPU); meta has none.
    fused = device.type in ("cpu", "cuda")
    for lo, hi, weight_decay in ((0, split, tc.weight_decay), (split, count, 0.0)):
        if lo == hi:
            continue
        # adam() advances the step tensor itself: hand it the count before this step.
        steps = [torch.tensor(float(step - 1), device=device if fused else "cpu")]
        adam([state["master"][lo:hi]], [grad[lo:hi]], [state["exp_avg"][lo:hi]], [state["exp_avg_sq"][lo:hi]],
             [], steps, foreach=False, fused=fused or None, decoupled_weight_decay=True, amsgrad=False,
             beta1=tc.betas[0], beta2=tc.betas[1], lr=lr, weight_decay=weight_decay, eps=tc.eps, maximize=False)
    if rounding is not None:
        stochastic_round_bf16_(state["master"], rounding, start)


# Elements whose random bits are drawn at once on a CPU by eager torch: the hash's dozen passes then stay in the
# core's cache, 2-3x faster than passes over a whole 16 Mi chunk in memory. A compiled kernel or another device
# draws a chunk at once.
CPU_ROUNDING_BLOCK = 2**15


def stochastic_round_bf16_(master: torch.Tensor, key: int, start: int) -> None:
    """Round the fp32 `master`, elements [start, ...) of a unit, in place to bf16 values with the unit's random
    bits (`rounding_key`, `random_bits16`): on the CPU in one pass of C++ (`rounding.cpp`), elsewhere compiled,
    and block by block where eager on a CPU."""
    on_cpu = master.device.type == "cpu" and master.dtype == torch.float32 and master.is_contiguous()
    library = _ROUNDING.get() if on_cpu else None
    if library is not None:
        library.ws_round_bf16(master.data_ptr(), master.numel(), start & 0xFFFFFFFF, key & 0xFFFFFFFF,
                              *_HASH_MULTIPLIERS, torch.get_num_threads())
        return
    whole = master.device.type != "cpu" or _round_stochastically.compiles(master.numel())
    block = max(master.numel(), 1) if whole else CPU_ROUNDING_BLOCK
    for lo in range(0, master.numel(), block):
        piece = master[lo:lo + block]
        _round_stochastically(piece.numel(), piece, _start_and_key(start + lo, key, master.device))


@kernel()
def _round_stochastically(values: torch.Tensor, start_and_key: torch.Tensor) -> None:
    """`round_to_bf16_` of `values` with the bits `random_bits16` draws for them."""
    index = torch.arange(values.numel(), dtype=torch.int32, device=values.device)
    round_to_bf16_(values, _bits16(index, start_and_key))


# lowbias32 (Chris Wellons' hash-prospector): a 32-bit integer hash under which every output bit flips with
# probability close to 1/2 when any input bit does. Both multipliers are below 2^31.
_HASH_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
_ROUNDING = native.Library(
    Path(__file__).with_name("rounding.cpp"), native.KERNEL_FLAGS,
    {"ws_round_bf16": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                       ctypes.c_uint32, ctypes.c_int]},
    "the bf16 master's C++ rounding", "a compiled torch kernel rounds it instead")


def rounding_key(seed: int, step: int, unit: str) -> int:
    """The 32-bit key of one unit's stochastic rounding in one step. It depends on the run's seed, the step and
    the unit alone, never on global RNG state: a resumed or rolled-forward step, and every replicated
    data-parallel rank, round alike."""
    return xxhash.xxh32_intdigest(f"{seed}:{step}:{unit}".encode())


def random_bits16(key: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """16 uniform random bits (int32 values in [0, 2^16)) for each of elements [start, start + count) of a unit:
    lowbias32 of (element index mod 2^32) XOR `key`, a counter-based generator. The bits of an element are the
    same on every device and for every chunking of the unit (a sharded rank passes its slice's global start)."""
    index = torch.arange(count, dtype=torch.int32, device=device)
    return _bits16(index, _start_and_key(start, key, device))


def _start_and_key(start: int, key: int, device: torch.device) -> torch.Tensor:
    """`start` and `key` as int32 values in one tensor: a compiled kernel then takes any of them without
    recompiling (as Python integers, inductor's C++ mistyped the hash's shifts)."""
    return torch.tensor([_as_int32(start), _as_int32(key)], dtype=torch.int32, device=device)


def _bits16(index: torch.Tensor, start_and_key: torch.Tensor) -> torch.Tensor:
    """`random_bits16` of the elements `index` (int32) past `start_and_key`'s start."""
    x = (index + start_and_key[0]) ^ start_and_key[1]  # int32 arithmetic wraps: indices mod 2^32
    for shift, multiplier in zip((16, 15), _HASH_MULTIPLIERS, strict=True):
        # A logical right shift: int32's own is arithmetic, so the sign's copies are masked off.
        x = (x ^ ((x >> shift) & ((1 << (32 - shift)) - 1))) * multiplier
    x = x ^ ((x >> 15) & ((1 << 17) - 1))
    return (x >> 16) & 0xFFFF  # the best-mixed top 16 bits


def _as_int32(value: int) -> int:
    """`value` mod 2^32 as a signed 32-bit integer (what an int32 tensor holds)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def round_to_bf16_(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Round fp32 `values` in place to bf16 values, stochastically: add the 16 random `bits` below bf16's
    mantissa and truncate them (torchao's _AdamW with bf16_stochastic_round=True). A value rounds away from
    zero with probability equal to its distance from the bf16 value below it, in units of the gap, so its
    expected rounding is itself: updates smaller than the gap still move the weights on average."""
    values.view(torch.int32).add_(bits).bitwise_and_(-0x10000)
    return values
