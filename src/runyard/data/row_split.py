"""Splitting rows (table rows or images) into train, validation and test, seeded from the spec.

Three ways, each recorded in the data report:
- keyed: a seeded hash of the key column's value decides, so every row of one key lands in one split;
- stratified (classification): each class's rows are shuffled and cut in the split's proportions, so
  every split keeps the class balance;
- random: all rows shuffled and cut.
`test_fraction` of the rows (data.heldout_fraction) form the test split, scored once at the end;
`validation_fraction` of the rest the validation split (early stopping, held-out loss and gates).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from runyard.errors import DataError

TRAIN, VALID, TEST = 0, 1, 2
SPLIT_NAMES = ("train", "validation", "test")


@dataclass(frozen=True)
class Split:
    assignment: np.ndarray  # per row: TRAIN, VALID or TEST
    method: str

    def rows(self, which: int) -> np.ndarray:
        return np.flatnonzero(self.assignment == which)

    def counts(self) -> dict[str, int]:
        return {name: int((self.assignment == i).sum()) for i, name in enumerate(SPLIT_NAMES)}


def _cut(n: int, test_fraction: float, validation_fraction: float) -> tuple[int, int]:
    """(test, validation) counts of n rows: each at least 1 when n allows, leaving train at least 1."""
    test = int(round(n * test_fraction))
    valid = int(round((n - test) * validation_fraction))
    if n >= 3:
        test, valid = max(test, 1), max(valid, 1)
    return test, valid


def keyed_split(keys: np.ndarray, seed: int, test_fraction: float, validation_fraction: float) -> Split:
    """Rows whose key values are equal share a split; the split of a key is a seeded hash of its text."""
    unique, inverse = np.unique(np.asarray([str(k) for k in keys], dtype=object), return_inverse=True)
    u = np.array([
        int.from_bytes(hashlib.blake2b(f"{seed}\0{k}".encode(), digest_size=8).digest(), "little") / 2**64
        for k in unique
    ])
    per_key = np.full(len(unique), TRAIN, dtype=np.int8)
    per_key[u < test_fraction] = TEST
    per_key[(u >= test_fraction) & (u < test_fraction + (1 - test_fraction) * validation_fraction)] = VALID
    if len(unique) >= 3:  # every split gets a key: the smallest hashes go to test, then validation
        order = np.argsort(u)
        if not (per_key == TEST).any():
            per_key[order[0]] = TEST
        if not (per_key == VALID).any():
            per_key[next(i for i in order if per_key[i] != TEST)] = VALID
        if not (per_key == TRAIN).any():
            per_key[order[-1]] = TRAIN
    method = f"keyed: blake2b-64(seed, key) / 2^64 decides each of {len(unique)} keys' split"
    return Split(per_key[inverse], method)


def stratified_split(labels: np.ndarray, seed: int, test_fraction: float, validation_fraction: float) -> Split:
    """Each class cut in the same proportions (a class of one or two rows stays in train)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    assignment = np.full(len(labels), TRAIN, dtype=np.int8)
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        test, valid = _cut(len(rows), test_fraction, validation_fraction)
        assignment[rows[:test]] = TEST
        assignment[rows[test:test + valid]] = VALID
    return Split(assignment, "stratified: each class shuffled (PCG64 from the seed) and cut in the split proportions")


def random_split(n: int, seed: int, test_fraction: float, validation_fraction: float) -> Split:
    rng = np.random.Generator(np.random.PCG64(seed))
    rows = rng.permutation(n)
    test, valid = _cut(n, test_fraction, validation_fraction)
    assignment = np.full(n, TRAIN, dtype=np.int8)
    assignment[rows[:test]] = TEST
    assignment[rows[test:test + valid]] = VALID
    return Split(assignment, "random: rows shuffled (PCG64 from the seed) and cut in the split proportions")


def check_split(split: Split, what: str) -> None:
    """Every split must hold rows; DataError naming the empty one and the counts."""
    counts = split.counts()
    empty = [name for name, n in counts.items() if n == 0]
    if empty:
        raise DataError(
            f"{what}: the {', '.join(empty)} split{'s are' if len(empty) > 1 else ' is'} empty ({counts}); "
            "add rows, or raise data.heldout_fraction / the validation_fraction"
        )
