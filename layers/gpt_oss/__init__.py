"""OpenAI's gpt-oss (gpt_oss): its configuration (config.py, torch-free) and its units and resident model
(units.py)."""
from layers.gpt_oss.config import GptOssConfig

__all__ = ["GptOssConfig"]
