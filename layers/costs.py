"""What a step costs by family: the byte and FLOP inputs memory_model reads, behind one protocol (torch-free).

A family's costs facet (`layers/<family>/costs.py`) is built from its config (`ModelConfig.costs()`) and gives
memory_model what a block and the head save per token (measured against autograd), what a LoRA run's frozen block
saves, a block's backward peaks and its matmul weights. memory_model reads `Costs` alone, never a family's own
fields. `BaseCosts` gives the terms most families lack (zero) and keeps the config the facet reads.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class FrozenBlockSaves:
    """What a block with frozen weights and LoRA adapters saves besides the adapters' own tensors: only what the
    gradients w.r.t. its input and its adapters need (no matmul keeps its input for a weight gradient)."""

    per_token: int  # bytes per token: norms' inputs and statistics, attention's inputs and output, the MLP's
    attention: bool  # whether attention's inputs need a gradient (it then also saves its logsumexp, any mask)
    rotary: bool  # whether a rotated tensor needs a gradient (the rotary tables are then saved)
    input_grad: dict[str, bool]  # per target projection, whether its input needs a gradient
    # Whether the block's input tensor itself is among these saves, so that a checkpointed block's kept input is
    # one of its recompute's storages (a trained block's `Costs.block_saves_input`).
    input_saved: bool
    fixed: int = 0  # bytes whatever the tokens (Gemma's fp32 1 + weight of a norm whose input needs a gradient)
    # Whether attention's scores need a gradient where it has sinks (it then saves its mask): not where only v's
    # adapters make its probabilities saved.
    scores: bool = True


class Costs(Protocol):
    """A family's byte and FLOP inputs, for a compute dtype of `es` bytes, read from its config."""

    def __init__(self, cfg: Any) -> None: ...

    def block_matmul_params(self) -> int:
        """The weights of a block's matmuls: a forward's matmul FLOPs are 2 x tokens x this."""
        ...

    def active_mlp_width(self) -> int:
        """The width of the MLP a token goes through, which its elementwise work scales with: `intermediate_size`,
        or a mixture of experts' k chosen experts' widths together."""
        ...

    def block_saved_per_token(self, es: int) -> int:
        """Bytes a block's forward saves per token, measured against autograd (tests/test_planner.py), besides
        what every family's attention saves alike (memory_model.shapes: the logsumexp, a packed rows' mask, the
        rotary tables)."""
        ...

    def block_saved_fixed(self, es: int) -> int:
        """Bytes a block's forward saves whatever its tokens (Gemma's fp32 1 + weight of each norm)."""
        ...

    def block_saves_input(self, es: int) -> bool:
        """Whether a block saves its input tensor itself (so a checkpointed block's kept input is one of the
        storages its recompute saves), rather than only values computed from it."""
        ...

    def block_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        """The moments of a block's backward where autograd holds the most beyond what the block saved and the
        incoming gradient: per moment, (bytes per token, parameters whose weight gradient exists by then, bytes
        whatever the tokens: a saved tensor of fixed size already freed is negative). Measured against autograd
        (tests/test_backward_transient.py)."""
        ...

    def scores_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        """Where attention makes its scores whole (`ModelConfig.attention_sinks`): the moments of its backward, as
        `block_backward_peaks` gives them, besides the two gradients of its softmax then live."""
        ...

    def experts_saved_after_per_token(self, es: int) -> int:
        """Bytes per token of `block_saved_per_token` that a block's forward saves after its last expert has run
        (the experts' outputs recombined): while a group of experts is on the device, these are not saved yet."""
        ...

    def expert_group_backward_peaks(self, es: int, group: int) -> tuple[tuple[int, int, int], ...]:
        """`block_backward_peaks` of the backward of one group of `group` experts (the parameters: the group's own
        whose gradient exists by then)."""
        ...

    def head_saved_per_token(self, es: int, frozen: bool = False) -> int:
        """Bytes the head's forward saves per token besides the loss's own (log-sum-exp and labels); `frozen`:
        its weights need no gradient (LoRA's base)."""
        ...

    def head_saved_fixed(self) -> int:
        """Bytes the head's forward saves whatever its tokens, besides `head_saved_per_token`'s."""
        ...

    def auxiliary_loss_bytes(self) -> int:
        """Device bytes of a micro-batch's auxiliary loss, which its blocks add to as they run (a mixture's
        router load balance, `layers.model.AuxiliaryLoss`), held from its first block's forward to that block's
        backward; 0: the model's loss has no such term."""
        ...

    def frozen_block_saves(self, es: int, targets: frozenset[str], plain: bool, grad_in: bool) -> FrozenBlockSaves:
        """What a LoRA block saves with adapters on `targets` (`plain`: no dropout before them), its input
        needing a gradient or not (`grad_in`: not the first block), measured against autograd
        (tests/test_lora.py)."""
        ...


class BaseCosts:
    """The config a facet reads, and the terms most families lack."""

    def __init__(self, cfg: Any) -> None:
        # The family's config (layers/<family>/config.py), which imports this module: not imported here.
        self.cfg = cfg

    def active_mlp_width(self) -> int:
        return self.cfg.intermediate_size

    def block_saved_fixed(self, es: int) -> int:
        return 0

    def scores_backward_peaks(self, es: int) -> tuple[tuple[int, int, int], ...]:
        return ()

    def experts_saved_after_per_token(self, es: int) -> int:
        return 0

    def expert_group_backward_peaks(self, es: int, group: int) -> tuple[tuple[int, int, int], ...]:
        return ()

    def head_saved_fixed(self) -> int:
        return 0

    def auxiliary_loss_bytes(self) -> int:
        return 0
