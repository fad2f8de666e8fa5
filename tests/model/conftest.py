"""Fixtures of the model tests (the export's among them): the tiny tokenizer and small model of tests/model/small_model.py."""

from tests.model.small_model import make_model, tokenizer, tokenizer_path  # noqa: F401 (fixtures)
