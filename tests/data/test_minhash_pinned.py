"""MinHash signatures pinned to the values the first vectorised implementation produced.

Signatures are stored in cleaned parts and compared across runs and processes, so a faster
implementation must give the same bits: these digests were taken before the kernel was rewritten.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np

from runyard.data.minhash import shingle_hashes, signatures


def pin_texts() -> list[str]:
    """Short, empty, word-less, non-ASCII and mixed-case texts, one text longer than a broadcast block
    (20,000 words), and 300 small texts so blocks hold many documents."""
    rng = random.Random(3)
    long = " ".join(f"Tok{rng.randrange(3000)}" for _ in range(20_000))
    many = [" ".join(f"w{rng.randrange(500)}" for _ in range(rng.randrange(1, 60))) for _ in range(300)]
    return ["The quick brown fox jumps over the lazy dog", "two words", "", "!!! ...",
            "Ünïcödé wörds, MIXED case_words and digits 123 456", long] + many


def digest(*arrays: np.ndarray) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def test_signatures_match_the_pinned_values():
    sigs = signatures(pin_texts(), num_perm=64, ngram=5, seed=7)
    assert sigs[0, :4].tolist() == [1094077526, 730855426, 684449165, 1686485479]
    assert sigs[1, :2].tolist() == [3515294551, 3849595774]  # fewer words than the n-gram: one shingle
    assert sigs[5, :4].tolist() == [456884, 114563, 77272, 126710]
    assert digest(sigs) == "439ac435873febe5fa02d84cedf4695f0b05dc2d00e1faec91e976008e70068c"


def test_shingle_hashes_match_the_pinned_values():
    for ngram, count, expected in [
        (5, 28088, "e9499e60a123da68a47150d0bc705b59b44f83c0a65f292c04d997baddafb045"),
        (3, 28659, "fad33c511be774ddf03495c7f59d28a5075da3ae8f56f8590a39d32d1256b122"),
    ]:
        hashes, doc = shingle_hashes(pin_texts(), ngram)
        assert len(hashes) == count
        assert digest(hashes, doc.astype("<i8")) == expected, f"shingle hashes changed for ngram={ngram}"


def test_signatures_do_not_depend_on_batching():
    texts = pin_texts()
    whole = signatures(texts, num_perm=32, ngram=5, seed=2)
    one_by_one = np.concatenate([signatures([t], num_perm=32, ngram=5, seed=2) for t in texts])
    np.testing.assert_array_equal(whole, one_by_one)
