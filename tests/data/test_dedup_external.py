"""Deduplication over parts on disk, by sorted runs, decides exactly what the in-memory functions decide
(dedup.py), with memory budgets small enough that every collection spills into many runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runyard.data.budget import PROCESS_BASE, MemoryBudget
from runyard.data.corpus import EXACT_DUP, NEAR_DUP, REMOVED, Corpus
from runyard.data.dedup import exact_duplicates, near_duplicates
from runyard.data.dedup_external import exact_dedup, near_dedup
from runyard.data.minhash import signatures
from runyard.data.partstore import PartWriter
from runyard.data.spill import FlagFile, SortedRuns, as_records, field
from runyard.spec.data import DedupSpec

NUM_PERM = 32


def tiny_budget() -> MemoryBudget:
    """A main process with 1 MiB to work in: sorted runs of 128 KiB."""
    budget = MemoryBudget(2 * PROCESS_BASE + (1 << 20), 1)
    assert budget.sort_block_bytes == 128 << 10
    return budget


def test_sorted_runs_merge_many_runs_into_one_order(tmp_path: Path):
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 300, size=50_000).astype(np.uint64)  # many equal keys across runs
    docs = rng.permutation(50_000).astype(np.uint64)
    runs = SortedRuns(tmp_path, 16, 16 * 300, "t")  # 300 records a run: ~170 runs, merged in generations
    for lo in range(0, len(keys), 777):
        runs.add(as_records([keys[lo : lo + 777], docs[lo : lo + 777]]))
    blocks = list(runs.merged())
    assert len(blocks) > 10  # streamed in bounded blocks, not one array
    out = np.concatenate(blocks)
    order = np.lexsort((docs, keys))
    np.testing.assert_array_equal(field(out, 0, "u8"), keys[order])
    np.testing.assert_array_equal(field(out, 8, "u8"), docs[order])


def test_flag_file_sets_bits_by_window(tmp_path: Path):
    flags = FlagFile(tmp_path / "f", 100_000)
    flags.set(np.array([0, 5, 4095, 4096, 99_999]), 2, window=4096)
    flags.set(np.array([5, 70_000]), 1, window=4096)
    got = flags.read(0, 100_000)
    want = np.zeros(100_000, np.uint8)
    want[[0, 5, 4095, 4096, 99_999]] |= 2
    want[[5, 70_000]] |= 1
    np.testing.assert_array_equal(got, want)


def planted_corpus(root: Path, n: int = 6000, parts: int = 5, seed: int = 0):
    """Parts of 60-word documents with their real signatures, planted exact duplicates (same text and
    hash), near-duplicates (a copy of another with 1-3 words replaced: Jaccard about 0.84, 0.70, 0.60,
    so some on each side of 0.8 and most within the exact check's margin), far copies (half the words
    replaced) and documents without words (all EMPTY)."""
    rng = np.random.default_rng(seed)
    words = [[f"w{int(x)}" for x in rng.integers(0, 5000, size=60)] for _ in range(n)]
    hashes = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    for i in rng.choice(np.arange(100, n), size=n // 5, replace=False):
        src = int(rng.integers(0, i))
        kind = rng.random()
        if kind < 0.25:
            hashes[i] = hashes[src]
            words[i] = list(words[src])
        elif kind < 0.95:
            words[i] = list(words[src])
            k = int(rng.integers(1, 4)) if kind < 0.85 else 30
            for j in rng.choice(len(words[i]), size=min(k, len(words[i])), replace=False):
                words[i][j] = f"new{int(rng.integers(10**9))}"
        else:
            words[i] = ["!!!"]
    texts = [" ".join(w) for w in words]
    sigs = signatures(texts, num_perm=NUM_PERM, ngram=5, seed=1)
    bounds = np.linspace(0, n, parts + 1).astype(int)
    dirs = []
    for p in range(parts):
        lo, hi = bounds[p], bounds[p + 1]
        d = root / f"part{p}"
        w = PartWriter(d, NUM_PERM)
        raw = [t.encode() for t in texts[lo:hi]]
        w.add([f"id-{i}" for i in range(lo, hi)], raw, np.array([len(t) for t in raw]),
              [hashes[i].tobytes() for i in range(lo, hi)], sigs[lo:hi])
        w.commit({"files": []})
        dirs.append(d)
    return dirs, sigs, hashes, texts


@pytest.mark.parametrize("bands", [None, 4])
def test_external_dedup_decides_as_the_in_memory_functions(tmp_path: Path, bands):
    dirs, sigs, hashes, texts = planted_corpus(tmp_path / "parts")
    corpus = Corpus.open(dirs, tmp_path / "flags")
    spec = DedupSpec(num_perm=NUM_PERM, threshold=0.8, bands=bands)
    budget = tiny_budget()

    exact_removed = exact_dedup(corpus, tmp_path / "work", budget)
    figures = near_dedup(corpus, spec, tmp_path / "work", budget)

    want_exact = exact_duplicates([h.tobytes() for h in hashes])
    kept_idx = np.flatnonzero(~want_exact)
    want_near = near_duplicates(sigs[kept_idx], spec.threshold, bands, texts=[texts[i] for i in kept_idx])
    flags = corpus.flags.read(0, corpus.n_docs)
    np.testing.assert_array_equal((flags & EXACT_DUP) != 0, want_exact)
    want_near_mask = np.zeros(len(sigs), dtype=bool)
    want_near_mask[kept_idx[want_near.duplicate]] = True
    np.testing.assert_array_equal((flags & NEAR_DUP) != 0, want_near_mask)
    assert exact_removed == want_exact.sum() > 100
    assert figures["near_removed"] == want_near.duplicate.sum() > 100
    assert (figures["bands"], figures["rows"]) == (want_near.bands, want_near.rows)
    assert figures["candidate_pairs"] == want_near.candidate_pairs
    assert figures["clusters"] == len(want_near.clusters)
    want_largest = [
        {"size": len(c), "kept": f"id-{kept_idx[c[0]]}", "members": [f"id-{kept_idx[i]}" for i in c[1:6]]}
        for c in want_near.clusters[:10]
    ]
    assert figures["largest_clusters"] == want_largest
    assert ((flags & REMOVED) == 0).sum() == len(sigs) - exact_removed - figures["near_removed"]
    assert not any((tmp_path / "work").rglob("*.bin")), "spilled runs are removed once used"


def test_near_duplicate_clusters_need_memory_for_their_documents(tmp_path: Path):
    dirs, _, _, _ = planted_corpus(tmp_path / "parts", n=3000)
    corpus = Corpus.open(dirs, tmp_path / "flags")
    starved = MemoryBudget(2 * PROCESS_BASE + 4096, 1)  # 2 KiB for the cluster graph
    with pytest.raises(Exception, match="near-duplicate pairs.*data.memory_limit"):
        near_dedup(corpus, DedupSpec(num_perm=NUM_PERM), tmp_path / "work", starved)
