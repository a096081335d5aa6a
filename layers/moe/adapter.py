"""How transformers saves a mixture's tensors (torch-free): its router under the sparse MLP's module name, and its
fused experts one expert and projection a tensor, as the checkpoints before transformers 5 held them."""
from __future__ import annotations

from layers.adapter import StateDictAdapter


class ExpertsAdapter(StateDictAdapter):
    """The config names the saved MLP module (`saved_mlp`) and each expert's projections (`saved_projections`)."""

    def saved_name(self, key: str) -> str:
        return key.replace(".mlp.gate.", f".{self.cfg.saved_mlp}.gate.")

    def saved_parts(self, key: str) -> list[list[str]] | None:
        prefix, _, name = key.rpartition(".mlp.experts.")
        parts = dict(zip(("gate_up_proj", "down_proj"), self.cfg.saved_projections, strict=True)).get(name)
        if not prefix or parts is None:
            return None
        return [[f"{prefix}.{self.cfg.saved_mlp}.experts.{e}.{part}.weight" for part in parts]
                for e in range(self.cfg.num_experts)]
