"""The Phi-3 family (phi3: Phi-3, Phi-3.5, Phi-4): its configuration (config.py, torch-free) and its units and
resident model (units.py)."""
from layers.phi3.config import Phi3Config

__all__ = ["Phi3Config"]
