"""Deduplication: exact (hash of the normalised text) then near-duplicate (MinHash + LSH).

Near-duplicates: signatures are cut into `bands` bands of `rows` rows; two documents that agree on all
rows of any band are candidates. Candidates are confirmed by the fraction of agreeing signature entries
(an unbiased Jaccard estimate) reaching the threshold, joined with union-find into clusters, and each
cluster keeps its first document (input order), so the result does not depend on how work was split.

Given the texts, a candidate whose estimate lies within `confirm_margin` of the threshold (three standard
deviations of the estimate) is decided by the exact Jaccard similarity of the two documents' shingle sets
(minhash's 32-bit shingle hashes) instead: the estimate alone, with 128 permutations, sends pairs at true
similarity 0.7 over a 0.8 threshold, and each such false edge can join two clusters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from runyard.data.minhash import EMPTY, shingle_hashes


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


def confirm_margin(threshold: float, num_perm: int) -> float:
    """Three standard deviations of the signature agreement of a pair at Jaccard `threshold`."""
    return 3.0 * float(np.sqrt(threshold * (1.0 - threshold) / num_perm))


def exact_jaccard(pairs: np.ndarray, texts_of: Callable[[np.ndarray], Sequence[str]], ngram: int) -> np.ndarray:
    """Jaccard similarity of the shingle-hash sets of each pair's two documents; `texts_of(docs)` returns
    the texts of the sorted distinct documents `docs`. Vectorised: every pair's two sets are tagged with
    the pair's index, sorted together, and an intersection is a tag-and-hash repeated once."""
    if len(pairs) == 0:
        return np.zeros(0)
    docs, local = np.unique(pairs, return_inverse=True)
    local = local.reshape(pairs.shape)
    hashes, owner = shingle_hashes(list(texts_of(docs)), ngram)
    keys = np.sort((owner.astype(np.uint64) << np.uint64(32)) | hashes.astype(np.uint64))
    keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]  # np.unique's hash path is slower here
    first = np.searchsorted(keys >> np.uint64(32), np.arange(len(docs) + 1, dtype=np.uint64))
    size = np.diff(first)
    sa, sb = size[local[:, 0]], size[local[:, 1]]

    def gather(which: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        # The positions first[which[k]] .. + sizes[k] of every pair k, concatenated.
        offsets = np.repeat(first[which] - np.cumsum(sizes) + sizes, sizes)
        return keys[offsets + np.arange(int(sizes.sum()))] & np.uint64(0xFFFFFFFF)

    tag = np.arange(len(pairs), dtype=np.uint64) << np.uint64(32)
    both = np.concatenate([np.repeat(tag, sa) | gather(local[:, 0], sa), np.repeat(tag, sb) | gather(local[:, 1], sb)])
    both.sort()
    repeated = both[1:][both[1:] == both[:-1]] >> np.uint64(32)
    inter = np.bincount(repeated.astype(np.int64), minlength=len(pairs))
    union = sa + sb - inter
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def confirm(agree: np.ndarray, pairs: np.ndarray, threshold: float, num_perm: int,
            texts_of: Callable[[np.ndarray], Sequence[str]] | None, ngram: int) -> np.ndarray:
    """Which candidate pairs are near-duplicates: signature agreement reaching the threshold, or with
    `texts_of`, the exact similarity where the agreement is within `confirm_margin` of it."""
    ok = agree >= threshold
    if texts_of is None:
        return ok
    margin = confirm_margin(threshold, num_perm)
    close = np.flatnonzero(np.abs(agree - threshold) < margin)
    for lo in range(0, len(close), 4096):  # bounds the shingle sets held at once
        sel = close[lo : lo + 4096]
        ok[sel] = exact_jaccard(pairs[sel], texts_of, ngram) >= threshold
    return ok


@dataclass
class NearDupResult:
    duplicate: np.ndarray  # bool mask: removed as a near-duplicate of an earlier document
    clusters: list[list[int]]  # clusters of more than one document, largest first
    bands: int
    rows: int
    candidate_pairs: int


def near_duplicates(sigs: np.ndarray, threshold: float, bands: int | None = None,
                    texts: Sequence[str] | None = None, ngram: int = 5) -> NearDupResult:
    """Cluster documents whose Jaccard similarity reaches `threshold`; see the module doc. With `texts`
    (the documents the signatures were computed from, with word `ngram`-grams), pairs near the threshold
    are decided exactly."""
    if texts is not None and len(texts) != len(sigs):
        raise ValueError(f"near_duplicates: {len(texts)} texts for {len(sigs)} signatures; pass one text per signature")
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
        texts_of = None if texts is None else (lambda docs: [texts[i] for i in docs])
        for a, c in pairs[confirm(agree, pairs, threshold, num_perm, texts_of, ngram)]:
            uf.union(int(a), int(c))
    roots = np.array([uf.find(i) for i in range(n)], dtype=np.int64)
    duplicate = roots != np.arange(n)
    clusters: dict[int, list[int]] = {}
    for i in np.flatnonzero(duplicate):
        clusters.setdefault(int(roots[i]), [int(roots[i])]).append(int(i))
    ordered = sorted(clusters.values(), key=lambda c: (-len(c), c[0]))
    return NearDupResult(duplicate, ordered, b, r, len(pairs))
