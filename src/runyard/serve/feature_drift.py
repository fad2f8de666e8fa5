"""Feature drift of a served table or image model: are the live rows still like the training rows?

The reference (`feature_drift.json` in the export) is built from the training split: per numeric feature,
bin edges at its deciles and the training share of each bin (plus a bin for missing values); per
categorical feature, the training share of each category (plus one bucket for values training never
saw); and a seeded sample of training rows. Image models use per-channel mean intensity and contrast
(std) of each image as their numeric features.

Live rows are kept in a window (the most recent `window` rows). Drift per numeric feature is the
population stability index (PSI) of the window's bins against the training shares; per categorical
feature, the Jensen-Shannon divergence (bits). A fixed bound alarms on small windows just because they are
small, so each feature's threshold is the larger of a conventional floor (PSI 0.1, the usual "moderate
shift"; JS 0.05 bits) and the mean + 3 standard deviations of the same statistic over `null_samples`
windows of the same size drawn from the training sample itself.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runyard.serve.drift import js_divergence, psi
from runyard.system.files import atomic_write_text

REFERENCE_FILE = "feature_drift.json"
PSI_FLOOR, JS_FLOOR = 0.1, 0.05
SAMPLE_ROWS = 2000
MIN_ROWS = 30  # fewer live rows than this are not judged
NULL_Z = 3.0


@dataclass(frozen=True)
class FeatureBins:
    name: str
    kind: str  # numeric | categorical
    edges: list[float]  # numeric: inner bin edges (values < edges[0] fall in bin 0); categorical: unused
    n_categories: int  # categorical: codes 0..n-1, then the unseen bucket
    counts: list[int]  # training counts per bin (numeric: bins then missing; categorical: codes then unseen)

    def histogram(self, values: np.ndarray) -> np.ndarray:
        """Counts per bin of `values`: numeric, the decile bins then missing; categorical, each code then
        the bucket of missing or never-seen values (both encoded NaN)."""
        values = np.asarray(values, dtype=np.float64)
        missing = np.isnan(values)
        present = values[~missing]
        if self.kind == "numeric":
            body = np.bincount(np.searchsorted(np.asarray(self.edges), present, side="right"), minlength=len(self.edges) + 1)
        else:
            body = np.bincount(present.astype(np.int64), minlength=self.n_categories)[: self.n_categories]
        return np.append(body, int(missing.sum())).astype(np.int64)

    def statistic(self, counts: np.ndarray) -> float:
        reference = np.asarray(self.counts, dtype=np.int64)
        return psi(reference, counts) if self.kind == "numeric" else float(js_divergence(reference, counts))


@dataclass
class FeatureReference:
    features: list[FeatureBins]
    sample: np.ndarray  # [rows, features] of training rows, for the null thresholds
    seed: int

    @classmethod
    def build(cls, x: np.ndarray, names: list[str], kinds: list[str], n_categories: list[int], seed: int) -> FeatureReference:
        """From the training matrix `x` (numeric values; categorical codes, NaN for missing or unseen)."""
        features = []
        for j, (name, kind) in enumerate(zip(names, kinds, strict=True)):
            column = x[:, j]
            present = column[~np.isnan(column)]
            edges = np.unique(np.quantile(present, np.linspace(0.1, 0.9, 9))).tolist() if kind == "numeric" and len(present) else []
            bins = FeatureBins(name, kind, edges, n_categories[j] if kind == "categorical" else 0, [])
            features.append(FeatureBins(name, kind, edges, bins.n_categories, bins.histogram(column).tolist()))
        rng = np.random.Generator(np.random.PCG64(seed))
        take = rng.choice(len(x), size=min(len(x), SAMPLE_ROWS), replace=False) if len(x) else np.zeros(0, dtype=int)
        return cls(features, x[np.sort(take)], seed)

    def save(self, directory: Path) -> str:
        data = {"seed": self.seed, "features": [vars(f) for f in self.features],
                "sample": [[None if np.isnan(v) else float(v) for v in row] for row in self.sample]}
        atomic_write_text(Path(directory) / REFERENCE_FILE, json.dumps(data) + "\n")
        return REFERENCE_FILE

    @classmethod
    def load(cls, directory: Path) -> FeatureReference | None:
        path = Path(directory) / REFERENCE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        sample = np.asarray([[np.nan if v is None else v for v in row] for row in data["sample"]], dtype=np.float64)
        return cls([FeatureBins(**f) for f in data["features"]], sample.reshape(len(data["sample"]), -1), data["seed"])


class FeatureDriftMonitor:
    """Live rows against the reference; thread-safe (the server observes from its worker threads)."""

    def __init__(self, reference: FeatureReference, window: int = 1000, null_samples: int = 40):
        self.reference, self.window, self.null_samples = reference, window, null_samples
        self._rows: deque[np.ndarray] = deque(maxlen=window)
        self._unseen: dict[str, int] = {}
        self._total = 0
        self._lock = threading.Lock()
        self._thresholds: dict[int, list[float]] = {}

    def observe(self, matrix: np.ndarray, unseen: list[dict[str, Any]] | None = None) -> None:
        with self._lock:
            for row in np.asarray(matrix, dtype=np.float64):
                self._rows.append(row)
            self._total += len(matrix)
            for item in unseen or []:
                self._unseen[item["feature"]] = self._unseen.get(item["feature"], 0) + 1

    def thresholds(self, n: int) -> list[float]:
        """Per feature: the floor, or the statistic's mean + 3 sd over same-size training windows."""
        if n in self._thresholds:
            return self._thresholds[n]
        sample = self.reference.sample
        rng = np.random.Generator(np.random.PCG64([self.reference.seed, n]))
        out = []
        for j, f in enumerate(self.reference.features):
            floor = PSI_FLOOR if f.kind == "numeric" else JS_FLOOR
            if len(sample) == 0:
                out.append(floor)
                continue
            stats = [f.statistic(f.histogram(sample[rng.integers(0, len(sample), size=n), j]))
                     for _ in range(self.null_samples)]
            out.append(max(floor, float(np.mean(stats) + NULL_Z * np.std(stats))))
        self._thresholds[n] = out
        return out

    def status(self) -> dict[str, Any]:
        with self._lock:
            rows = np.asarray(self._rows) if self._rows else np.zeros((0, len(self.reference.features)))
            total, unseen = self._total, dict(self._unseen)
        n = len(rows)
        judged = n >= MIN_ROWS
        features = {}
        limits = self.thresholds(n) if judged else [None] * len(self.reference.features)
        for j, f in enumerate(self.reference.features):
            entry: dict[str, Any] = {"kind": f.kind, "statistic": "psi" if f.kind == "numeric" else "js_bits"}
            if judged:
                value = f.statistic(f.histogram(rows[:, j]))
                entry.update(value=value, threshold=limits[j], drifting=bool(value > limits[j]))
            if f.name in unseen:
                entry["unseen_values"] = unseen[f.name]
            features[f.name] = entry
        drifting = sorted(name for name, e in features.items() if e.get("drifting"))
        return {"rows_seen": total, "window_rows": n, "judged": judged, "min_rows": MIN_ROWS,
                "drifting": drifting, "features": features}
