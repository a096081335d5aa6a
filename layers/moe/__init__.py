"""The mixture-of-experts families (qwen3_moe, mixtral, olmoe): their configurations (config.py, torch-free) and
their units (units.py)."""
from layers.moe.config import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

__all__ = ["MixtralConfig", "OlmoeConfig", "Qwen3MoeConfig"]
