"""The OLMo 2 family (olmo2): its configuration (config.py, torch-free) and its units and resident model
(units.py)."""
from layers.olmo2.config import Olmo2Config

__all__ = ["Olmo2Config"]
