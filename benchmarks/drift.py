"""Drift detection: runyard's detectors against Evidently's on the same windows, for language and tables.

Two figures per family, each a RATIO of runyard's over Evidently's (target <= 1 for both):
- false alarms: the share of in-distribution windows that alarm (language: request-shaped excerpts of
  held-out source files, 60-300 characters; tables: held-out rows), `--windows` windows per window size;
- detection delay: requests (language) or rows (tables) after a planted shift starts until the first
  alarm, judged every `--every` inputs over the recent window, the median over `--trials` streams, for
  shifts of several sizes (language: a quarter, half or all of the requests become prose; tables: one
  feature's mean moves by 0.25, 0.5 or 1 sd). A stream that never alarms counts as `--horizon`.
  The ratio is each window or shift size's runyard/Evidently figure (a zero rate counts as one window
  in `--windows`); the printed value is their median, the spread their min..max.

runyard's side is what a server runs: `DriftMonitor` (token Jensen-Shannon divergence at a stated
false-alarm rate, request-shaped nulls, byte-level tokens here) and `FeatureDriftMonitor` (PSI and JS per
feature, max-statistic cut over all features). The peer is Evidently's column drift tests as its
`ValueDrift` metric picks them (`get_stattest`, its defaults): for text, the domain-classifier test
(`perc_text_content_drift`, its default threshold); for tables, with a 1,000-row reference, Kolmogorov-
Smirnov per numeric column and chi-square per categorical one, at runyard's stated rate corrected by
Bonferroni over the columns (a window alarms when any column drifts, as runyard's does). The share of
windows Evidently's uncorrected default (p < 0.05 per column) would flag is printed as a note.

Evidently 0.7 needs pandas < 3 and is not a runyard dependency: install it apart from the project's
environment (`pip install --target DIR evidently 'pandas<3'`) and pass `--peer-path DIR` (the runyard
environment's own packages come first), or `pip install 'runyard[bench]'` where pandas is not pinned.

Run: python benchmarks/drift.py [--windows 500] [--trials 20] [--peer-path DIR] [--record]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, Samples  # noqa: E402

from runyard.serve.drift import DriftMonitor, DriftReference  # noqa: E402
from runyard.serve.feature_drift import FeatureDriftMonitor, FeatureReference  # noqa: E402

RATE = 0.01
NOTES = Path(__file__).resolve().parents[1] / "examples" / "data" / "notes.jsonl"
CODE_PACKAGES = ("email", "json", "http", "logging", "concurrent", "importlib", "xml", "urllib", "asyncio")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=500, help="in-distribution windows per window size (default 500)")
    p.add_argument("--trials", type=int, default=20, help="streams per planted shift (default 20)")
    p.add_argument("--every", type=int, default=5, help="language: requests between judgements (default 5)")
    p.add_argument("--horizon", type=int, default=300, help="inputs after the shift before a stream counts as missed")
    p.add_argument("--family", choices=["all", "language", "table"], default="all")
    p.add_argument("--peer-path", default=None, help="directories (os.pathsep-separated) Evidently was installed into (pip --target)")
    p.add_argument("--record", action="store_true", help="write benchmarks/results/drift.json and refresh the README table")
    return p.parse_args(argv)


def load_evidently(peer_path: str | None):
    for path in (peer_path or "").split(os.pathsep):
        if path:
            sys.path.append(path)  # after the project's own packages: Evidently's copies of them are not used
    try:
        import pandas as pd
        from evidently.legacy.calculations.stattests.registry import get_stattest
        from evidently.legacy.core import ColumnType
    except ImportError as exc:
        raise SystemExit(f"Evidently is not importable ({exc}): install it as the module doc says") from None
    return pd, get_stattest, ColumnType


def rate_ratio(ours: int, theirs: int, windows: int) -> float:
    return max(ours, 1) / max(theirs, 1) if ours or theirs else 1.0


# ---- language -------------------------------------------------------------------------------------------


def code_files() -> tuple[list[str], list[str]]:
    """Standard-library sources, split into training and held-out files by a hash of their path."""
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for pkg in CODE_PACKAGES for p in glob.glob(f"{stdlib}/{pkg}/**/*.py", recursive=True))
    texts = [(p, Path(p).read_text(encoding="utf-8", errors="replace")) for p in paths]
    texts = [(p, t) for p, t in texts if len(t) > 400]
    train = [t for p, t in texts if zlib.crc32(p.encode()) % 4]
    held = [t for p, t in texts if not zlib.crc32(p.encode()) % 4]
    return train, held


def excerpts(texts: list[str], n: int, rng: np.random.Generator) -> list[str]:
    """Request-shaped inputs: 60-300 characters cut from a random text."""
    out = []
    for _ in range(n):
        text = texts[int(rng.integers(len(texts)))]
        size = int(rng.integers(60, 300))
        start = int(rng.integers(0, max(1, len(text) - size)))
        out.append(text[start : start + size])
    return out


def ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))  # byte-level tokens: the vocabulary is the 256 byte values


class LanguagePeer:
    """Evidently's default text-column drift test (a domain classifier) against reference excerpts."""

    def __init__(self, reference: list[str], pd, get_stattest, column_type):
        self.pd, self.type = pd, column_type.Text
        self.reference = pd.Series(reference)
        self.test = get_stattest(self.reference, self.reference, self.type, None)

    def drifted(self, window: list[str]) -> bool:
        return bool(self.test(self.reference, self.pd.Series(window), self.type, None).drifted)


def language(args: argparse.Namespace, report: Report, peer_mod) -> None:
    rng = np.random.default_rng(0)
    train, held = code_files()
    docs = [np.asarray(ids(t), dtype=np.int64) for t in train]
    counts = np.bincount(np.concatenate(docs), minlength=256)
    reference = DriftReference.from_documents(counts, docs, seed=0)
    peer = LanguagePeer(excerpts(train, 500, rng), *peer_mod)
    prose = [r["text"] for r in map(json.loads, NOTES.read_text().splitlines()) if len(r.get("text") or "") > 300]
    print(f"language: {len(train)} training files, {len(held)} held-out, {len(prose)} prose notes", file=sys.stderr)

    ratios, detail = [], {}
    for size in (25, 100):
        monitor = DriftMonitor(reference, scales=(size,), min_requests=min(20, size), warmup=size,
                               false_alarm_rate=RATE, seed=1)
        ours = theirs = 0
        for _ in range(args.windows):
            window = excerpts(held, size, rng)
            for text in window:
                monitor.observe(ids(text), text)
            ours += monitor.report().drifting
            theirs += peer.drifted(window)
        ratios.append(rate_ratio(ours, theirs, args.windows))
        detail[f"window_{size}"] = {"runyard_alarms": ours, "evidently_alarms": theirs, "windows": args.windows}
        print(f"  language false alarms at {size} requests: runyard {ours}/{args.windows}, "
              f"evidently {theirs}/{args.windows}", file=sys.stderr)
    report.ratio("drift_false_alarms_language", Samples(ratios), "evidently text content drift", "<=", 1.0, detail)

    ratios, detail = [], {}
    for share in (0.25, 0.5, 1.0):
        delays = {"runyard": [], "evidently": []}
        for _ in range(args.trials):
            before = excerpts(held, 100, rng)
            after = [p if rng.random() < share else c
                     for p, c in zip(excerpts(prose, args.horizon, rng), excerpts(held, args.horizon, rng), strict=True)]
            delays["runyard"].append(_language_delay(reference, before, after, args))
            delays["evidently"].append(_window_delay(before, after, args.every, 100, peer.drifted, args.horizon))
        ours, theirs = float(np.median(delays["runyard"])), float(np.median(delays["evidently"]))
        ratios.append(ours / max(theirs, 1.0))
        detail[f"prose_share_{share}"] = {"runyard_median": ours, "evidently_median": theirs, **delays}
        print(f"  language delay, {share:.0%} prose: runyard {ours:g}, evidently {theirs:g} requests", file=sys.stderr)
    report.ratio("drift_delay_language", Samples(ratios), "evidently text content drift", "<=", 1.0, detail)


def _language_delay(reference: DriftReference, before: list[str], after: list[str], args: argparse.Namespace) -> int:
    """Requests after the shift until runyard's monitor, judged every `every` requests, alarms."""
    monitor = DriftMonitor(reference, false_alarm_rate=RATE, warmup=len(before), seed=2)
    for text in before:
        monitor.observe(ids(text), text)
    for i, text in enumerate(after, 1):
        monitor.observe(ids(text), text)
        if i % args.every == 0 and monitor.report().drifting:
            return i
    return args.horizon


def _window_delay(before: list, after: list, every: int, window: int, drifted, horizon: int) -> int:
    """Inputs after the shift until `drifted(last `window` inputs)`, judged every `every` inputs, is true."""
    stream = [*before, *after]
    for i in range(every, len(after) + 1, every):
        if drifted(stream[len(before) + i - window : len(before) + i]):
            return i
    return horizon


# ---- tables ---------------------------------------------------------------------------------------------

NUMERIC, CATEGORICAL = 6, 2


def table_rows(n: int, rng: np.random.Generator, shift: float = 0.0) -> np.ndarray:
    """Rows of a fixed generator: correlated gaussians, one skewed column, two categorical codes; `shift`
    moves feature 0's mean by that many standard deviations."""
    z = rng.normal(size=(n, NUMERIC))
    z[:, 1] = 0.7 * z[:, 0] + 0.3 * z[:, 1]
    z[:, 5] = np.exp(z[:, 5] / 2)
    z[:, 0] += shift
    cats = np.stack([rng.choice(4, size=n, p=[0.4, 0.3, 0.2, 0.1]), rng.choice(3, size=n, p=[0.6, 0.3, 0.1])], axis=1)
    return np.concatenate([z, cats.astype(np.float64)], axis=1)


class TablePeer:
    """Evidently's default column tests (KS numeric, chi-square categorical with a 1,000-row reference),
    Bonferroni-corrected to runyard's stated rate; `default_alarms` counts what p < 0.05 per column flags."""

    def __init__(self, reference: np.ndarray, pd, get_stattest, column_type):
        self.pd = pd
        kinds = [column_type.Numerical] * NUMERIC + [column_type.Categorical] * CATEGORICAL
        self.columns = [(pd.Series(reference[:, j]), kinds[j]) for j in range(reference.shape[1])]
        self.get_stattest = get_stattest
        self.threshold = RATE / len(self.columns)
        self.default_alarms = 0

    def drifted(self, window: np.ndarray) -> bool:
        window = np.asarray(window)
        any_default = any_corrected = False
        for j, (ref, kind) in enumerate(self.columns):
            cur = self.pd.Series(window[:, j])
            test = self.get_stattest(ref, cur, kind, None)
            score = test(ref, cur, kind, self.threshold).drift_score  # a p-value for KS and chi-square
            any_corrected |= score < self.threshold
            any_default |= score < test.default_threshold
        self.default_alarms += any_default
        return any_corrected


def table(args: argparse.Namespace, report: Report, peer_mod) -> None:
    rng = np.random.default_rng(3)
    train = table_rows(20_000, rng)
    names = [f"x{j}" for j in range(NUMERIC)] + [f"c{j}" for j in range(CATEGORICAL)]
    kinds = ["numeric"] * NUMERIC + ["categorical"] * CATEGORICAL
    reference = FeatureReference.build(train, names, kinds, [0] * NUMERIC + [4, 3], seed=0)
    peer = TablePeer(train[:1000], *peer_mod)

    ratios, detail = [], {}
    for size in (50, 200):
        monitor = FeatureDriftMonitor(reference, window=size, false_alarm_rate=RATE)
        ours = theirs = 0
        peer.default_alarms = 0
        for _ in range(args.windows):
            window = table_rows(size, rng)
            ours += bool(monitor.judge(window)[2])
            theirs += peer.drifted(window)
        ratios.append(rate_ratio(ours, theirs, args.windows))
        detail[f"window_{size}"] = {"runyard_alarms": ours, "evidently_alarms": theirs,
                                    "evidently_default_alarms": peer.default_alarms, "windows": args.windows}
        print(f"  table false alarms at {size} rows: runyard {ours}/{args.windows}, evidently {theirs}/{args.windows} "
              f"(uncorrected default: {peer.default_alarms})", file=sys.stderr)
        report.note(f"table, {size}-row windows: Evidently's uncorrected defaults (p < 0.05 per column) flagged "
                    f"{peer.default_alarms} of {args.windows} in-distribution windows")
    report.ratio("drift_false_alarms_table", Samples(ratios), "evidently KS/chi-square, Bonferroni", "<=", 1.0, detail)

    ratios, detail = [], {}
    window, every = 200, 10
    monitor = FeatureDriftMonitor(reference, window=window, false_alarm_rate=RATE)
    for shift in (0.25, 0.5, 1.0):
        delays = {"runyard": [], "evidently": []}
        for _ in range(args.trials):
            before, after = table_rows(window, rng), table_rows(args.horizon, rng, shift)
            delays["runyard"].append(_window_delay(list(before), list(after), every, window,
                                                   lambda rows: bool(monitor.judge(np.asarray(rows))[2]), args.horizon))
            delays["evidently"].append(_window_delay(list(before), list(after), every, window, peer.drifted, args.horizon))
        ours, theirs = float(np.median(delays["runyard"])), float(np.median(delays["evidently"]))
        ratios.append(ours / max(theirs, 1.0))
        detail[f"mean_shift_{shift}_sd"] = {"runyard_median": ours, "evidently_median": theirs, **delays}
        print(f"  table delay, mean +{shift} sd: runyard {ours:g}, evidently {theirs:g} rows", file=sys.stderr)
    report.ratio("drift_delay_table", Samples(ratios), "evidently KS/chi-square, Bonferroni", "<=", 1.0, detail)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    peer_mod = load_evidently(args.peer_path)
    report = Report("drift", args, packages=["evidently", "pandas", "scipy"])
    report.note(f"stated false-alarm rate {RATE} per window for both sides; windows {args.windows} per size, "
                f"{args.trials} streams per shift, misses count as {args.horizon}")
    if args.family in ("all", "language"):
        language(args, report, peer_mod)
    if args.family in ("all", "table"):
        table(args, report, peer_mod)
    report.note("images are not benchmarked here: Evidently has no image drift test to compare with")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
