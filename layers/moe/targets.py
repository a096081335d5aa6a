"""A mixture's LoRA targets (torch-free): attention's projections and the experts' fused tensors (E, out, in),
which PEFT targets as parameters (`target_parameters`, matched by the end of their names): each expert e gets its
own pair, W_e + scaling x B_e A_e. The router is transformers' own module, not a Linear, and no target."""
from __future__ import annotations

from typing import ClassVar

from layers.llama.targets import LlamaTargets
from layers.targets import LoraKeys


class ExpertsTargets(LlamaTargets):
    projections: ClassVar[dict[str, str]] = {
        "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
        "o_proj": "self_attn.o_proj", "experts.gate_up_proj": "mlp.experts.gate_up_proj",
        "experts.down_proj": "mlp.experts.down_proj"}
    parameters: ClassVar[tuple[str, ...]] = ("experts.gate_up_proj", "experts.down_proj")

    def shape(self, name: str) -> tuple[int, int]:
        d, f = self.cfg.hidden_size, self.cfg.sparse_mlp.width
        experts = {"experts.gate_up_proj": (d, 2 * f), "experts.down_proj": (f, d)}
        return experts[name] if name in experts else super().shape(name)

    def experts(self, target: str) -> tuple[int, int]:
        mlp = self.cfg.sparse_mlp
        return (mlp.num_experts, mlp.num_experts_per_tok) if target in self.parameters else (1, 1)

    def keys(self, target: str, targets: tuple[str, ...]) -> LoraKeys:
        """An expert tensor's adapters are the experts module's `lora_A.<name>` (r E x in) and `lora_B.<name>`
        (out x r E), PEFT's ParamWrapper's layout. PEFT wraps the experts module once per tensor targeted, in the
        module's order, each wrapper around the previous: an earlier tensor's adapters lie one `base_layer`
        deeper for each later one targeted."""
        if target not in self.parameters:
            return super().keys(target, targets)
        key = self.projections[target]
        module, _, name = key.rpartition(".")
        later = self.parameters[self.parameters.index(target) + 1:]
        peft = f"{module}." + "base_layer." * sum(t in targets for t in later)
        return LoraKeys(key, f"{module}.lora_A.{name}", f"{module}.lora_B.{name}", f"{peft}lora_A.weight",
                        f"{peft}lora_B.weight")
