"""Model families behind one registry (model/registry.py). The Llama-style decoder (model/decoder.py,
its math in model/transformer.py) is the first; importing runyard.model registers every family."""

from runyard.model import decoder
from runyard.model.registry import DEFAULT_FAMILY, ModelFamily, Sizing, family_names, get_family

__all__ = ["DEFAULT_FAMILY", "ModelFamily", "Sizing", "decoder", "family_names", "get_family"]
