"""A Llama-family block's LoRA targets (torch-free): attention's q, k, v and o, SwiGLU's gate, up and down; Gemma 3
and OLMo 2 have the same."""
from __future__ import annotations

from typing import ClassVar

from layers.targets import LoraTargets


class LlamaTargets(LoraTargets):
    projections: ClassVar[dict[str, str]] = {
        "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
        "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
        "down_proj": "mlp.down_proj"}

    def shape(self, name: str) -> tuple[int, int]:
        cfg = self.cfg
        d, q, f = cfg.hidden_size, cfg.attention_width, cfg.intermediate_size
        kv = cfg.num_key_value_heads * cfg.head_dim
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, f),
                "up_proj": (d, f), "down_proj": (f, d)}[name]
