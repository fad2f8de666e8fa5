"""Model families behind one registry (model/registry.py). The Llama-style decoder (model/decoder.py,
its math in model/transformer.py) and the image CNN (model/cnn.py) are registered when runyard.model is
imported; the tabular families (LightGBM trees, model/trees.py; the linear model, model/linear.py) need the
optional extra runyard[predict] and are registered lazily: imported the first time they are asked for."""

from runyard.model import cnn, decoder
from runyard.model.registry import (
    DEFAULT_FAMILY,
    ModelFamily,
    Sizing,
    family_names,
    get_family,
    register_lazy,
)

register_lazy("lightgbm", "runyard.model.trees", extra="predict")
register_lazy("linear", "runyard.model.linear", extra="predict")

__all__ = ["DEFAULT_FAMILY", "ModelFamily", "Sizing", "cnn", "decoder", "family_names", "get_family"]
