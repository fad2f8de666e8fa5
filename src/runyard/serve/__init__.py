"""Serving: export a trained model, load it back, and generate from it."""

from runyard.serve.engine import Generator
from runyard.serve.export import ExportError, export_model, load_export

__all__ = ["ExportError", "Generator", "export_model", "load_export"]
