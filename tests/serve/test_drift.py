"""Drift with thresholds that account for sample size, on real text: excerpts of the training kind
stay quiet, a switch to another kind of text alarms long before a 500-request window fills."""

from __future__ import annotations

import glob
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runyard.serve.drift import DriftMonitor, DriftReference, js_divergence, psi

STDLIB = sysconfig.get_paths()["stdlib"]
NOTES = Path(__file__).parents[2] / "examples" / "data" / "notes.jsonl"


@pytest.fixture(scope="module")
def corpus():
    """Training documents (stdlib email/ and json/ sources), held-out ones of the same kind, prose
    of another kind (the repo's notes), a tokenizer trained on the training documents, and the
    drift reference the export would carry."""
    files = sorted(glob.glob(f"{STDLIB}/email/*.py") + glob.glob(f"{STDLIB}/json/*.py"))
    docs = [Path(f).read_text(encoding="utf-8") for f in files]
    train = [d for i, d in enumerate(docs) if i % 4 != 3]
    held = [d for i, d in enumerate(docs) if i % 4 == 3]
    prose = [r["text"] for r in map(json.loads, NOTES.read_text().splitlines()) if len(r.get("text") or "") > 300]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(train, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    train_ids = [np.array(tok.encode(d).ids + [0]) for d in train]
    counts = np.bincount(np.concatenate(train_ids), minlength=tok.get_vocab_size())
    reference = DriftReference.from_documents(counts, train_ids, seed=1)
    return {"train": train, "held": held, "prose": prose, "tok": tok, "reference": reference}


def excerpts(docs: list[str], n: int, seed: int) -> list[str]:
    """n excerpts of 40-400 characters at random places of random documents."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        doc = docs[int(rng.integers(len(docs)))]
        size = int(rng.integers(40, 400))
        start = int(rng.integers(0, max(1, len(doc) - size)))
        out.append(doc[start : start + size])
    return out


def observe(monitor: DriftMonitor, tok: Tokenizer, texts: list[str]) -> None:
    for text in texts:
        monitor.observe(tok.encode(text).ids)


def test_divergences():
    a = np.array([10, 20, 30, 0])
    assert js_divergence(a, a) < 1e-9 and abs(psi(a, a)) < 1e-9
    assert js_divergence(np.array([100, 0]), np.array([0, 100])) > 0.99
    batch = js_divergence(a, np.stack([a, np.array([0, 0, 0, 5])]))
    assert batch.shape == (2,) and batch[0] < 1e-9 < batch[1]


@pytest.mark.parametrize("kind", ["train", "held"])
def test_twenty_excerpts_of_the_training_kind_do_not_alarm(corpus, kind):
    alarms = 0
    for trial in range(10):
        monitor = DriftMonitor(corpus["reference"], seed=trial)
        observe(monitor, corpus["tok"], excerpts(corpus[kind], 20, seed=100 + trial))
        report = monitor.report()
        assert report.windows and report.windows[0].requests == 20
        alarms += report.drifting
    assert alarms == 0
    # What a fixed threshold would have done: the raw divergence of 20 excerpts is large.
    assert report.windows[0].token_js > 0.05


def test_a_switch_to_another_kind_of_text_alarms_early(corpus):
    monitor = DriftMonitor(corpus["reference"], seed=0)
    observe(monitor, corpus["tok"], excerpts(corpus["held"], 500, seed=1))
    assert not monitor.report().drifting  # a full 500-request window of the training kind: quiet
    prose = excerpts(corpus["prose"], 100, seed=2)
    shifted = 0
    for text in prose:
        monitor.observe(corpus["tok"].encode(text).ids)
        shifted += 1
        if monitor.report().drifting:
            break
    assert monitor.report().drifting, "100 prose prompts after code never raised drift"
    assert shifted <= 25, f"drift seen only after {shifted} prose prompts"
    worst = monitor.report().worst
    assert worst.requests == 25 and worst.token_js > worst.token_js_threshold


def test_length_drift_against_the_first_requests(corpus):
    reference = corpus["reference"]
    monitor = DriftMonitor(reference, baseline=50, scales=(25, 100))
    rng = np.random.default_rng(0)
    vocab = len(reference.token_counts)
    for _ in range(60):
        monitor.observe(rng.integers(0, vocab, size=int(rng.integers(5, 15))).tolist())
    quiet = monitor.report()
    assert quiet.length_psi is not None and quiet.length_psi <= quiet.length_psi_threshold
    for _ in range(25):
        monitor.observe(rng.integers(0, vocab, size=600).tolist())
    loud = monitor.report()
    assert loud.length_psi > loud.length_psi_threshold and loud.drifting


def test_reference_round_trip_and_fallback(corpus, tmp_path):
    reference = corpus["reference"]
    reference.save(tmp_path)
    loaded = DriftReference.load(tmp_path)
    assert np.array_equal(loaded.token_counts, reference.token_counts)
    assert np.array_equal(loaded.null_counts, reference.null_counts)
    assert np.array_equal(loaded.chunks, reference.chunks)
    assert DriftReference.load(tmp_path / "absent") is None
    # Counts only (an older export): multinomial nulls, which still judge a clear shift.
    counts_only = DriftMonitor(DriftReference(reference.token_counts))
    observe(counts_only, corpus["tok"], excerpts(corpus["prose"], 30, seed=3))
    assert counts_only.report().drifting


def test_too_few_requests_reports_nothing(corpus):
    monitor = DriftMonitor(corpus["reference"], min_requests=5, scales=(10,))
    monitor.observe([1, 2, 3])
    report = monitor.report()
    assert report.windows == () and not report.drifting
    with pytest.raises(ValueError):
        DriftMonitor(corpus["reference"], min_requests=20, scales=(10,))
