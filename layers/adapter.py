"""How transformers names and saves a family's model, torchtitan's state-dict adapter (torch-free): its config.json
read and written, the checkpoint key of each unit's tensor, the names a checkpoint holds each tensor under, the
tensors it saves in parts or packed, and the keys a tied checkpoint leaves out. `ModelConfig.adapter()` builds a
family's from its config (the config names its class, `adapter_class`), and `ModelConfig.from_hf` reads a
config.json through it; the checkpoint reader and writer (streamer/io/hf.py) and the resident model's strict loading
read it. Each family's is its folder's adapter.py."""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping


class StateDictAdapter(abc.ABC):
    """A family's adapter gives its checkpoint's key map (`body`, `blocks`, `final_norm`) and how its config.json is
    read (`config_fields`) and written (`to_hf`); by default every tensor is saved whole, under the name its
    transformers model gives it."""

    # HF's prefix of the model body ('transformer.'), of its list of blocks within it ('h'), and the head's final
    # norm, which HF keeps in the body ('ln_f').
    body: ClassVar[str]
    blocks: ClassVar[str]
    final_norm: ClassVar[str]
    # The common sizes a config.json must name (transformers writes them all): a default would be a guess.
    required: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    # transformers' defaults for the model_type's fields a config.json may leave out, where ours differ.
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg  # the family's config, which imports this module: not imported here

    # --- config.json -----------------------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def config_fields(cls, config: type[Any], raw: dict[str, Any]) -> dict[str, Any]:
        """The fields of `config` (a family's class) that a config.json's keys give: model_type already removed,
        the `required` ones there, transformers' `defaults` filled in. A value that changes the math and is not
        implemented is refused in one line (`layers.config.ConfigError`)."""

    @abc.abstractmethod
    def to_hf(self) -> dict[str, Any]:
        """The config.json that transformers' class for the config's model_type reads."""

    @staticmethod
    def own_fields(config: type[Any], raw: Mapping[str, Any]) -> dict[str, Any]:
        """The keys of a config.json that are `config`'s own fields: the rest carries nothing we build."""
        own = {f.name for f in dataclasses.fields(config)}
        return {k: v for k, v in raw.items() if k in own}

    # --- the checkpoint's keys -------------------------------------------------------------------------
    def prefix(self, unit: str) -> str:
        """The HF key prefix of a unit's tensors: 'embed' -> 'model.', 'block.3' -> 'model.layers.3.',
        'head' -> '' (lm_head is outside the body)."""
        if unit == "embed":
            return self.body
        if unit == "head":
            return ""
        return f"{self.body}{self.blocks}.{unit.split('.', 1)[1]}."

    def key(self, unit: str, local_key: str) -> str:
        """A unit module's own key as the HF checkpoint names it: ('head', 'norm.weight') -> 'model.norm.weight'."""
        if unit == "head" and local_key.startswith(self.final_norm + "."):
            return self.body + local_key
        return self.prefix(unit) + local_key

    def tied_keys(self) -> dict[str, str]:
        """HF keys of the borrowed parameters -> the HF key of the one tensor each is (a tied checkpoint holds
        only the latter)."""
        cfg = self.cfg
        return {self.key(unit, key): self.key(owner, owner_key)
                for unit in cfg.unit_names() for key, (owner, owner_key) in cfg.params().borrowed(unit).items()}

    def saved_name(self, key: str) -> str:
        """The name transformers saves the tensor its model names `key` under, where it saves it whole (Mixtral's
        router, 'mlp.gate.weight' in memory, is saved as 'block_sparse_moe.gate.weight')."""
        return key

    def saved_parts(self, key: str) -> list[list[str]] | None:
        """How transformers saves the tensor its model names `key`: None, as itself; else for each row of its
        first dimension (an expert) the names of the tensors that row is, concatenated along their first
        dimension. transformers 5 holds a mixture's experts fused ('mlp.experts.gate_up_proj', E x 2f x d) and
        saves them one expert and projection a tensor ('mlp.experts.3.gate_proj.weight'), as earlier versions
        held them."""
        return None

    def packed(self, key: str) -> tuple[str, str] | None:
        """The names of the MXFP4 blocks and scales a published checkpoint may hold the tensor `key` as (gpt-oss's
        experts), which the checkpoint reader dequantizes as transformers does; None: never packed."""
        return None
