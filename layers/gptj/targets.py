"""GPT-J's LoRA targets (torch-free): its attention's four projections and its MLP's two."""
from __future__ import annotations

from typing import ClassVar

from layers.targets import LoraTargets


class GPTJTargets(LoraTargets):
    projections: ClassVar[dict[str, str]] = {
        "q_proj": "attn.q_proj", "k_proj": "attn.k_proj", "v_proj": "attn.v_proj", "out_proj": "attn.out_proj",
        "fc_in": "mlp.fc_in", "fc_out": "mlp.fc_out"}

    def shape(self, name: str) -> tuple[int, int]:
        d, f = self.cfg.n_embd, self.cfg.intermediate_size
        return {"fc_in": (d, f), "fc_out": (f, d)}.get(name, (d, d))
