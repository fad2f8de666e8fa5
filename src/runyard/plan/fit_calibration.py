"""Calibration of a family fit by its own library (trees, the linear model): real fits of row samples of the
user's own table, timed here, and scaled to the whole table.

The model of a fit's time: each round (a tree, or one tree per class) reads every training row, so a fit of
`R` rounds on `n` rows takes `R x (a + b x n)` seconds; the linear model is one "round", `a + b x n`. Two
sample sizes give the two constants: the larger sample `n2` (every training row when the table has at most
SAMPLE_ROWS of them, the table itself then) is fit with the spec's own config, early stopping included, on
the split's own validation rows, and gives `R`, the rounds early stopping keeps training; the smaller one,
`n1 = n2 / 2`, is fit for exactly those `R` rounds (no early stopping). The per-round time at the two sizes
gives the slope `b` (seconds per row per round) and the intercept `a`. The whole table's fit is then
`R x (a + b x N)`: exactly the measured fit when the sample is the table, extrapolated in rows (with the
sample's rounds) when it is larger.

Both fits repeat while `budget_s` lasts (at least once each); the medians are used and the spread of the
larger fit's repeats (interquartile range, or max - min, over the median) is reported as the figure's
stability. Rows are taken at a fixed stride of the prepared training split (the run's own reader and
encoding, plan/task_data.py); the validation rows are the split's own, capped at SAMPLE_ROWS.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from runyard.data.tabular import PreparedTable
from runyard.model.registry import ModelFamily
from runyard.model.tabular import TableFacts
from runyard.plan.calibrate import relative_spread

SAMPLE_ROWS = 20_000  # the larger sample's training rows at most: a table this size is fit whole
MIN_SAMPLE_ROWS = 20  # below this the smaller sample is too small to time a slope; one size is used


@dataclass(frozen=True)
class FitCalibration:
    """A family's fit timed on samples of the table here, and the whole table's fit it predicts."""

    family: str
    rows: tuple[int, int]  # the two samples' training rows (small, large)
    seconds: tuple[float, float]  # the median fit of each (both `rounds` rounds)
    rounds: int  # rounds the larger fit trained before early stopping (1 for the linear model)
    best_round: int  # the round early stopping kept
    per_round_s: float  # a: seconds a round costs regardless of rows
    per_row_round_s: float  # b: seconds per training row per round
    train_rows: int  # the whole table's training rows
    estimate_s: float  # R x (a + b x train_rows)
    repeats: int  # fits of the larger sample timed
    spread: float  # their stability (interquartile range, or max - min, over the median)
    wall_s: float

    def describe(self) -> str:
        small, large = self.rows
        per_row = (f"{self.per_row_round_s * 1e6:.3g} us a row a round + {self.per_round_s * 1e3:.3g} ms a round"
                   if self.rounds > 1 else f"{self.per_row_round_s * 1e6:.3g} us a row + {self.per_round_s * 1e3:.3g} ms")
        rounds = (f", {self.rounds} rounds (early stopping kept round {self.best_round})" if self.rounds > 1 else "")
        whole = "the table itself" if large >= self.train_rows else f"scaled to {self.train_rows:,} rows"
        return (f"calibrated: real fits here of {small:,} and {large:,} training rows ({self.seconds[0]:.3g} s and "
                f"{self.seconds[1]:.3g} s{rounds}): {per_row}, {whole}; "
                f"{self.repeats} fit{'s' if self.repeats != 1 else ''} of the larger sample, spread "
                f"{self.spread:.0%}")


def table_facts_of(prepared: PreparedTable) -> TableFacts:
    """What a tabular config needs from a prepared table (as the run's stage reads it)."""
    schema = prepared.schema
    return TableFacts(len(schema.features), tuple(schema.categorical_indices),
                      len(schema.classes) if schema.classes else None, tuple(schema.names))


def _rows(x: np.ndarray, y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` rows at an even stride (the split is shuffled already; a stride keeps every class's share)."""
    if n >= len(y):
        return x, y
    index = np.linspace(0, len(y) - 1, n).astype(np.int64)
    return x[index], y[index]


def _fixed_rounds(config: Any, rounds: int) -> Any:
    """The config fit for exactly `rounds` rounds (trees: no early stopping); the linear model as it is."""
    if hasattr(config, "num_boost_round"):
        return dataclasses.replace(config, num_boost_round=max(1, rounds), early_stopping_rounds=None)
    return config


def _timed_fit(family: ModelFamily, config: Any, x, y, vx, vy, seed: int, threads: int | None) -> tuple[float, Any]:
    t0 = time.perf_counter()
    fitted = family.fit(config, x, y, vx, vy, seed, threads)
    return time.perf_counter() - t0, fitted


def calibrate_fit(family: ModelFamily, config: Any, prepared: PreparedTable, seed: int, threads: int | None,
                  budget_s: float = 3.0) -> FitCalibration:
    """Time `family`'s fit of `config` on two row samples of `prepared` here (see the module doc)."""
    started = time.perf_counter()
    train_rows = prepared.train.rows
    large = max(1, min(train_rows, SAMPLE_ROWS))
    small = large // 2 if large // 2 >= MIN_SAMPLE_ROWS else large
    x2, y2 = _rows(prepared.train.x, prepared.train.y, large)
    x1, y1 = _rows(prepared.train.x, prepared.train.y, small)
    vx, vy = _rows(prepared.valid.x, prepared.valid.y, SAMPLE_ROWS)
    # The spec's own fit (early stopping included) on the larger sample: its time and its rounds.
    first, fitted = _timed_fit(family, config, x2, y2, vx, vy, seed, threads)
    rounds = max(1, int(fitted.details.get("rounds_trained", 1)))
    best = int(fitted.best_step)
    fixed = _fixed_rounds(config, rounds)
    larges, smalls = [first], []
    while not smalls or time.perf_counter() - started < budget_s:
        smalls.append(_timed_fit(family, fixed, x1, y1, vx, vy, seed, threads)[0])
        if small == large or time.perf_counter() - started >= budget_s:
            break
        larges.append(_timed_fit(family, fixed, x2, y2, vx, vy, seed, threads)[0])
        if len(larges) >= 50:
            break
    if small == large:
        larges += smalls
    t2, t1 = float(np.median(larges)), float(np.median(smalls))
    # Both constants non-negative, and the line through the larger sample's own time, so that a table the
    # sample holds is estimated by its own measured fit.
    slope = (t2 - t1) / rounds / (large - small) if large > small else t2 / rounds / large
    slope = min(max(0.0, slope), t2 / rounds / large)
    intercept = t2 / rounds - slope * large
    estimate = rounds * (intercept + slope * train_rows)
    return FitCalibration(family.name, (small, large), (t1, t2), rounds, best, intercept, slope, train_rows, estimate,
                          len(larges), relative_spread(larges), time.perf_counter() - started)
