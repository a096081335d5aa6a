"""A family's LoRA targets, a facet of its config (torch-free): the block's projections that LoRA's adapters may
target and their module keys, those targeted when none are named (PEFT's default), those that are weight tensors
rather than Linear modules (a mixture's fused experts, a pair of adapters per expert), each projection's shape,
and where a target's adapters are in a block and in PEFT's saved adapter. `ModelConfig.lora()` builds a family's
(the config names its class, `lora_class`); the family's is its folder's targets.py. The torch modules that carry
the adapters are layers/lora.py's."""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class LoraKeys:
    """Where a LoRA target's tensors are: the adapted weight's key in a block, its adapters' keys in the block's
    module (`a`, `b`), and their keys in PEFT's saved adapter (`peft_a`, `peft_b`, after the block's prefix)."""

    weight: str
    a: str
    b: str
    peft_a: str
    peft_b: str


class LoraTargets(abc.ABC):
    # A block's projections that can carry LoRA adapters, by the names HF and PEFT give them -> their key
    # inside the block ('q_proj' -> 'attn.q_proj').
    projections: ClassVar[dict[str, str]]
    # The projections --lora-targets means when it names none: PEFT's default for the model_type.
    defaults: ClassVar[tuple[str, ...]] = ("q_proj", "v_proj")
    # Those of `projections` that are a weight tensor rather than a Linear module (a mixture's fused experts,
    # which PEFT targets by `target_parameters`), in the order the module registers them.
    parameters: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg  # the family's config, which imports this module: not imported here

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, int]:
        """(in_features, out_features) of the block projection `name` (one of `projections`); an expert tensor's
        is one expert's."""

    def experts(self, target: str) -> tuple[int, int]:
        """(adapter pairs, how many of them each token goes through) of a target: one and one for a Linear
        projection; a mixture's fused expert tensor has a pair per expert."""
        return 1, 1

    def keys(self, target: str, targets: tuple[str, ...]) -> LoraKeys:
        """The keys of a target's weight and adapters, with adapters on `targets`: PEFT's lora.Linear keeps A
        and B as Linear modules beside the projection ('self_attn.q_proj.lora_A.weight')."""
        key = self.projections[target]
        return LoraKeys(f"{key}.weight", f"{key}.lora_A.weight", f"{key}.lora_B.weight", f"{key}.lora_A.weight",
                        f"{key}.lora_B.weight")
