"""The Llama family (llama, mistral, qwen2, qwen3): its configurations (config.py, torch-free) and its units
and resident model (units.py)."""
from layers.llama.config import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

__all__ = ["LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config"]
