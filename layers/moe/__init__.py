"""The mixture-of-experts families (qwen3_moe, mixtral): their configurations (config.py, torch-free) and their units
(units.py)."""
from layers.moe.config import MixtralConfig, Qwen3MoeConfig

__all__ = ["MixtralConfig", "Qwen3MoeConfig"]
