"""How gpt-oss's tensors are saved (torch-free): its experts fused, as transformers holds them; the published files
hold them MXFP4-packed."""
from __future__ import annotations

from layers.adapter import StateDictAdapter


class GptOssAdapter(StateDictAdapter):
    """Every tensor whole under its own name; the experts' may be packed."""

    def packed(self, key: str) -> tuple[str, str] | None:
        prefix, _, name = key.rpartition(".mlp.experts.")
        if not prefix or name not in ("gate_up_proj", "down_proj"):
            return None
        return f"{key}_blocks", f"{key}_scales"
