"""A family's attention by layer, a facet of its config (torch-free): each block's kind of attention, as
transformers' `layer_types` names it, and per kind its window and what sets its RoPE tables; the longest sequence
the model attends over; where longrope's tables change. `ModelConfig.attention()` builds a family's (the config
names its class, `attention_class`; this one, full causal attention on every block, where it names none). A
block's module is built for its kind (`layers.model.FamilyUnits.block`), and the planner prices each kind's mask
and tables (memory_model.shapes)."""
from __future__ import annotations

from typing import Any


class AttentionLayout:
    """Full causal attention on every block, over `max_position_embeddings`, with one RoPE table."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg  # the family's config, which imports this module: not imported here

    def layer_types(self) -> tuple[str, ...]:
        """Each block's attention, by transformers' names: 'full_attention' (causal over the whole sequence) or
        'sliding_attention' (each query sees its `sliding_window` latest keys)."""
        return ("full_attention",) * self.cfg.num_hidden_layers

    def window(self, layer_type: str) -> int | None:
        """The keys a query of a block of `layer_type` sees at most, itself included (a sliding window); None:
        every key before it."""
        return None

    def rotary_table(self, layer_type: str) -> Any:
        """What sets a block's RoPE tables (hashable): blocks whose values are equal share one cached table."""
        return None

    def context(self) -> tuple[int, str]:
        """The longest sequence this model attends over, and the config field that sets it (for messages)."""
        cfg = self.cfg
        return cfg.max_position_embeddings, f"max_position_embeddings={cfg.max_position_embeddings}"

    def regime_change(self) -> int | None:
        """The sequence length past which every position's rotary sin and cos change (longrope's
        original_max_position_embeddings), so that a KV cache filled before it is stale; None: they never do."""
        return None


class SlidingLayers(AttentionLayout):
    """Sliding-window and full blocks, as the config's `attention_layers` (transformers' `layer_types`) names
    them, the window its `sliding_window`."""

    def layer_types(self) -> tuple[str, ...]:
        return self.cfg.attention_layers

    def window(self, layer_type: str) -> int | None:
        return self.cfg.sliding_window if layer_type == "sliding_attention" else None
