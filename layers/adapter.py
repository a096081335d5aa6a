"""How transformers saves a family's tensors, torchtitan's state-dict adapter (torch-free): the names a checkpoint
holds each tensor under, the tensors it saves in parts or packed, and the keys a tied checkpoint leaves out.
`ModelConfig.adapter()` builds a family's from its config; the checkpoint reader and writer (streamer/io/hf.py)
and the resident model's strict loading read it. A unit's own key as the checkpoint names it is
`ModelConfig.hf_key`."""
from __future__ import annotations

from typing import Any


class StateDictAdapter:
    """A family that saves each tensor whole, under the name its transformers model gives it."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg  # the family's config, which imports this module: not imported here

    def tied_keys(self) -> dict[str, str]:
        """HF keys of the borrowed parameters -> the HF key of the one tensor each is (a tied checkpoint holds
        only the latter)."""
        cfg = self.cfg
        return {cfg.hf_key(unit, key): cfg.hf_key(owner, owner_key)
                for unit in cfg.unit_names() for key, (owner, owner_key) in cfg.borrowed(unit).items()}

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
