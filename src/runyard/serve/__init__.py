"""Serving: load an export (runyard.model.hf.export) and serve it to many clients (OpenAI's API,
continuous batching, drift monitoring that can trigger retraining)."""
