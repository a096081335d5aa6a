"""A family's parameters by streamed unit, a facet of its config (torch-free): each unit's own parameters (what
its state holds and its update walks), what a unit borrows from another (a tied head's lm_head is the embedding's
weight), what its module uses on the device, and the experts of a block's sparse MLP that expert groups load.
`ModelConfig.params()` builds a family's (the config names its class, `params_class`); the family's counts are
beside its config, in its config.py."""
from __future__ import annotations

import abc
from typing import Any


class UnitParams(abc.ABC):
    """A family defines its units' counts (`embed`, `block`, `head`) and what a unit borrows; the rest is the same
    for every family."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg  # the family's config, which imports this module: not imported here

    @abc.abstractmethod
    def embed(self) -> int:
        """The embedding unit's own parameters."""

    @abc.abstractmethod
    def block(self) -> int:
        """One block's parameters."""

    @abc.abstractmethod
    def head(self) -> int:
        """The head's own parameters (a borrowed lm_head is not its own)."""

    def borrowed(self, unit: str) -> dict[str, tuple[str, str]]:
        """The unit's parameters that another unit's state holds: the unit's own key -> (that unit, its key
        there), each the other unit's whole weights (a tied 'lm_head.weight' -> ('embed', 'embed_tokens.weight')).
        Such a parameter has one master, one pair of moments and one update, in its owner, whose gradient sums
        both uses. Empty: the unit holds all its own."""
        return {}

    def lenders(self) -> frozenset[str]:
        """The units whose weights another unit borrows (a tied head's embedding): their gradient sums both uses."""
        return frozenset(owner for unit in self.cfg.unit_names() for owner, _ in self.borrowed(unit).values())

    def own(self, unit: str) -> int:
        """The parameters the unit's own state holds (and its update walks); they add up to
        `ModelConfig.num_params`."""
        if unit == "embed":
            return self.embed()
        if unit == "head":
            return self.head()
        return self.block()

    def device_parts(self, unit: str) -> list[int]:
        """The parameters the unit's module uses on the device, by the state that holds them: each unit it
        borrows from, then its own (a tied head: the embedding's weight, then its norm)."""
        return [self.own(owner) for owner, _ in self.borrowed(unit).values()] + [self.own(unit)]

    def device(self, unit: str) -> int:
        """The parameters the unit's module uses on the device: its own and those it borrows."""
        return sum(self.device_parts(unit))

    def experts(self) -> int:
        """The experts of a block's sparse MLP that may be loaded in groups (memory_model.step.StepConfig.
        expert_group_size); 0: its MLP loads whole (a dense MLP, or experts the groups do not carry)."""
        sparse = self.cfg.sparse_mlp
        return sparse.num_experts if sparse is not None and sparse.grouped else 0

    def expert(self) -> int:
        """One expert's parameters, of a block's `experts()`: its rows of the sparse MLP's `keys`."""
        sparse = self.cfg.sparse_mlp
        return 0 if sparse is None else sparse.expert_params(self.cfg.hidden_size)

