"""A tiny byte-level BPE tokenizer and a small model, built here so the export and serve tests need no data
stage: fixtures that tests/model/conftest.py and tests/serve/conftest.py bring into their folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runyard.model.transformer import ModelConfig, Transformer

torch.set_num_threads(1)

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\n\nclass Thing:\n    pass\n",
    "for i in range(10):\n    print(i)  # café ✓\n",
] * 20


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_path))


def _make_model(
    tokenizer: Tokenizer, tie: bool = True, seed: int = 0, context_length: int = 64
) -> Transformer:
    cfg = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=64,
        context_length=context_length,
        tie_embeddings=tie,
    )
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


@pytest.fixture()
def make_model():
    """Factory: make_model(tokenizer, tie=True, seed=0, context_length=64) -> a small seeded model."""
    return _make_model
