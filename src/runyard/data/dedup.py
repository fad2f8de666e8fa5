"""Deduplication: exact (hash of the normalised text) then near-duplicate (MinHash + LSH).

Near-duplicates: signatures are cut into `bands` bands of `rows` rows; two documents that agree on all
rows of any band are candidates. Candidates are confirmed by the fraction of agreeing signature entries
(an unbiased Jaccard estimate) reaching the threshold, joined with union-find into clusters, and each
cluster keeps its first document (input order), so the result does not depend on how work was split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runyard.data.minhash import EMPTY


def optimal_bands(threshold: float, num_perm: int, fn_weight: float = 0.95) -> tuple[int, int]:
    """(bands, rows) with bands*rows <= num_perm minimising the weighted false positive and false
    negative probability mass around `threshold` (datasketch's rule). Missed pairs weigh more than
    extra candidates by default, because every candidate is confirmed against its signatures later."""
    xs = np.linspace(0.0, 1.0, 1001)
    best, best_err = (1, num_perm), float("inf")
    for b in range(1, num_perm + 1):
        r = num_perm // b
        if r == 0:
            break
        p = 1.0 - (1.0 - xs**r) ** b
        fp = np.trapezoid(np.where(xs < threshold, p, 0.0), xs)
        fn = np.trapezoid(np.where(xs >= threshold, 1.0 - p, 0.0), xs)
        err = (1 - fn_weight) * fp + fn_weight * fn
        if err < best_err:
            best, best_err = (b, r), err
    return best


class UnionFind:
    def __init__(self, n: int):
        self.parent = np.arange(n)

    def find(self, x: int) -> int:
        parent = self.parent
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return int(root)

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:  # the smaller index becomes the root: the kept document is the first one
            self.parent[max(ra, rb)] = min(ra, rb)


def exact_duplicates(hashes: list[bytes]) -> np.ndarray:
    """Boolean mask of documents whose hash appeared earlier."""
    seen: set[bytes] = set()
    dup = np.zeros(len(hashes), dtype=bool)
    for i, h in enumerate(hashes):
        if h in seen:
            dup[i] = True
        else:
            seen.add(h)
    return dup


def candidate_pairs(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """[k, 2] array of (first member, other member) for every LSH bucket with more than one document."""
    n = len(sigs)
    valid = ~(sigs == EMPTY).all(axis=1)
    idx = np.flatnonzero(valid)
    pairs = []
    for band in range(bands):
        block = np.ascontiguousarray(sigs[idx, band * rows : (band + 1) * rows])
        keys = block.view(np.dtype((np.void, block.dtype.itemsize * rows))).ravel()
        _, inverse = np.unique(keys, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        groups = inverse[order]
        is_first = np.concatenate([[True], groups[1:] != groups[:-1]])
        first_of = order[np.flatnonzero(is_first)][np.cumsum(is_first) - 1]
        members = ~is_first
        if members.any():
            pairs.append(np.stack([idx[first_of[members]], idx[order[members]]], axis=1))
    if not pairs or n == 0:
        return np.zeros((0, 2), dtype=np.int64)
    return np.unique(np.concatenate(pairs), axis=0)


@dataclass
class NearDupResult:
    duplicate: np.ndarray  # bool mask: removed as a near-duplicate of an earlier document
    clusters: list[list[int]]  # clusters of more than one document, largest first
    bands: int
    rows: int
    candidate_pairs: int


def near_duplicates(sigs: np.ndarray, threshold: float, bands: int | None = None) -> NearDupResult:
    """Cluster documents whose estimated Jaccard similarity reaches `threshold`; see the module doc."""
    n, num_perm = sigs.shape
    b, r = (bands, num_perm // bands) if bands else optimal_bands(threshold, num_perm)
    pairs = candidate_pairs(sigs, b, r)
    uf = UnionFind(n)
    if len(pairs):
        # Confirm candidates in blocks to bound memory: [block, num_perm] comparisons.
        agree = np.concatenate(
            [
                (sigs[pairs[i : i + 65536, 0]] == sigs[pairs[i : i + 65536, 1]]).mean(axis=1)
                for i in range(0, len(pairs), 65536)
            ]
        )
        for a, c in pairs[agree >= threshold]:
            uf.union(int(a), int(c))
    roots = np.array([uf.find(i) for i in range(n)], dtype=np.int64)
    duplicate = roots != np.arange(n)
    clusters: dict[int, list[int]] = {}
    for i in np.flatnonzero(duplicate):
        clusters.setdefault(int(roots[i]), [int(roots[i])]).append(int(i))
    ordered = sorted(clusters.values(), key=lambda c: (-len(c), c[0]))
    return NearDupResult(duplicate, ordered, b, r, len(pairs))
