"""Phi-3's LoRA targets (torch-free): its fused projections, q, k and v in one and the gate and up in one."""
from __future__ import annotations

from typing import ClassVar

from layers.targets import LoraTargets


class Phi3Targets(LoraTargets):
    projections: ClassVar[dict[str, str]] = {
        "qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj", "gate_up_proj": "mlp.gate_up_proj",
        "down_proj": "mlp.down_proj"}
    # PEFT has no default for phi3 (it asks for target_modules); its defaults for other fused-attention families
    # (gpt2's c_attn, falcon's query_key_value, codegen's qkv_proj) are the fused projection, q_proj,v_proj's place.
    defaults: ClassVar[tuple[str, ...]] = ("qkv_proj",)

    def shape(self, name: str) -> tuple[int, int]:
        cfg = self.cfg
        d, q, f = cfg.hidden_size, cfg.attention_width, cfg.intermediate_size
        kv = cfg.num_key_value_heads * cfg.head_dim
        return {"qkv_proj": (d, q + 2 * kv), "o_proj": (q, d), "gate_up_proj": (d, 2 * f), "down_proj": (f, d)}[name]
