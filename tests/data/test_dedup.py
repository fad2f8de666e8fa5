"""Exact and near-duplicate removal on corpora with planted duplicates: precision and recall."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from runyard.data.dedup import (
    candidate_pairs,
    confirm_margin,
    exact_duplicates,
    exact_jaccard,
    near_duplicates,
    optimal_bands,
)
from runyard.data.minhash import EMPTY, signatures
from runyard.data.pipeline import prepare_data
from tests.data.data_fixtures import spec_for, write_corpus


def base_docs(n: int, words: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [[f"w{rng.randrange(50_000)}" for _ in range(words)] for _ in range(n)]


def edit(words: list[str], rate: float, rng: random.Random) -> list[str]:
    """Replace a `rate` fraction of the words (chosen at random) by fresh ones."""
    out = list(words)
    for i in rng.sample(range(len(out)), int(round(rate * len(out)))):
        out[i] = f"new{rng.randrange(10**9)}"
    return out


def jaccard(a: list[str], b: list[str], n: int = 5) -> float:
    sa = {tuple(a[i : i + n]) for i in range(len(a) - n + 1)}
    sb = {tuple(b[i : i + n]) for i in range(len(b) - n + 1)}
    return len(sa & sb) / len(sa | sb)


def test_signature_agreement_estimates_jaccard():
    rng = random.Random(0)
    base = base_docs(20, 400, seed=1)
    pairs = [(b, edit(b, rate, rng)) for b in base for rate in (0.01, 0.05, 0.2)]
    texts = [" ".join(w) for pair in pairs for w in pair]
    sigs = signatures(texts, num_perm=256, ngram=5, seed=1)
    errors = [abs((sigs[2 * i] == sigs[2 * i + 1]).mean() - jaccard(a, b)) for i, (a, b) in enumerate(pairs)]
    assert np.mean(errors) < 0.04
    # Deterministic across calls and independent of batching.
    np.testing.assert_array_equal(sigs[:6], signatures(texts[:6], num_perm=256, ngram=5, seed=1))
    assert (signatures(["", "   !!! "], 64)[0] == EMPTY).all()


def test_near_duplicates_precision_and_recall():
    rng = random.Random(7)
    originals = base_docs(150, 300, seed=2)
    docs, planted = [" ".join(w) for w in originals], set()
    for i in range(60):  # 60 planted near-duplicates at 1-2 % word edits (true Jaccard about 0.82-0.91)
        words = edit(originals[i], rng.choice([0.01, 0.015, 0.02]), rng)
        planted.add(len(docs))
        docs.append(" ".join(words))
    for i in range(60, 90):  # 30 loose relatives at 30 % edits (Jaccard about 0.1): must be kept
        docs.append(" ".join(edit(originals[i], 0.3, rng)))
    order = list(range(len(docs)))
    rng.shuffle(order)
    # Shuffle so duplicates come before their originals sometimes; truth is "one per planted pair".
    docs = [docs[i] for i in order]
    truth_pairs = {
        frozenset((order.index(p), order.index(p_orig)))
        for p, p_orig in zip(sorted(planted), range(60), strict=True)
    }
    result = near_duplicates(signatures(docs, 128, 5, seed=1), threshold=0.7)
    removed = set(np.flatnonzero(result.duplicate).tolist())
    removed_pairs = {frozenset((i, c[0])) for c in result.clusters for i in c[1:]}
    tp = len(removed_pairs & truth_pairs)
    precision = tp / max(1, len(removed_pairs))
    recall = tp / len(truth_pairs)
    print(f"near-dup precision {precision:.3f} recall {recall:.3f}")
    assert precision >= 0.95 and recall >= 0.95
    assert len(removed) == len(removed_pairs)
    assert max(len(c) for c in result.clusters) == 2


def test_exact_jaccard_equals_set_arithmetic():
    rng = random.Random(4)
    texts = [" ".join(f"W{rng.randrange(30)}" for _ in range(rng.randrange(0, 40))) for _ in range(50)]
    pairs = np.array([(rng.randrange(50), rng.randrange(50)) for _ in range(400)])
    got = exact_jaccard(pairs, lambda docs: [texts[i] for i in docs], ngram=3)

    def shingles(t: str) -> set:
        w = t.lower().split()
        return {tuple(w[i : i + 3]) for i in range(max(1, len(w) - 2))} if w else set()

    for (a, b), j in zip(pairs.tolist(), got.tolist(), strict=True):
        sa, sb = shingles(texts[a]), shingles(texts[b])
        assert j == (len(sa & sb) / len(sa | sb) if sa | sb else 1.0), (a, b)


def test_near_duplicates_with_texts_decide_close_pairs_exactly():
    """With 32 permutations the estimate errs by about 0.07 at Jaccard 0.8: pairs planted at 1-3 word
    edits of 60 land on both sides of the threshold, and the estimate puts some on the wrong side."""
    rng = random.Random(11)
    originals = base_docs(120, 60, seed=5)
    docs = [" ".join(w) for w in originals]
    for i in range(120):
        docs.append(" ".join(edit(originals[i], rng.choice([1, 2, 3]) / 60, rng)))
    words = [d.split() for d in docs]
    sigs = signatures(docs, num_perm=32, ngram=5, seed=1)
    estimate_only = near_duplicates(sigs, 0.8)
    exact = near_duplicates(sigs, 0.8, texts=docs, ngram=5)
    assert (exact.bands, exact.rows, exact.candidate_pairs) == (estimate_only.bands, estimate_only.rows,
                                                                 estimate_only.candidate_pairs)
    margin = confirm_margin(0.8, 32)
    wrong_estimates = 0
    removed = {frozenset((i, c[0])) for c in exact.clusters for i in c[1:]}
    for a, b in candidate_pairs(sigs, exact.bands, exact.rows).tolist():
        agree = (sigs[a] == sigs[b]).mean()
        true = jaccard(words[a], words[b])
        wrong_estimates += (agree >= 0.8) != (true >= 0.8)
        if abs(agree - 0.8) < margin:  # decided by the exact similarity
            assert (frozenset((a, b)) in removed) == (true >= 0.8), (a, b, agree, true)
    assert wrong_estimates >= 5, "the planted pairs should put some estimates on the wrong side"
    assert (exact.duplicate != estimate_only.duplicate).sum() >= 5


def test_near_duplicates_need_one_text_per_signature():
    sigs = signatures(["a b c d e f", "a b c d e g"], num_perm=16)
    with pytest.raises(ValueError, match="1 texts for 2 signatures"):
        near_duplicates(sigs, 0.8, texts=["a b c d e f"])


def test_exact_duplicates_keep_the_first():
    assert exact_duplicates([b"a", b"b", b"a", b"c", b"b"]).tolist() == [False, False, True, False, True]


def test_optimal_bands_match_threshold():
    b, r = optimal_bands(0.8, 128)
    assert b * r <= 128 and 0.6 < (1 / b) ** (1 / r) < 0.9  # the LSH S-curve's midpoint sits near 0.8


def test_pipeline_removes_planted_duplicates_and_reports_clusters(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=30, words=(300, 400))
    text = (corpus / "doc_0003.txt").read_text()
    (corpus / "copy_exact.txt").write_text(text)
    (corpus / "copy_exact_crlf.txt").write_text(text.replace("\n", "\r\n"))  # equal after normalisation
    lines = text.split("\n")
    lines[5] = lines[5] + " extra"
    (corpus / "copy_near.txt").write_text("\n".join(lines))
    prepared = prepare_data(
        spec_for(str(corpus / "*.txt")),
        seed=0,
        report_dir=tmp_path / "rep",
        cache_dir=tmp_path / "c",
        progress=False,
    )
    d = prepared.stats["dedup"]
    assert d["exact_removed"] == 2 and d["near_removed"] == 1
    assert d["largest_clusters"][0]["size"] == 2
    steps = [s["step"] for s in prepared.stats["steps"]]
    assert steps == ["read", "filter", "exact_dedup", "near_dedup"]
    assert prepared.stats["steps"][-1]["documents"] == 30
    assert "cluster of 2" in (tmp_path / "rep" / "report.md").read_text()
