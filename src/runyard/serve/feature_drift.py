"""Feature drift of a served table or image model: are the live rows still like the training rows, at a
stated false-alarm rate?

The reference (`feature_drift.json` in the export) is built from the training split, split at random in
two: the **histogram rows** give, per numeric feature, bin edges at its deciles and the share of each bin
(plus a bin for missing values), and per categorical feature the share of each category (plus one bucket
for values training never saw); the **held-out rows** (up to `SAMPLE_ROWS`, never counted in a histogram)
are stored for the null. Image models use per-channel mean intensity and contrast (std) of each image as
their numeric features.

Live rows are kept in a window (the most recent `window` rows). A judgement looks at several windows at
once, each the last L rows: L in `scales` (50 and 200 by default, so a recent shift is not diluted by a
full window of older rows) and the largest of `WINDOW_SIZES` (or the window) that the rows fill, so a
threshold is always the one of the size actually judged. Drift per numeric feature is the population
stability index (PSI) of those rows' bins against the training shares; per categorical feature, the
Jensen-Shannon divergence (bits). The thresholds come from `null_draws` windows of held-out rows (drawn
with replacement: a finite pool drawn without would understate the spread of large windows; the smaller
windows are the last rows of the largest, as live ones are): each (feature, size) statistic is ranked over
the draws, each draw keeps its best rank over all of them, and the rank cut that at most
`false_alarm_rate` of the draws reach sets every threshold (its statistic's value at that rank). That is a
max-statistic correction for judging every feature and window size at once: in-distribution rows alarm
on anything in at most that share of judgements (default 1%). A threshold is never below a conventional floor (PSI 0.1, the usual
"moderate shift"; JS 0.05 bits), which only lowers the rate further.

Every `check_every` rows the window is judged; a judgement that drifts after one that did not is an
**event** (kept in `/v1/drift` and logged) naming the features, their statistic, value, threshold and
how their live summary moved (mean and median, or the categories whose share changed most).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runyard.serve.drift import DEFAULT_FALSE_ALARM_RATE, js_divergence, psi
from runyard.serve.drift import PSI_FLOOR as SHARE_FLOOR
from runyard.system.files import atomic_write_text

log = logging.getLogger("runyard.serve")

REFERENCE_FILE = "feature_drift.json"
PSI_FLOOR, JS_FLOOR = 0.1, 0.05
SAMPLE_ROWS = 2000  # held-out rows stored for the null (at most half the training rows)
MIN_ROWS = 30  # fewer live rows than this are not judged
WINDOW_SIZES = (30, 50, 100, 200, 500, 1000, 2000, 5000)  # the largest window judged: thresholds cached per size
SCALES = (50, 200)  # the recent windows judged beside it
NULL_DRAWS = 499  # null windows per set of sizes, at least 2 x statistics / rate: the rate's share of the
# draws must hold more than each statistic's own maximum, or no cut is left
CHECK_EVERY = 50  # rows between the judgements that can make an event
MAX_EVENTS = 100
EXAMPLE_CATEGORIES = 3


def psi_rows(expected_counts: np.ndarray, actual_counts: np.ndarray) -> np.ndarray:
    """`psi` of one histogram against each row of a batch [draws, bins]."""
    e = np.asarray(expected_counts, dtype=np.float64)
    e = np.maximum(e / max(e.sum(), 1.0), SHARE_FLOOR)
    a = np.asarray(actual_counts, dtype=np.float64)
    a = np.maximum(a / np.maximum(a.sum(-1, keepdims=True), 1.0), SHARE_FLOOR)
    return np.sum((a - e) * np.log(a / e), axis=-1)


@dataclass(frozen=True)
class FeatureBins:
    name: str
    kind: str  # numeric | categorical
    edges: list[float]  # numeric: inner bin edges (values < edges[0] fall in bin 0); categorical: unused
    n_categories: int  # categorical: codes 0..n-1, then the unseen bucket
    counts: list[int]  # training counts per bin (numeric: bins then missing; categorical: codes then unseen)

    @property
    def bins(self) -> int:
        return len(self.edges) + 2 if self.kind == "numeric" else self.n_categories + 1

    def bin_index(self, values: np.ndarray) -> np.ndarray:
        """Each value's bin: numeric, its decile bin or the last (missing); categorical, its code or the
        last (missing or never seen, both encoded NaN)."""
        values = np.asarray(values, dtype=np.float64)
        missing = np.isnan(values)
        safe = np.where(missing, 0.0, values)
        if self.kind == "numeric":
            body = np.searchsorted(np.asarray(self.edges, dtype=np.float64), safe, side="right")
        else:
            body = np.clip(safe.astype(np.int64), 0, self.n_categories)
        return np.where(missing, self.bins - 1, body).astype(np.int64)

    def histogram(self, values: np.ndarray) -> np.ndarray:
        return np.bincount(self.bin_index(values), minlength=self.bins).astype(np.int64)

    def statistic(self, counts: np.ndarray) -> float:
        reference = np.asarray(self.counts, dtype=np.int64)
        return psi(reference, counts) if self.kind == "numeric" else float(js_divergence(reference, counts))

    def statistics(self, counts: np.ndarray) -> np.ndarray:
        """`statistic` of each row of a batch of histograms [draws, bins]."""
        reference = np.asarray(self.counts, dtype=np.int64)
        if self.kind == "numeric":
            return psi_rows(reference, counts)
        return np.atleast_1d(js_divergence(reference, counts))

    @property
    def floor(self) -> float:
        return PSI_FLOOR if self.kind == "numeric" else JS_FLOOR


@dataclass
class FeatureReference:
    features: list[FeatureBins]
    sample: np.ndarray  # [rows, features]: held-out training rows (not in any histogram), for the null
    seed: int
    heldout: bool = True  # False for an older export, whose sample was histogram rows

    @classmethod
    def build(cls, x: np.ndarray, names: list[str], kinds: list[str], n_categories: list[int], seed: int) -> FeatureReference:
        """From the training matrix `x` (numeric values; categorical codes, NaN for missing or unseen): up
        to `SAMPLE_ROWS` rows (at most half) held out for the null, the histograms from the rest."""
        x = np.asarray(x, dtype=np.float64)
        rng = np.random.Generator(np.random.PCG64(seed))
        order = rng.permutation(len(x))
        held_n = min(SAMPLE_ROWS, len(x) // 2)
        held, body = x[np.sort(order[:held_n])], x[np.sort(order[held_n:])]
        features = []
        for j, (name, kind) in enumerate(zip(names, kinds, strict=True)):
            column = body[:, j]
            present = column[~np.isnan(column)]
            edges = np.unique(np.quantile(present, np.linspace(0.1, 0.9, 9))).tolist() if kind == "numeric" and len(present) else []
            bins = FeatureBins(name, kind, edges, n_categories[j] if kind == "categorical" else 0, [])
            features.append(FeatureBins(name, kind, edges, bins.n_categories, bins.histogram(column).tolist()))
        return cls(features, held, seed, heldout=True)

    def save(self, directory: Path) -> str:
        data = {"seed": self.seed, "features": [vars(f) for f in self.features], "sample_heldout": self.heldout,
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
        return cls([FeatureBins(**f) for f in data["features"]], sample.reshape(len(data["sample"]), len(data["features"])),
                   data["seed"], bool(data.get("sample_heldout", False)))


class FeatureDriftMonitor:
    """Live rows against the reference; thread-safe (the server observes from its worker threads).
    `category_names`: per categorical feature, its categories in code order (to name what moved)."""

    def __init__(self, reference: FeatureReference, window: int = 1000, null_draws: int | None = None,
                 false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE, check_every: int = CHECK_EVERY,
                 category_names: dict[str, list[str]] | None = None, scales: tuple[int, ...] = SCALES):
        if not 0 < false_alarm_rate < 0.5:
            raise ValueError(f"false_alarm_rate must be in (0, 0.5), got {false_alarm_rate}")
        if window < MIN_ROWS:
            raise ValueError(f"the drift window must hold at least {MIN_ROWS} rows, got {window}")
        self.reference, self.window, self.false_alarm_rate = reference, window, false_alarm_rate
        self.sizes = tuple(sorted({s for s in WINDOW_SIZES if MIN_ROWS <= s < window} | {window}))
        self.scales = tuple(sorted(s for s in scales if MIN_ROWS <= s < window))
        statistics = max(1, len(reference.features)) * (len(self.scales) + 1)
        self.null_draws = null_draws or max(NULL_DRAWS, math.ceil(2 * statistics / false_alarm_rate) - 1)
        if self.null_draws * false_alarm_rate < statistics:
            raise ValueError(f"{self.null_draws} null draws cannot resolve a false-alarm rate of {false_alarm_rate}")
        self.check_every, self.category_names = check_every, category_names or {}
        self.events: list[dict[str, Any]] = []
        self._rows: deque[np.ndarray] = deque(maxlen=window)
        self._unseen: dict[str, int] = {}
        self._total = 0
        self._checked = 0
        self._in_event = False
        self._lock = threading.Lock()
        self._judging = threading.Lock()
        self._thresholds: dict[int, list[float]] = {}
        self._training_summary = [self._summary(f, reference.sample[:, j]) if len(reference.sample) else None
                                  for j, f in enumerate(reference.features)]

    def sizes_for(self, rows: int) -> tuple[int, ...]:
        """The window sizes judged when `rows` live rows are held: the recent scales they fill and the
        largest ladder size they fill; none below `MIN_ROWS`."""
        fitting = [s for s in self.sizes if s <= rows]
        if not fitting:
            return ()
        return tuple(sorted({s for s in self.scales if s < fitting[-1]} | {fitting[-1]}))

    def warm(self) -> None:
        """Compute every threshold a judgement can need (a few seconds for wide tables), so the request
        that first fills a window size does not wait for its null; the server runs this on a thread."""
        for n in self.sizes:
            self.thresholds(self.sizes_for(n))

    def observe(self, matrix: np.ndarray, unseen: list[dict[str, Any]] | None = None) -> None:
        with self._lock:
            for row in np.asarray(matrix, dtype=np.float64):
                self._rows.append(row)
            self._total += len(matrix)
            for item in unseen or []:
                self._unseen[item["feature"]] = self._unseen.get(item["feature"], 0) + 1
            due = self._total - self._checked >= self.check_every
            if due:
                self._checked = self._total
        if due:
            self._check_event()

    def null(self, sizes: tuple[int, ...]) -> np.ndarray:
        """Each feature's statistic over `null_draws` windows of held-out rows, the smaller sizes the last
        rows of the largest: [draws, sizes, features]."""
        sample = self.reference.sample
        rng = np.random.Generator(np.random.PCG64([self.reference.seed, *sizes]))
        picks = rng.integers(0, len(sample), size=(self.null_draws, sizes[-1]))
        out = np.zeros((self.null_draws, len(sizes), len(self.reference.features)))
        offsets = np.arange(self.null_draws)[:, None]
        for j, f in enumerate(self.reference.features):
            index = f.bin_index(sample[:, j])[picks]
            for k, size in enumerate(sizes):
                part = index[:, sizes[-1] - size :]
                counts = np.bincount((offsets * f.bins + part).ravel(), minlength=self.null_draws * f.bins)
                out[:, k, j] = f.statistics(counts.reshape(self.null_draws, f.bins))
        return out

    def thresholds(self, sizes: tuple[int, ...]) -> np.ndarray:
        """The thresholds of a judgement over `sizes`: [sizes, features], the max-statistic cut over the
        null (see the module's docstring), never below a feature's floor."""
        with self._judging:
            if sizes in self._thresholds:
                return self._thresholds[sizes]
            features = self.reference.features
            floors = np.array([f.floor for f in features])
            if len(self.reference.sample) == 0:
                out = np.tile(floors, (len(sizes), 1))
            else:
                null = self.null(sizes).reshape(self.null_draws, -1)
                draws = len(null)
                best = (draws - np.argsort(np.argsort(null, axis=0), axis=0)).min(axis=1)  # rank 1: largest
                allowed = int(math.floor(self.false_alarm_rate * draws))
                reached = np.cumsum(np.bincount(best, minlength=draws + 1))  # draws whose best rank is <= c
                cut = int(np.searchsorted(reached, allowed, side="right")) - 1  # the largest c within the rate
                ordered = np.sort(null, axis=0)[::-1]
                limits = ordered[cut - 1] if cut >= 1 else np.full(null.shape[1], np.inf)
                out = np.maximum(limits.reshape(len(sizes), len(features)), floors)
            self._thresholds[sizes] = out
            return out

    def _summary(self, f: FeatureBins, values: np.ndarray) -> dict[str, Any]:
        values = np.asarray(values, dtype=np.float64)
        missing = np.isnan(values)
        out: dict[str, Any] = {"missing_share": round(float(missing.mean()), 4) if len(values) else None}
        present = values[~missing]
        if f.kind == "numeric":
            out.update(mean=round(float(present.mean()), 6) if len(present) else None,
                       median=round(float(np.median(present)), 6) if len(present) else None)
        else:
            counts = f.histogram(values)
            out["shares"] = (counts / max(1, counts.sum())).tolist()
        return out

    def _moved(self, j: int, f: FeatureBins, values: np.ndarray) -> dict[str, Any]:
        """How a feature's live summary differs from the held-out training rows'."""
        live, training = self._summary(f, values), self._training_summary[j]
        if f.kind == "numeric" or training is None:
            return {"live": live, "training": training}
        names = self.category_names.get(f.name, [])
        label = [*(names if len(names) == f.n_categories else [str(i) for i in range(f.n_categories)]), "(missing or unseen)"]
        change = np.asarray(live["shares"]) - np.asarray(training["shares"])
        top = np.argsort(-np.abs(change))[:EXAMPLE_CATEGORIES]
        return {"categories": [{"category": label[k], "live_share": round(live["shares"][k], 4),
                                "training_share": round(training["shares"][k], 4)} for k in top],
                "live_missing_share": live["missing_share"], "training_missing_share": training["missing_share"]}

    def judge(self, rows: np.ndarray, unseen: dict[str, int] | None = None) -> tuple[tuple[int, ...], dict[str, Any], list[str]]:
        """The judgement of `rows` [n, features], the newest last: (the window sizes judged, none when too
        few rows; per feature, its statistic, and at the size where it is furthest past (or closest to)
        its threshold the value, threshold, window and, when drifting, how its summary moved; the
        drifting features, the furthest past first)."""
        rows = np.asarray(rows, dtype=np.float64).reshape(-1, len(self.reference.features))
        sizes = self.sizes_for(len(rows))
        limits = self.thresholds(sizes) if sizes else None
        features: dict[str, Any] = {}
        for j, f in enumerate(self.reference.features):
            entry: dict[str, Any] = {"kind": f.kind, "statistic": "psi" if f.kind == "numeric" else "js_bits"}
            if sizes:
                values = [f.statistic(f.histogram(rows[len(rows) - n :, j])) for n in sizes]
                k = max(range(len(sizes)), key=lambda i: values[i] / limits[i, j])
                entry.update(value=round(values[k], 6), threshold=round(float(limits[k, j]), 6), window_rows=sizes[k],
                             drifting=bool(values[k] > limits[k, j]))
                if entry["drifting"]:
                    entry["moved"] = self._moved(j, f, rows[len(rows) - sizes[k] :, j])
            if unseen and f.name in unseen:
                entry["unseen_values"] = unseen[f.name]
            features[f.name] = entry
        drifting = sorted((name for name, e in features.items() if e.get("drifting")),
                          key=lambda name: -features[name]["value"] / features[name]["threshold"])
        return sizes, features, drifting

    def status(self) -> dict[str, Any]:
        with self._lock:
            rows = np.asarray(self._rows) if self._rows else np.zeros((0, len(self.reference.features)))
            total, unseen, events = self._total, dict(self._unseen), list(self.events)
        sizes, features, drifting = self.judge(rows, unseen)
        return {"rows_seen": total, "rows_in_window": len(rows), "window_rows": sizes[-1] if sizes else 0,
                "windows_judged": list(sizes), "judged": bool(sizes),
                "min_rows": MIN_ROWS, "false_alarm_rate": self.false_alarm_rate, "null_draws": self.null_draws,
                "null_rows": "held-out training rows" if self.reference.heldout else "training rows (an older export)",
                "drifting": drifting, "features": features, "events": events}

    def _check_event(self) -> None:
        status = self.status()
        if not status["judged"]:
            return
        event = None
        with self._lock:
            if not status["drifting"]:
                self._in_event = False
            elif not self._in_event:
                self._in_event = True
                event = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows_seen": status["rows_seen"],
                         "window_rows": status["window_rows"], "false_alarm_rate": self.false_alarm_rate,
                         "features": {name: status["features"][name] for name in status["drifting"]}}
                self.events.append(event)
                del self.events[:-MAX_EVENTS]
        if event is not None:
            worst = status["drifting"][0]
            first = event["features"][worst]
            log.warning("drift event: %d feature(s) past their threshold (false-alarm rate %s per judgement); most: "
                        "%s, %s %s > %s over the last %d rows", len(status["drifting"]), self.false_alarm_rate, worst,
                        first["statistic"], first["value"], first["threshold"], first["window_rows"])
