"""Model families. `transformer` is the Llama-style decoder every stage trains."""

from runyard.model.config import ModelConfig
from runyard.model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]
