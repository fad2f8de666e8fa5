"""Exact and near-duplicate removal over a whole corpus of cleaned parts, in bounded memory.

The decisions are those of `dedup.py`'s in-memory functions (and tested equal to them): a document is
an exact duplicate when an earlier one has its hash; near-duplicates are documents that agree on all
rows of some LSH band, confirmed by the fraction of agreeing signature entries reaching the threshold,
joined into clusters, and each cluster keeps its first document. Only the way there changes: every
collection that grows with the corpus lives on disk, as sorted runs (spill.py), and is read in blocks.

- Exact: records `hash(16) | doc(8)` are sorted; a record whose hash equals the previous record's is a
  duplicate (the sort puts the earliest document of each hash first).
- Near, candidates: for every document still kept and every band, a record `band(2) | rows(4r) |
  doc(8)`; sorted, each run of equal `band | rows` is an LSH bucket, and every member but the first
  pairs with the first. The pairs `a(8) | b(8)` are sorted again, which drops repeats (the same pair
  found in several bands) and orders them by their first document.
- Near, confirmation: a block of pairs at a time, both signatures read from their parts; pairs whose
  agreement is within `dedup.confirm_margin` of the threshold are decided by their exact Jaccard
  similarity, both texts read from their parts, in sub-blocks of bounded text size.
- Near, clusters: connected components of the confirmed pairs by minimum-label propagation over the
  edges, streamed from disk each round; a component's label converges to its smallest document, so
  every other member is a duplicate. This keeps one integer per document that is in some confirmed
  pair (datatrove's cluster step likewise holds those documents): `budget.cluster_bytes` bounds it.

Documents are numbered globally (`starts[p]` is part p's first); removals are flags in a FlagFile.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from runyard.data.budget import MemoryBudget
from runyard.data.corpus import EXACT_DUP, NEAR_DUP, REMOVED, Corpus
from runyard.data.dedup import confirm_margin, exact_jaccard, optimal_bands
from runyard.data.errors import MemoryBudgetTooSmall
from runyard.data.minhash import EMPTY
from runyard.data.spill import FlagFile, SortedRuns, as_records, field
from runyard.spec.data import DedupSpec
from runyard.system.diskspace import writing

_NODE_BYTES = 8 + 8 + 8  # a node's document number, its label, and a scratch copy during a round


def _docs_per_block(budget: MemoryBudget, bytes_per_doc: int) -> int:
    return max(1024, budget.sort_block_bytes // (4 * max(1, bytes_per_doc)))


def exact_dedup(corpus: Corpus, work: Path, budget: MemoryBudget) -> int:
    """Flag exact duplicates (EXACT_DUP); returns how many."""
    runs = SortedRuns(work / "exact", 24, budget.sort_block_bytes, "exact")
    for p, lo, hi in corpus.blocks(_docs_per_block(budget, 24)):
        hashes = corpus.parts[p].exact(lo, hi)
        docs = np.arange(lo, hi, dtype=np.uint64) + np.uint64(corpus.starts[p])
        runs.add(as_records([hashes, docs]))
    dups = SortedRuns(work / "exact-dups", 8, budget.sort_block_bytes, "dups")
    previous: bytes | None = None
    for block in runs.merged():
        raw = block.view(np.uint8).reshape(len(block), block.dtype.itemsize)
        same = np.zeros(len(block), dtype=bool)
        same[1:] = (raw[1:, :16] == raw[:-1, :16]).all(axis=1)
        if previous is not None:
            same[0] = raw[0, :16].tobytes() == previous
        previous = raw[-1, :16].tobytes()
        dups.add(as_records([field(block[same], 16, "u8")]))
    runs.remove()
    removed = _flag_sorted(corpus.flags, dups, EXACT_DUP)
    shutil.rmtree(work / "exact", ignore_errors=True)
    shutil.rmtree(work / "exact-dups", ignore_errors=True)
    return removed


def _flag_sorted(flags: FlagFile, docs: SortedRuns, bit: int) -> int:
    n = 0
    for block in docs.merged():
        values = field(block, 0, "u8").astype(np.int64)
        flags.set(values, bit)
        n += len(values)
    docs.remove()
    return n


def near_dedup(corpus: Corpus, spec: DedupSpec, work: Path, budget: MemoryBudget) -> dict[str, Any]:
    """Flag near-duplicates (NEAR_DUP) among documents not already removed; returns the report's
    figures: removed, bands, rows, candidate_pairs, clusters and the largest clusters' members."""
    num_perm = spec.num_perm
    b, r = (spec.bands, num_perm // spec.bands) if spec.bands else optimal_bands(spec.threshold, num_perm)
    record = 2 + 4 * r + 8
    buckets = SortedRuns(work / "lsh", record, budget.sort_block_bytes, "lsh")
    for p, lo, hi in corpus.blocks(_docs_per_block(budget, b * record + 4 * num_perm)):
        part = corpus.parts[p]
        sigs = part.signatures(lo, hi)
        flags = corpus.flags.read(int(corpus.starts[p]) + lo, int(corpus.starts[p]) + hi)
        keep = ((flags & REMOVED) == 0) & ~(sigs == EMPTY).all(axis=1)
        idx = np.flatnonzero(keep)
        if len(idx) == 0:
            continue
        docs = idx.astype(np.uint64) + np.uint64(corpus.starts[p] + lo)
        for band in range(b):
            bands = np.full(len(idx), band, dtype=np.uint16)
            buckets.add(as_records([bands, sigs[idx, band * r : (band + 1) * r], docs]))
    pairs = SortedRuns(work / "pairs", 16, budget.sort_block_bytes, "pairs")
    _bucket_pairs(buckets, 2 + 4 * r, pairs)
    buckets.remove()
    edges_path = work / "edges.u64"
    candidates = _confirm(corpus, pairs, spec, edges_path, budget)
    pairs.remove()
    nodes, labels = _components(edges_path, budget)
    duplicate = labels != np.arange(len(nodes))
    corpus.flags.set(nodes[duplicate], NEAR_DUP)
    roots, sizes = np.unique(labels, return_counts=True)
    order = np.lexsort((nodes[roots], -sizes))[: spec.report_clusters]
    largest = []
    wanted: list[int] = []
    for root in roots[order]:
        members = nodes[labels == root][:6].tolist()  # sorted: the root (kept) first
        largest.append(members)
        wanted += members
    ids = corpus.ids_of(wanted)
    shutil.rmtree(work / "lsh", ignore_errors=True)
    shutil.rmtree(work / "pairs", ignore_errors=True)
    edges_path.unlink(missing_ok=True)
    return {
        "near_removed": int(duplicate.sum()),
        "bands": b,
        "rows": r,
        "candidate_pairs": candidates,
        "clusters": len(roots),
        "largest_clusters": [
            {"size": int(sizes[i]), "kept": ids[m[0]], "members": [ids[x] for x in m[1:6]]}
            for i, m in zip(order, largest, strict=True)
        ],
    }


def _bucket_pairs(buckets: SortedRuns, key_bytes: int, pairs: SortedRuns) -> None:
    """(first member, member) for every member but the first of every bucket of equal keys."""
    previous_key: bytes | None = None
    previous_first = 0
    for block in buckets.merged():
        raw = block.view(np.uint8).reshape(len(block), block.dtype.itemsize)
        docs = field(block, key_bytes, "u8")
        is_first = np.ones(len(block), dtype=bool)
        is_first[1:] = ~(raw[1:, :key_bytes] == raw[:-1, :key_bytes]).all(axis=1)
        carried = previous_key is not None and raw[0, :key_bytes].tobytes() == previous_key
        if carried:
            is_first[0] = False
        first_pos = np.maximum.accumulate(np.where(is_first, np.arange(len(block)), -1))
        first = np.where(first_pos >= 0, docs[np.maximum(first_pos, 0)], np.uint64(previous_first))
        members = ~is_first
        if members.any():
            pairs.add(as_records([first[members], docs[members]]))
        previous_key = raw[-1, :key_bytes].tobytes()
        previous_first = int(first[-1])


def _texts_of(corpus: Corpus, docs: np.ndarray) -> list[str]:
    """The texts of the given global documents, in their order."""
    where = corpus.locate(docs)
    return [corpus.parts[p].texts(d - int(corpus.starts[p]), d - int(corpus.starts[p]) + 1)[0]
            for p, d in zip(where.tolist(), np.asarray(docs).tolist(), strict=True)]


def _bytes_of(corpus: Corpus, docs: np.ndarray) -> np.ndarray:
    out = np.empty(len(docs), dtype=np.int64)
    where = corpus.locate(docs)
    for p in np.unique(where):
        sel = np.flatnonzero(where == p)
        local = docs[sel] - corpus.starts[p]
        out[sel] = [int(corpus.parts[p].nbytes(i, i + 1)[0]) for i in local.tolist()]
    return out


def _confirm(corpus: Corpus, pairs: SortedRuns, spec: DedupSpec, edges_path: Path,
             budget: MemoryBudget) -> int:
    """Write the confirmed candidate pairs (see the module doc) to `edges_path`; returns the number of
    distinct candidate pairs."""
    num_perm = corpus.parts[0].num_perm if corpus.parts else 1
    per_block = max(1024, budget.sort_block_bytes // (4 * 4 * num_perm))
    # Text, its shingle hashes and their sorted copies: about 8 bytes of work per byte of text.
    text_bytes = max(1 << 16, budget.sort_block_bytes // 8)
    margin = confirm_margin(spec.threshold, num_perm)
    candidates = 0
    previous: bytes | None = None
    pending: list[np.ndarray] = []
    pending_n = 0
    with open(edges_path, "wb") as edges:

        def confirm(block: np.ndarray) -> None:
            a, b = field(block, 0, "u8").astype(np.int64), field(block, 8, "u8").astype(np.int64)
            agree = (corpus.signature_rows(a) == corpus.signature_rows(b)).mean(axis=1)
            ok = agree >= spec.threshold
            close = np.flatnonzero(np.abs(agree - spec.threshold) < margin)
            if len(close):
                size = _bytes_of(corpus, a[close]) + _bytes_of(corpus, b[close])
                group = np.cumsum(size) // text_bytes  # sub-blocks of about text_bytes (a larger pair alone)
                for g in np.unique(group):
                    sel = close[group == g]
                    pair = np.stack([a[sel], b[sel]], axis=1)
                    ok[sel] = exact_jaccard(pair, lambda docs: _texts_of(corpus, docs), spec.ngram) >= spec.threshold
            with writing("near-duplicate pairs", edges_path.parent):
                edges.write(np.stack([a[ok], b[ok]], axis=1).astype("<u8").tobytes())

        for block in pairs.merged():
            raw = block.view(np.uint8).reshape(len(block), block.dtype.itemsize)
            new = np.ones(len(block), dtype=bool)
            new[1:] = ~(raw[1:] == raw[:-1]).all(axis=1)
            if previous is not None and raw[0].tobytes() == previous:
                new[0] = False
            previous = raw[-1].tobytes()
            unique = block[new]
            candidates += len(unique)
            pending.append(unique)
            pending_n += len(unique)
            while pending_n >= per_block:  # a merged block holds up to a sort block of pairs: confirm in slices
                gathered = np.concatenate(pending)
                confirm(gathered[:per_block])
                pending, pending_n = [gathered[per_block:]], len(gathered) - per_block
        if pending_n:
            confirm(np.concatenate(pending))
    return candidates


def _edge_blocks(path: Path, per_block: int) -> Iterator[np.ndarray]:
    with open(path, "rb") as f:
        while data := f.read(per_block * 16):
            yield np.frombuffer(data, dtype="<u8").reshape(-1, 2).astype(np.int64)


def _components(edges_path: Path, budget: MemoryBudget) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, labels): the documents in some confirmed pair, sorted, and for each the index (into
    nodes) of the smallest document of its connected component."""
    per_block = max(4096, budget.sort_block_bytes // 64)
    nodes = np.zeros(0, dtype=np.int64)
    for block in _edge_blocks(edges_path, per_block):
        nodes = np.union1d(nodes, block.ravel())
        if len(nodes) * _NODE_BYTES > budget.cluster_bytes:
            raise MemoryBudgetTooSmall(
                f"more than {len(nodes):,} documents are in near-duplicate pairs: their clusters need "
                f"{len(nodes) * _NODE_BYTES / 2**20:.0f} MiB, more than data.memory_limit leaves for them "
                f"({budget.cluster_bytes / 2**20:.0f} MiB). Raise data.memory_limit"
            )
    labels = np.arange(len(nodes), dtype=np.int64)
    changed = True
    while changed:
        changed = False
        for block in _edge_blocks(edges_path, per_block):
            ia, ib = np.searchsorted(nodes, block[:, 0]), np.searchsorted(nodes, block[:, 1])
            la, lb = labels[ia], labels[ib]
            low = np.minimum(la, lb)
            if (la != lb).any():
                changed = True
                np.minimum.at(labels, ia, low)
                np.minimum.at(labels, ib, low)
        while True:  # pointer jumping: a label's own label is in the same component and no larger
            jumped = labels[labels]
            if np.array_equal(jumped, labels):
                break
            labels = jumped
    return nodes, labels
