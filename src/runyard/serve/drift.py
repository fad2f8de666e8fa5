"""Drift monitoring: are the live prompts still like the training data?

The reference is saved beside the export: the training split's token histogram
(`drift_reference.json`) and a sample of its text as token windows (`drift_sample.safetensors`:
`DriftReference.CHUNKS` windows of `CHUNK_LEN` tokens at seeded random places of the training split).

Token drift is the Jensen-Shannon divergence (bits, in [0, 1]) between the histogram of recent
prompts' tokens and the training histogram. A fixed threshold cannot work: 20 short prompts taken from
the training documents themselves are far from the whole corpus's histogram just because they are
few (text is bursty: a prompt repeats its own words). So each threshold is set against the divergence
that *same-size samples of the training data* show: for the window being judged, `null_samples` sets
of training excerpts with exactly the window's prompt lengths are cut from the saved windows, and the
threshold is their mean plus `z` standard deviations. (An export without the sample falls back to
multinomial draws from the histogram, which understate burstiness, so they alarm sooner.)

Windows: the most recent `scales` requests (25, 100 and 500 by default), each judged against its own
null, so a switch to a different kind of text shows in the 25-request window long before it fills
the 500-request one. Length drift is the PSI of recent prompt lengths against the server's first
`baseline` requests, thresholded the same way (random splits of the pooled lengths).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from runyard.data.loader import SplitDocuments
from runyard.system.files import atomic_write_text

REFERENCE_FILE = "drift_reference.json"
SAMPLE_FILE = "drift_sample.safetensors"
DRIFT_FILES = (REFERENCE_FILE, SAMPLE_FILE)  # what `DriftReference.save` writes (the sample when it has one)
LENGTH_EDGES = [0, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 1 << 62]
NULL_BATCH_TOKENS = 1 << 20  # tokens gathered at once when drawing null samples
PSI_FLOOR = 1e-4  # empty buckets count as this share, the usual PSI convention, so it stays finite


def length_histogram(lengths: list[int] | np.ndarray) -> np.ndarray:
    hist, _ = np.histogram(np.asarray(lengths, dtype=np.int64), bins=LENGTH_EDGES)
    return hist.astype(np.int64)


def _proportions(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(-1, keepdims=True)
    return np.divide(counts, total, out=np.full_like(counts, 1.0 / counts.shape[-1]), where=total > 0)


def js_divergence(p_counts: np.ndarray, q_counts: np.ndarray) -> np.ndarray | float:
    """Jensen-Shannon divergence in bits between count vectors (the last axis; q may be a batch
    [B, V] against one p). Finite without smoothing: the mixture is positive wherever either side is."""
    p, q = _proportions(p_counts), _proportions(q_counts)
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> np.ndarray:
        ratio = np.divide(a, m, out=np.ones_like(a * m), where=a > 0)
        return np.sum(np.where(a > 0, a * np.log2(ratio), 0.0), axis=-1)

    out = 0.5 * kl(np.broadcast_to(p, q.shape) if q.ndim > p.ndim else p) + 0.5 * kl(q)
    return float(out) if np.ndim(out) == 0 else out


def psi(expected_counts: np.ndarray, actual_counts: np.ndarray) -> float:
    """Population stability index between two histograms."""
    e = np.maximum(_proportions(expected_counts), PSI_FLOOR)
    a = np.maximum(_proportions(actual_counts), PSI_FLOOR)
    return float(np.sum((a - e) * np.log(a / e)))


@dataclass(frozen=True)
class DriftReference:
    """The training distribution, and what its own samples look like.

    `token_counts`: the whole training split's histogram, that live prompts are compared with.
    `null_counts` and `chunks`: the training documents split at random into two halves; the first
    half's histogram, and token windows cut from the second half. A null sample is cut from the
    windows and compared with the first half's histogram, so it measures how far *unseen documents of
    the training kind* sit from a histogram of other documents (windows cut from the very documents a
    histogram counts would sit closer than new text ever does)."""

    token_counts: np.ndarray
    null_counts: np.ndarray | None = None
    chunks: np.ndarray | None = None

    CHUNKS = 512
    CHUNK_LEN = 256
    MAX_SAMPLE_TOKENS = 4_000_000  # per half: enough for a stable histogram, bounded for big corpora

    def save(self, export_dir: Path) -> Path:
        export_dir = Path(export_dir)
        path = export_dir / REFERENCE_FILE
        if self.chunks is not None:
            tmp = export_dir / f".{SAMPLE_FILE}.tmp"
            save_file({"chunks": np.ascontiguousarray(self.chunks, dtype=np.int32)}, str(tmp))
            tmp.replace(export_dir / SAMPLE_FILE)
        data = {"token_counts": [int(c) for c in self.token_counts]}
        if self.null_counts is not None:
            data["null_counts"] = [int(c) for c in self.null_counts]
        atomic_write_text(path, json.dumps(data))
        return path

    @classmethod
    def load(cls, export_dir: Path) -> DriftReference | None:
        """The reference saved with an export, or None (an export made without one)."""
        export_dir = Path(export_dir)
        path = export_dir / REFERENCE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        counts = np.asarray(data["token_counts"], dtype=np.int64)
        null_counts = np.asarray(data["null_counts"], dtype=np.int64) if "null_counts" in data else None
        chunks = None
        if (export_dir / SAMPLE_FILE).is_file():
            chunks = load_file(str(export_dir / SAMPLE_FILE))["chunks"].astype(np.int64)
        return cls(counts, null_counts, chunks)

    @classmethod
    def from_documents(cls, token_counts: np.ndarray, documents: Sequence[np.ndarray], seed: int) -> DriftReference:
        """Split `documents` (token arrays of the training split) into two random halves: the first's
        histogram, and `CHUNKS` windows of `CHUNK_LEN` tokens from the second."""
        vocab = len(token_counts)
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(documents))
        halves: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
        sizes = [0, 0]
        for i in order:
            side = 0 if sizes[0] <= sizes[1] else 1  # balance the halves by tokens
            if sizes[side] < cls.MAX_SAMPLE_TOKENS:
                halves[side].append(np.asarray(documents[i], dtype=np.int64))
                sizes[side] += len(documents[i])
        if not halves[1]:  # a single document: no unseen half to sample, so the histogram alone
            return cls(np.asarray(token_counts, dtype=np.int64))
        first, second = np.concatenate(halves[0]), np.concatenate(halves[1])
        null_counts = np.bincount(first[(first >= 0) & (first < vocab)], minlength=vocab)[:vocab]
        length = min(cls.CHUNK_LEN, len(second))
        starts = rng.integers(0, len(second) - length + 1, size=cls.CHUNKS)
        chunks = second[starts[:, None] + np.arange(length)]
        return cls(np.asarray(token_counts, dtype=np.int64), null_counts, chunks)


def training_documents(train_index: Path) -> SplitDocuments:
    """The documents of a token store split, as token arrays read on demand (shard boundaries joined)."""
    return SplitDocuments(Path(train_index))


def build_reference(token_counts: np.ndarray, train_index: Path, seed: int) -> DriftReference:
    """The drift reference of a run's training split (its token-store index), saved with the export."""
    return DriftReference.from_documents(token_counts, training_documents(train_index), seed)


@dataclass(frozen=True)
class WindowReport:
    requests: int
    tokens: int
    token_js: float
    token_js_threshold: float


@dataclass(frozen=True)
class DriftReport:
    requests_seen: int
    windows: tuple[WindowReport, ...]
    length_psi: float | None
    length_psi_threshold: float | None
    drifting: bool

    @property
    def worst(self) -> WindowReport | None:
        """The window furthest past (or closest to) its threshold."""
        if not self.windows:
            return None
        return max(self.windows, key=lambda w: w.token_js / w.token_js_threshold)


class DriftMonitor:
    """A thread-safe sliding window over recent prompts, judged against the training distribution."""

    def __init__(
        self,
        reference: DriftReference,
        scales: tuple[int, ...] = (25, 100, 500),
        min_requests: int = 20,
        baseline: int = 100,
        z: float = 4.0,
        null_samples: int = 64,
        min_psi_threshold: float = 0.25,
        seed: int = 0,
    ):
        if min_requests < 2 or not scales or min(scales) < min_requests:
            raise ValueError("scales must be >= min_requests >= 2")
        self.reference = reference
        self.vocab = len(reference.token_counts)
        self.scales = tuple(sorted(scales))
        self.min_requests, self.baseline, self.z = min_requests, baseline, z
        self.null_samples, self.min_psi_threshold = null_samples, min_psi_threshold
        self.window: deque[np.ndarray] = deque(maxlen=self.scales[-1])
        self.baseline_lengths: list[int] = []
        self.seen = 0
        self._rng = np.random.default_rng(seed)
        self._ref_probs = _proportions(reference.token_counts)
        self._lock = threading.Lock()
        self._judging = threading.Lock()  # the null draws share one RNG

    def observe(self, token_ids: list[int]) -> None:
        ids = np.asarray(token_ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < self.vocab)]
        with self._lock:
            self.window.append(ids)
            self.seen += 1
            if len(self.baseline_lengths) < self.baseline:
                self.baseline_lengths.append(len(ids))

    def report(self) -> DriftReport:
        with self._lock:
            recent = list(self.window)
            baseline = list(self.baseline_lengths)
            seen = self.seen
        if len(recent) < self.min_requests:
            return DriftReport(seen, (), None, None, False)
        sizes = sorted({min(s, len(recent)) for s in self.scales})
        with self._judging:
            windows = tuple(self._judge(recent[-k:]) for k in sizes)
            length_psi = length_threshold = None
            current = [len(r) for r in recent[-sizes[0] :]]
            if len(baseline) >= self.baseline and seen > self.baseline:
                length_psi, length_threshold = self._judge_lengths(baseline, current)
        drifting = any(w.token_js > w.token_js_threshold for w in windows) or (
            length_psi is not None and length_psi > length_threshold
        )
        return DriftReport(seen, windows, length_psi, length_threshold, drifting)

    def _judge(self, prompts: list[np.ndarray]) -> WindowReport:
        live = np.bincount(np.concatenate(prompts), minlength=self.vocab)[: self.vocab] if prompts else None
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        js = float(js_divergence(self.reference.token_counts, live)) if lengths.sum() else 0.0
        null = self._null_js(lengths)
        threshold = float(null.mean() + self.z * null.std())
        return WindowReport(len(prompts), int(lengths.sum()), round(js, 6), round(threshold, 6))

    def _null_js(self, lengths: np.ndarray) -> np.ndarray:
        """JS divergence of `null_samples` training samples with these prompt lengths."""
        chunks = self.reference.chunks
        if chunks is None or chunks.shape[1] == 0:
            hist = self._rng.multinomial(int(lengths.sum()), self._ref_probs, size=self.null_samples)
            return js_divergence(self.reference.token_counts, hist)
        null_counts = self.reference.null_counts if self.reference.null_counts is not None else self.reference.token_counts
        lengths = np.minimum(lengths, chunks.shape[1])
        total = int(lengths.sum())
        # Position of each token inside its excerpt, for excerpts laid end to end.
        within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        per_batch = max(1, NULL_BATCH_TOKENS // max(1, total))  # bounds the memory of one gather
        out = []
        for start in range(0, self.null_samples, per_batch):
            n = min(per_batch, self.null_samples - start)
            rows = self._rng.integers(0, len(chunks), size=(n, len(lengths)))
            offsets = (self._rng.random((n, len(lengths))) * (chunks.shape[1] - lengths + 1)).astype(np.int64)
            tokens = chunks[np.repeat(rows, lengths, axis=1), np.repeat(offsets, lengths, axis=1) + within]
            flat = (np.arange(n)[:, None] * self.vocab + tokens).ravel()
            hist = np.bincount(flat, minlength=n * self.vocab).reshape(n, self.vocab)
            out.append(np.atleast_1d(js_divergence(null_counts, hist)))
        return np.concatenate(out)

    def _judge_lengths(self, baseline: list[int], current: list[int]) -> tuple[float, float]:
        value = psi(length_histogram(baseline), length_histogram(current))
        pooled = np.asarray(baseline + current)
        nulls = []
        for _ in range(self.null_samples):
            perm = self._rng.permutation(pooled)
            nulls.append(psi(length_histogram(perm[: len(baseline)]), length_histogram(perm[len(baseline) :])))
        threshold = max(self.min_psi_threshold, float(np.mean(nulls) + self.z * np.std(nulls)))
        return round(value, 6), round(threshold, 6)
