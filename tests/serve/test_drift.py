"""Language drift at a stated false-alarm rate, on real text: request-shaped windows of held-out text of
the training kind (excerpts, short prompts, repeated prompts, chat turns) alarm in at most the stated
share of judgements, measured over 500 windows per window size; a switch to another kind of text (prose
instead of code, German instead of Python) alarms within a bounded number of requests; a report names
what moved."""

from __future__ import annotations

import glob
import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runyard.serve.drift import DriftMonitor, DriftReference, js_divergence, psi, token_contributions

STDLIB = sysconfig.get_paths()["stdlib"]
NOTES = Path(__file__).parents[2] / "examples" / "data" / "notes.jsonl"
RATE = 0.01
GERMAN = [
    "Der Bericht beschreibt, wie die Daten vor dem Training gereinigt und in Abschnitte geteilt werden.",
    "Wenn der Server zu viele Anfragen erhält, wartet jede weitere Anfrage in einer Warteschlange.",
    "Die Ergebnisse der Auswertung stehen in einer Datei neben dem Modell und werden täglich geprüft.",
    "Bitte schreiben Sie eine kurze Zusammenfassung des Textes in drei Sätzen für die Kollegen.",
    "Im Winter fahren wir oft in die Berge, weil die Luft dort klarer ist als in der Stadt.",
    "Das Wetter war gestern so schlecht, dass der Zug über eine Stunde Verspätung hatte.",
    "Unsere Bibliothek öffnet morgens um acht Uhr und schließt erst spät am Abend.",
    "Kannst du mir erklären, warum die Rechnung höher ist als im letzten Monat?",
    "Die Kinder spielen im Garten, während die Großeltern Kaffee trinken und Kuchen essen.",
    "Ein guter Lehrer erklärt schwierige Dinge mit einfachen Worten und viel Geduld.",
]
CHAT_PREFIX, CHAT_SUFFIX = [0, 0, 5, 0], [0, 7, 0]  # framing ids a template wraps around a turn


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
    return {"train": train, "held": held, "prose": prose, "tok": tok, "reference": reference,
            "held_ids": [tok.encode(d).ids for d in held]}


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


def request_shaped(held_ids: list[list[int]], n: int, rng: np.random.Generator) -> list[list[int]]:
    """n prompts of held-out training-kind text shaped like requests: a quarter each of excerpts (20-120
    tokens), short prompts (2-12 tokens), chat turns (an excerpt inside template framing), and prompts
    the window repeats (a few distinct ones sent several times)."""
    def cut(lo: int, hi: int) -> list[int]:
        doc = held_ids[int(rng.integers(len(held_ids)))]
        size = int(rng.integers(lo, hi))
        start = int(rng.integers(0, max(1, len(doc) - size)))
        return doc[start : start + size]

    repeated = [cut(2, 30) for _ in range(3)]
    out = []
    for i in range(n):
        shape = i % 4
        if shape == 0:
            out.append(cut(20, 120))
        elif shape == 1:
            out.append(cut(2, 12))
        elif shape == 2:
            out.append(CHAT_PREFIX + cut(5, 60) + CHAT_SUFFIX)
        else:
            out.append(repeated[int(rng.integers(3))])
    order = rng.permutation(n)
    return [out[i] for i in order]


def binomial_upper(n: int, rate: float, confidence: float = 0.999) -> int:
    """The count of alarms that n judgements at `rate` stay at or under with `confidence`."""
    total = 0.0
    for k in range(n + 1):
        total += math.comb(n, k) * rate**k * (1 - rate) ** (n - k)
        if total >= confidence:
            return k
    return n


def observe(monitor: DriftMonitor, tok: Tokenizer, texts: list[str]) -> None:
    for text in texts:
        monitor.observe(tok.encode(text).ids, text)


def test_divergences():
    a = np.array([10, 20, 30, 0])
    assert js_divergence(a, a) < 1e-9 and abs(psi(a, a)) < 1e-9
    assert js_divergence(np.array([100, 0]), np.array([0, 100])) > 0.99
    batch = js_divergence(a, np.stack([a, np.array([0, 0, 0, 5])]))
    assert batch.shape == (2,) and batch[0] < 1e-9 < batch[1]
    b = np.array([1, 0, 30, 7])
    contributions = token_contributions(a, b)
    assert (contributions >= 0).all() and contributions.sum() == pytest.approx(js_divergence(a, b))


def false_alarms(corpus, size: int, windows: int) -> int:
    # The scales a window of `size` requests fills, as the server judges them (and the draws they need).
    scales = tuple(s for s in (25, 100, 500) if s <= size)
    monitor = DriftMonitor(corpus["reference"], scales=scales, min_requests=min(scales), warmup=0,
                           false_alarm_rate=RATE, framing=(CHAT_PREFIX, CHAT_SUFFIX), seed=size)
    rng = np.random.default_rng(1000 + size)
    alarms = 0
    for _ in range(windows):
        monitor.window.clear()
        for ids in request_shaped(corpus["held_ids"], size, rng):
            monitor.observe(ids)
        report = monitor.report()
        assert [w.requests for w in report.windows] == [s for s in (25, 100, 500) if s <= size]
        alarms += report.drifting
    return alarms


@pytest.mark.parametrize("size", [25, pytest.param(100, marks=pytest.mark.full), pytest.param(500, marks=pytest.mark.full)])
def test_request_shaped_held_out_text_alarms_at_most_at_the_stated_rate(corpus, size):
    """500 in-distribution windows judged (every scale that fits judged together, as the server does):
    the alarm count stays within what a 1% rate allows (a 99.9% binomial bound, so a true rate above 1%
    shows and one at 1% passes)."""
    windows = 500
    alarms = false_alarms(corpus, size, windows)
    print(f"language: {alarms} alarms in {windows} windows of {size} requests")  # the figure, with -s
    assert alarms <= binomial_upper(windows, RATE), f"{alarms} alarms in {windows} windows of {size} requests"


def test_the_rate_is_met_not_only_bounded_when_live_text_is_drawn_as_the_null_is():
    """Windows cut exactly as the null cuts them (excerpts of the held-out half): at a stated 10% the
    alarm share is near 10%, so the thresholds are not simply set too high to ever alarm."""
    reference_ = DriftReference.from_documents(*_synthetic_documents())
    monitor = DriftMonitor(reference_, scales=(25,), warmup=0, false_alarm_rate=0.1, seed=3)
    rng = np.random.default_rng(4)
    chunks, windows, alarms = reference_.chunks, 200, 0
    for _ in range(windows):
        monitor.window.clear()
        for length in rng.integers(3, 60, size=25):
            row, start = int(rng.integers(len(chunks))), int(rng.integers(0, chunks.shape[1] - length + 1))
            monitor.observe(chunks[row, start : start + length].tolist())
        alarms += monitor.report().drifting
    print(f"language: {alarms} alarms in {windows} exchangeable windows at a stated 10%")  # with -s
    assert 7 <= alarms <= 35, f"{alarms} alarms in {windows} windows at a stated 10%"


def _synthetic_documents():
    """Token documents with bursty topics (a Zipf vocabulary, each document favouring its own words)."""
    rng = np.random.default_rng(0)
    vocab = 400
    base = 1.0 / np.arange(1, vocab + 1)
    docs = []
    for _ in range(200):
        favoured = base.copy()
        favoured[rng.choice(vocab, size=20, replace=False)] *= 20
        docs.append(rng.choice(vocab, size=int(rng.integers(200, 600)), p=favoured / favoured.sum()))
    return np.bincount(np.concatenate(docs), minlength=vocab), docs, 5


def test_a_smoke_test_of_repeated_short_prompts_is_not_judged_or_flagged(corpus):
    monitor = DriftMonitor(corpus["reference"], seed=0)
    observe(monitor, corpus["tok"], ["Say hello in one word."] * 40)
    report = monitor.report()
    assert not report.drifting and report.windows == () and "warming up" in report.reason
    # Past the warm-up, a prompt repeated is one sample, not many: a repeated excerpt of the training kind stays quiet.
    monitor = DriftMonitor(corpus["reference"], seed=0)
    observe(monitor, corpus["tok"], excerpts(corpus["held"], 3, seed=5) * 40)
    report = monitor.report()
    assert report.windows and report.distinct_prompts == 3 and not report.drifting


@pytest.mark.parametrize("kind", ["prose", "german"])
def test_a_switch_to_another_kind_of_text_alarms_within_a_bounded_number_of_requests(corpus, kind):
    monitor = DriftMonitor(corpus["reference"], seed=0)
    observe(monitor, corpus["tok"], excerpts(corpus["held"], 500, seed=1))
    assert not monitor.report().drifting  # a full 500-request window of the training kind: quiet
    rng = np.random.default_rng(2)
    shifted = (excerpts(corpus["prose"], 100, seed=2) if kind == "prose"
               else [" ".join(rng.choice(GERMAN, size=2, replace=False)) for _ in range(100)])
    delay = 0
    for text in shifted:
        monitor.observe(corpus["tok"].encode(text).ids, text)
        delay += 1
        if delay % 5 == 0 and monitor.report().drifting:  # judged every 5 requests, as the server does
            break
    report = monitor.report()
    print(f"language: {kind} after code drifting after {delay} requests")  # the figure, with -s
    assert report.drifting, f"100 {kind} prompts after code never raised drift"
    assert delay <= 25, f"drift seen only after {delay} {kind} prompts"
    worst = report.worst
    assert worst.requests == 25 and worst.token_js > worst.token_js_threshold
    # What moved: tokens with their contribution, and the shifted prompts as the most divergent.
    assert report.moved_tokens and report.moved_tokens[0]["contribution_bits"] > 0
    assert report.moved_tokens[0]["live_share"] > report.moved_tokens[0]["training_share"]
    assert report.divergent_prompts[0]["text"] in [t[:160] for t in shifted] or report.divergent_prompts[0]["text"].endswith("...")
    assert report.divergent_prompts[0]["text"].rstrip(".")[:40] in " ".join(shifted)


def test_reference_round_trip_and_fallback(corpus, tmp_path):
    reference = corpus["reference"]
    reference.save(tmp_path)
    loaded = DriftReference.load(tmp_path)
    assert np.array_equal(loaded.token_counts, reference.token_counts)
    assert np.array_equal(loaded.null_counts, reference.null_counts)
    assert np.array_equal(loaded.chunks, reference.chunks)
    assert DriftReference.load(tmp_path / "absent") is None
    # Counts only (an older export): multinomial nulls, which still judge a clear shift.
    counts_only = DriftMonitor(DriftReference(reference.token_counts), warmup=0)
    observe(counts_only, corpus["tok"], excerpts(corpus["prose"], 30, seed=3))
    assert counts_only.report().drifting


def test_too_few_requests_reports_nothing(corpus):
    monitor = DriftMonitor(corpus["reference"], min_requests=5, scales=(10,), warmup=0)
    monitor.observe([1, 2, 3])
    report = monitor.report()
    assert report.windows == () and not report.drifting and "warming up: 1 of 5" in report.reason
    with pytest.raises(ValueError):
        DriftMonitor(corpus["reference"], min_requests=20, scales=(10,))
    with pytest.raises(ValueError, match="false_alarm_rate"):
        DriftMonitor(corpus["reference"], false_alarm_rate=0.0)
