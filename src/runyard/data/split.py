"""Train/held-out split by document: a seeded hash of each document's normalised text decides, so a
document lands in the same split whatever the order or number of processes, and the same text can
never sit in both splits."""

from __future__ import annotations

import hashlib

import numpy as np

SPLIT_METHOD = "blake2b-64(seed, blake2b-128(text)) / 2^64 < heldout_fraction"


def split_key(seed: int, text_hash: bytes) -> int:
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + text_hash, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def heldout_mask(text_hashes: list[bytes], seed: int, fraction: float) -> np.ndarray:
    """True for held-out documents. With two or more documents each split gets at least one: the
    document with the smallest key goes held-out and the largest goes to train if a side is empty."""
    keys = np.array([split_key(seed, h) for h in text_hashes], dtype=np.uint64)
    mask = keys < np.uint64(int(fraction * 2**64))
    if len(keys) >= 2:
        if not mask.any():
            mask[int(np.argmin(keys))] = True
        if mask.all():
            mask[int(np.argmax(keys))] = False
    return mask
