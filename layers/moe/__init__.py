"""The mixture-of-experts families (qwen3_moe): their configurations (config.py, torch-free) and their units
(units.py)."""
from layers.moe.config import Qwen3MoeConfig

__all__ = ["Qwen3MoeConfig"]
