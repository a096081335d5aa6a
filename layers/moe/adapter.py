"""How transformers names and saves a mixture's model (torch-free): Llama's checkpoint keys, its router under the
sparse MLP's module name, and its fused experts one expert and projection a tensor, as the checkpoints before
transformers 5 held them; each mixture's config.json read and written."""
from __future__ import annotations

from typing import Any, ClassVar

from layers.adapter import StateDictAdapter
from layers.config import ConfigError, take_aliases
from layers.llama.adapter import LlamaAdapter


def read_hf_experts(raw: dict[str, Any]) -> None:
    """What transformers' classes of a mixture compute and this one does not, refused in one line; the auxiliary
    loss's coefficient left out where transformers never reads it (no `output_router_logits`)."""
    if raw.get("router_jitter_noise"):
        raise ConfigError(f"router_jitter_noise={raw['router_jitter_noise']!r} is not supported (no noise on "
                          "the router's input); set it to 0.0")
    if not raw.get("output_router_logits"):
        raw.pop("router_aux_loss_coef", None)


class ExpertsAdapter(StateDictAdapter):
    """Llama's config.json and key map (a `LlamaAdapter`'s, composed), the saved MLP module's name (`saved_mlp`)
    and each expert's saved projections (gate and up, then down)."""

    body: ClassVar[str] = LlamaAdapter.body
    blocks: ClassVar[str] = LlamaAdapter.blocks
    final_norm: ClassVar[str] = LlamaAdapter.final_norm
    required: ClassVar[tuple[str, ...]] = LlamaAdapter.required

    # The name transformers' config.json gives the number of experts besides the family's own field's.
    experts_alias: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}
    saved_mlp: ClassVar[str] = "mlp"
    saved_projections: ClassVar[tuple[tuple[str, ...], tuple[str, ...]]] = (("gate_proj", "up_proj"), ("down_proj",))

    @classmethod
    def config_fields(cls, config: type[Any], raw: dict[str, Any]) -> dict[str, Any]:
        take_aliases(raw, cls.experts_alias)
        read_hf_experts(raw)
        return LlamaAdapter.config_fields(config, raw)

    def to_hf(self) -> dict[str, Any]:
        return LlamaAdapter(self.cfg).to_hf()

    def saved_name(self, key: str) -> str:
        return key.replace(".mlp.gate.", f".{self.saved_mlp}.gate.")

    def saved_parts(self, key: str) -> list[list[str]] | None:
        prefix, _, name = key.rpartition(".mlp.experts.")
        parts = dict(zip(("gate_up_proj", "down_proj"), self.saved_projections, strict=True)).get(name)
        if not prefix or parts is None:
            return None
        return [[f"{prefix}.{self.saved_mlp}.experts.{e}.{part}.weight" for part in parts]
                for e in range(self.cfg.sparse_mlp.num_experts)]


class Qwen3MoeAdapter(ExpertsAdapter):
    """transformers' class can make some layers dense (`decoder_sparse_step`, `mlp_only_layers`): published
    configs do not, and it is refused."""

    defaults: ClassVar[dict[str, Any]] = {"num_key_value_heads": 4, "max_position_embeddings": 32768,
                                          "intermediate_size": 6144, "sliding_window": 4096}

    @classmethod
    def config_fields(cls, config: type[Any], raw: dict[str, Any]) -> dict[str, Any]:
        step, dense = raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers") or []
        if step != 1 or dense:
            raise ConfigError(f"decoder_sparse_step={step!r} and mlp_only_layers={dense!r} make some layers dense; "
                              "only a sparse MLP in every layer is supported (decoder_sparse_step 1, "
                              "mlp_only_layers [])")
        # Its window slides on every layer whenever use_sliding_window: the class reads neither of Qwen2's
        # per-layer fields.
        raw = {k: v for k, v in raw.items() if k not in ("max_window_layers", "layer_types")}
        return super().config_fields(config, raw)

    def to_hf(self) -> dict[str, Any]:
        return {**super().to_hf(), "decoder_sparse_step": 1, "mlp_only_layers": []}


class MixtralAdapter(ExpertsAdapter):
    defaults: ClassVar[dict[str, Any]] = {"num_key_value_heads": 8, "max_position_embeddings": 131072,
                                          "sliding_window": None, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5}
    experts_alias: ClassVar[dict[str, str]] = {"num_experts": "num_local_experts"}
    saved_mlp: ClassVar[str] = "block_sparse_moe"
    saved_projections: ClassVar[tuple[tuple[str, ...], tuple[str, ...]]] = (("w1", "w3"), ("w2",))

    def to_hf(self) -> dict[str, Any]:
        return {**super().to_hf(), "router_jitter_noise": 0.0}


class OlmoeAdapter(ExpertsAdapter):
    defaults: ClassVar[dict[str, Any]] = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
    @classmethod
    def config_fields(cls, config: type[Any], raw: dict[str, Any]) -> dict[str, Any]:
        if raw.get("clip_qkv") is not None:
            raise ConfigError(f"clip_qkv={raw['clip_qkv']!r} is not supported (no clamping of q, k and v); set it "
                              "to null")
        return super().config_fields(config, raw)

    def to_hf(self) -> dict[str, Any]:
        return {**super().to_hf(), "clip_qkv": None}
