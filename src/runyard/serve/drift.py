"""Drift monitoring: are the live requests still like the training data?

The token reference is the training split's token distribution (a unigram histogram), saved beside
the export as `drift_reference.json`. A `DriftMonitor` keeps a sliding window of live prompts and
compares:

- token drift: Jensen-Shannon divergence (base 2, in [0, 1]) between the window's token histogram and
  the training histogram;
- length drift: population stability index (PSI) of prompt lengths over fixed log-spaced buckets,
  between the current window and the first `baseline` requests the server saw (training documents
  are whole files, so their lengths say nothing about what prompts should look like).

Either above its threshold raises the `drifting` flag. Thresholds default to common practice
(PSI > 0.25 is "significant shift"; JS > 0.2 for tokens is a large move for a code or text model).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from runyard.fsutil import atomic_write_text

REFERENCE_FILE = "drift_reference.json"
LENGTH_EDGES = [0, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 1 << 62]


def length_histogram(lengths: list[int] | np.ndarray) -> np.ndarray:
    hist, _ = np.histogram(np.asarray(lengths, dtype=np.int64), bins=LENGTH_EDGES)
    return hist.astype(np.int64)


def _proportions(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    return counts / total if total > 0 else np.full(len(counts), 1.0 / len(counts))


def js_divergence(p_counts: np.ndarray, q_counts: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits: finite without smoothing, since the mixture is positive
    wherever either side is."""
    p, q = _proportions(p_counts), _proportions(q_counts)
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> float:
        mask = a > 0
        return float(np.sum(a[mask] * np.log2(a[mask] / m[mask])))

    return 0.5 * kl(p) + 0.5 * kl(q)


PSI_FLOOR = 1e-4  # empty buckets count as this share, the usual PSI convention, so it stays finite


def psi(expected_counts: np.ndarray, actual_counts: np.ndarray) -> float:
    e = np.maximum(_proportions(expected_counts), PSI_FLOOR)
    a = np.maximum(_proportions(actual_counts), PSI_FLOOR)
    return float(np.sum((a - e) * np.log(a / e)))


@dataclass(frozen=True)
class DriftReference:
    token_counts: list[int]

    def save(self, export_dir: Path) -> Path:
        path = export_dir / REFERENCE_FILE
        atomic_write_text(path, json.dumps(asdict(self)))
        return path

    @classmethod
    def load(cls, export_dir: Path) -> DriftReference | None:
        path = export_dir / REFERENCE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(token_counts=[int(c) for c in data["token_counts"]])


@dataclass(frozen=True)
class DriftReport:
    window_requests: int
    window_tokens: int
    token_js: float | None
    length_psi: float | None
    drifting: bool


class DriftMonitor:
    """Thread-safe sliding window over the last `window` requests."""

    def __init__(
        self,
        reference: DriftReference,
        window: int = 500,
        min_requests: int = 20,
        baseline: int = 100,
        token_js_threshold: float = 0.2,
        length_psi_threshold: float = 0.25,
    ):
        self.reference_tokens = np.asarray(reference.token_counts, dtype=np.int64)
        self.window: deque[list[int]] = deque(maxlen=window)
        self.baseline_lengths: list[int] = []
        self.baseline = baseline
        self.min_requests = min_requests
        self.token_js_threshold = token_js_threshold
        self.length_psi_threshold = length_psi_threshold
        self._lock = threading.Lock()

    def observe(self, token_ids: list[int]) -> None:
        with self._lock:
            self.window.append(list(token_ids))
            if len(self.baseline_lengths) < self.baseline:
                self.baseline_lengths.append(len(token_ids))

    def report(self) -> DriftReport:
        with self._lock:
            requests = list(self.window)
            baseline = list(self.baseline_lengths)
        n_tokens = sum(len(r) for r in requests)
        if len(requests) < self.min_requests or n_tokens == 0:
            return DriftReport(len(requests), n_tokens, None, None, False)
        vocab = len(self.reference_tokens)
        live = np.bincount(
            np.concatenate([np.asarray(r, dtype=np.int64) for r in requests if r]), minlength=vocab
        )[:vocab]
        token_js = js_divergence(self.reference_tokens, live)
        length_psi = None
        if len(baseline) >= self.baseline:
            length_psi = round(
                psi(length_histogram(baseline), length_histogram([len(r) for r in requests])), 6
            )
        drifting = token_js > self.token_js_threshold or (
            length_psi is not None and length_psi > self.length_psi_threshold
        )
        return DriftReport(len(requests), n_tokens, round(token_js, 6), length_psi, drifting)
