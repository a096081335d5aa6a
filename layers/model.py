"""What generic code asks of a family's torch side: a unit's module, the resident reference model and its loss,
its strict HF loading, the weight-decay rule, and an auxiliary loss its blocks add to. A family's torch side is the
`UNITS` of the `units` module beside its config module (`layers/<family>/units.py`), a `FamilyUnits`."""
from __future__ import annotations

import abc
import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn

from layers.config import ModelConfig
from layers.loss import causal_lm_loss


def weight_decayed(shape: Sequence[int]) -> bool:
    """AdamW decays matrices and embeddings, not biases or norm weights (HF Trainer's rule)."""
    return len(shape) >= 2


class AuxiliaryLoss(abc.ABC):
    """A term of the model's loss over one forward call (a micro-batch) that its blocks add to as they run, a
    mixture's router load balance: the blocks called inside `recording()` add to `state`, and `value()` is the
    term once they all have. Its gradient w.r.t. a block's output needs every block's forward (the whole
    forward's sums), so a block's backward adds it where it passes, reading the sums then: the term's gradient
    reaches the weights through the backward of the loss it is added to, and `value()` has none of its own."""

    state: torch.Tensor  # all it holds on the device (Costs.auxiliary_loss_bytes)

    @abc.abstractmethod
    def recording(self, counting: bool) -> ContextManager[None]:
        """The blocks called inside are this forward's: they add to the sums where `counting` (not where a block's
        forward is run again for its backward, activation checkpointing's recompute), and their backward adds the
        term's gradient."""

    @abc.abstractmethod
    def value(self) -> torch.Tensor:
        """The term (a 0-dim fp32 tensor, scaled as the loss it is added to), once every block has counted."""


def no_auxiliary_loss(cfg: ModelConfig, scale: float, device: torch.device,
                      attention_mask: torch.Tensor | None) -> AuxiliaryLoss | None:
    """A family whose loss is the language model's alone."""
    return None


@dataclass(frozen=True)
class FamilyUnits:
    """A family's torch side: the module of each kind of unit and the resident model. Each takes the family's
    config; a block also its `AttentionLayout.layer_types()` entry. `auxiliary(cfg, scale, device, attention_mask)`: a
    new forward call's auxiliary loss where cfg asks for one (None: the loss is the language model's alone), its
    term multiplied by `scale` beyond the family's coefficient, over the tokens transformers' attention mask
    (B, T) keeps (None: every token)."""

    # Each takes its family's own config class: Any, since a Callable of a subclass is not one of ModelConfig.
    embed: Callable[[Any], nn.Module]
    block: Callable[[Any, str], nn.Module]
    head: Callable[[Any], nn.Module]
    model: Callable[[Any, bool], "CausalLM"]  # (cfg, init): HF's initialisation unless init is False
    auxiliary: Callable[[Any, float, torch.device, torch.Tensor | None], AuxiliaryLoss | None] = \
        no_auxiliary_loss


def family_units(cfg: ModelConfig) -> FamilyUnits:
    """The units of cfg's family: `UNITS` in the `units` module of its config's package."""
    package = type(cfg).__module__.rsplit(".", 1)[0]
    units = importlib.import_module(f"{package}.units").UNITS
    if not isinstance(units, FamilyUnits):
        raise TypeError(f"{package}.units.UNITS is a {type(units).__name__}, not a FamilyUnits")
    return units


def unit_kind(cfg: ModelConfig, unit: str) -> str:
    """What a unit's module is built from: 'embed', 'head', or a block's layer type ('full_attention'). Units
    of one kind share a module shell; only their weights differ."""
    kind, _, index = unit.partition(".")
    if kind == "block" and index.isdigit() and int(index) < cfg.num_hidden_layers:
        return cfg.attention().layer_types()[int(index)]
    if kind in ("embed", "head") and not index:
        return kind
    raise ValueError(f"unknown unit {unit!r}; units are 'embed', 'block.N' (N < {cfg.num_hidden_layers}), 'head'")


def build_unit(cfg: ModelConfig, unit: str, device: torch.device | str = "meta") -> nn.Module:
    """An empty module of a unit's type (on `meta` by default: a shell for torch.func.functional_call)."""
    units, kind = family_units(cfg), unit_kind(cfg, unit)
    with torch.device(device):
        if kind == "embed":
            return units.embed(cfg)
        if kind == "head":
            return units.head(cfg)
        return units.block(cfg, kind)


def resident_model(cfg: ModelConfig, init: bool = True) -> "CausalLM":
    """The family's whole model in memory, HF's structure and keys; HF's initialisation unless `init=False`."""
    return family_units(cfg).model(cfg, init)


class CausalLM(nn.Module):
    """The base of a family's resident model: `model(input_ids)` -> float32 logits (B, T, vocab); its
    state_dict is the transformers class's, key for key."""

    cfg: ModelConfig

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, num_items: float | None = None,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """transformers' `loss` of the batch: the causal-LM loss (`causal_lm_loss`), plus the auxiliary loss where
        the config asks for one, whose gradient the backward adds (`AuxiliaryLoss`). `attention_mask` (B, T):
        transformers', False on padding at the end of a row (which the labels leave unlearned); only the
        auxiliary loss reads it."""
        auxiliary = family_units(self.cfg).auxiliary(self.cfg, 1.0, input_ids.device, attention_mask)
        with contextlib.nullcontext() if auxiliary is None else auxiliary.recording(counting=True):
            loss = causal_lm_loss(self(input_ids), labels, num_items)
        return loss if auxiliary is None else loss + auxiliary.value()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load an HF state dict strictly, naming missing, extra and mis-shaped keys. A tied parameter is read
        from the one tensor a tied checkpoint holds."""
        clean = {k: v for k, v in state_dict.items() if not k.endswith(self.cfg.ignored_checkpoint_suffixes)}
        for tied, owner in self.cfg.adapter().tied_keys().items():
            if owner in clean:
                clean[tied] = clean[owner]
        check_state_dict(self.state_dict(), clean)
        self.load_state_dict(clean, strict=True)


class CheckpointMismatch(ValueError):
    """A state dict whose keys or shapes do not match the model."""


def check_state_dict(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    wrong = sorted(
        f"{k}: expected {tuple(expected[k].shape)}, got {tuple(given[k].shape)}"
        for k in set(expected) & set(given) if tuple(expected[k].shape) != tuple(given[k].shape)
    )
    problems = []
    if missing:
        problems.append(f"missing keys {_few(missing)}")
    if extra:
        problems.append(f"unexpected keys {_few(extra)}")
    if wrong:
        problems.append(f"wrong shapes {_few(wrong)}")
    if problems:
        raise CheckpointMismatch(
            "checkpoint does not match the model config: " + "; ".join(problems)
            + " (is config.json the one this checkpoint was saved with?)"
        )


def _few(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return f"[{shown}{f', … {len(items) - limit} more' if len(items) > limit else ''}]"
