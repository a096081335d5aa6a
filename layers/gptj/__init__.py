"""GPT-J: its configuration (config.py, torch-free) and its units and resident model (units.py)."""
from layers.gptj.config import GPTJConfig

__all__ = ["GPTJConfig"]
