"""Held-out metrics: loss, perplexity, the train/held-out gap and a unigram baseline.

Both losses are measured on samples drawn across their whole split (`data.loader.eval_sample`), of the
same size, seeded from the spec: the gap is then a generalisation figure, not a comparison of the first
pages of each split. `coverage` records how many sequences, tokens and documents each sample covered.

The unigram baseline is the cross-entropy of a model that ignores context and predicts each token by
its frequency in the training split (add-one smoothed). A language model that does not beat it has
learned nothing about context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from runyard.data.loader import TokenLoader


@dataclass(frozen=True)
class HeldoutMetrics:
    heldout_loss: float
    heldout_perplexity: float
    train_loss: float
    gap: float  # held-out minus train loss: large means memorisation
    unigram_loss: float
    unigram_perplexity: float
    heldout_tokens: int
    # {"heldout": {...}, "train": {...}}: each sample's sequences, tokens, documents covered, seed.
    coverage: dict[str, dict[str, Any]] = field(default_factory=dict)


def train_token_counts(train_loader: TokenLoader, vocab_size: int, max_batches: int | None = None) -> np.ndarray:
    """Token frequencies over one epoch of the training split (or its first `max_batches` batches)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    n_batches = max(1, train_loader.num_sequences // train_loader.batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for _ in range(n_batches):
        _x, y = train_loader.next_batch()
        counts += np.bincount(y.numpy().ravel(), minlength=vocab_size)[:vocab_size]
    return counts


def unigram_loss(counts: np.ndarray, heldout_targets: list[torch.Tensor]) -> float:
    logp = np.log(counts + 1.0) - math.log(counts.sum() + len(counts))
    total, n = 0.0, 0
    for y in heldout_targets:
        ids = y.numpy().ravel()
        total -= float(logp[ids].sum())
        n += ids.size
    return total / max(n, 1)


def summarise(heldout_loss: float, train_loss: float, unigram: float, heldout_tokens: int,
              coverage: dict[str, dict[str, Any]] | None = None) -> HeldoutMetrics:
    return HeldoutMetrics(
        heldout_loss=heldout_loss,
        heldout_perplexity=math.exp(min(heldout_loss, 50.0)),
        train_loss=train_loss,
        gap=heldout_loss - train_loss,
        unigram_loss=unigram,
        unigram_perplexity=math.exp(min(unigram, 50.0)),
        heldout_tokens=heldout_tokens,
        coverage=coverage or {},
    )
