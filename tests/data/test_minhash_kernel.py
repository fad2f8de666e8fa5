"""The compiled MinHash kernel (numba, the `fast` extra) gives the numpy path's bits, a process switches
to it only after hashing enough text to pay for loading it, and the numpy path stays the one without
numba."""

from __future__ import annotations

import random

import numpy as np
import pytest

from runyard.data import minhash
from tests.data.test_minhash_pinned import pin_texts


def random_texts(n: int, seed: int) -> list[str]:
    """Texts built from separators, mixed case, digits, non-ASCII, newlines and empty strings."""
    rng = random.Random(seed)
    vocab = ["alpha", "Beta", "GAMMA", "d3lta", "épsilon", "日本語", "x_y", "42", "z", "ZZ"]
    seps = [" ", "  ", "\n", ", ", "...", "\t", "-", "!?"]
    out = []
    for _ in range(n):
        words = rng.randrange(0, 40)
        out.append("".join(rng.choice(vocab) + rng.choice(seps) for _ in range(words)))
    return out + ["", "!!!", "one", "\n\n", "a b c d"]


@pytest.mark.parametrize(("num_perm", "ngram", "seed"), [(64, 5, 7), (32, 3, 2), (128, 1, 1), (16, 7, 5)])
def test_kernel_matches_the_numpy_path(num_perm: int, ngram: int, seed: int):
    texts = pin_texts() + random_texts(300, seed)
    assert minhash._numba_kernel() is not None
    np.testing.assert_array_equal(minhash.signatures(texts, num_perm, ngram, seed, compiled=True),
                                  minhash.signatures_numpy(texts, num_perm, ngram, seed))


def test_kernel_batches_like_one_call(monkeypatch: pytest.MonkeyPatch):
    texts = random_texts(200, 11)
    whole = minhash.signatures(texts, 32, 5, 3, compiled=True)
    monkeypatch.setattr(minhash, "_BATCH_CHARS", 50)  # many byte buffers, one text larger than a batch
    np.testing.assert_array_equal(minhash.signatures(texts, 32, 5, 3, compiled=True), whole)


def test_without_numba_the_numpy_path_runs(monkeypatch: pytest.MonkeyPatch):
    texts = random_texts(50, 4)
    expected = minhash.signatures_numpy(texts, 32, 5, 1)
    monkeypatch.setattr(minhash, "_KERNEL", [None])
    np.testing.assert_array_equal(minhash.signatures(texts, 32, 5, 1, compiled=True), expected)


def test_a_process_switches_to_the_kernel_after_hashing_enough_text(monkeypatch: pytest.MonkeyPatch):
    texts = random_texts(50, 6)
    size = sum(map(len, texts))
    used = []
    monkeypatch.setattr(minhash, "_numba_kernel", lambda: used.append(minhash._hashed_chars) or None)
    monkeypatch.setattr(minhash, "_hashed_chars", 0)
    monkeypatch.setattr(minhash, "KERNEL_AFTER_CHARS", 2 * size)
    for _ in range(3):
        minhash.signatures(texts, 16, 5, 1)
    assert used == [3 * size]  # the first two calls (under the threshold) never asked for the kernel
    assert minhash.signatures(texts, 16, 5, 1, compiled=False) is not None and used == [3 * size]


def test_ngram_below_one_is_refused():
    with pytest.raises(ValueError, match="ngram"):
        minhash.signatures(["a b"], 8, 0, 1)
