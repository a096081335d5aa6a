"""gpt-oss's LoRA targets (torch-free): attention's projections alone. The experts' tensors, input dimension first
and with biases, are no PEFT-style targets here."""
from __future__ import annotations

from typing import ClassVar

from layers.llama.targets import LlamaTargets


class GptOssTargets(LlamaTargets):
    projections: ClassVar[dict[str, str]] = {
        "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
        "o_proj": "self_attn.o_proj"}
