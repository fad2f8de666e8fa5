"""Serving: export a trained model, load it back, and serve it to many clients (OpenAI's API, continuous
batching, drift monitoring that can trigger retraining)."""

from runyard.serve.engine import Generator
from runyard.serve.export import ExportError, export_model, load_export

__all__ = ["ExportError", "Generator", "export_model", "load_export"]
