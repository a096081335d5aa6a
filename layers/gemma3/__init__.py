"""Gemma 3's text decoder (gemma3_text): its configuration (config.py, torch-free) and its units and resident
model (units.py)."""
from layers.gemma3.config import Gemma3TextConfig

__all__ = ["Gemma3TextConfig"]
