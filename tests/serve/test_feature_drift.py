"""Feature drift statistics against hand computations: PSI over the training deciles, Jensen-Shannon
divergence over categories, and thresholds that grow for small windows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runyard.serve.feature_drift import JS_FLOOR, PSI_FLOOR, FeatureDriftMonitor, FeatureReference


def reference(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    x = np.stack([rng.normal(size=n), rng.integers(0, 4, size=n).astype(float)], axis=1)
    return FeatureReference.build(x, ["num", "cat"], ["numeric", "categorical"], [0, 4], seed=1), x


def test_psi_and_js_match_hand_computations():
    ref, x = reference()
    num, cat = ref.features
    assert len(num.edges) == 9 and sum(num.counts) == 1000  # decile bins (10) plus the missing bin
    live = np.full(100, 10.0)  # every live value above the top decile: all in the last bin
    expected_share = np.maximum(np.asarray(num.counts) / 1000, 1e-4)
    live_share = np.maximum(np.bincount([9], minlength=11) * 1.0, 1e-4)
    psi = float(np.sum((live_share - expected_share) * np.log(live_share / expected_share)))
    assert num.statistic(num.histogram(live)) == pytest.approx(psi)
    # All live rows in category 0: JS(p, q) in bits by hand.
    p = np.asarray(cat.counts, dtype=float) / sum(cat.counts)
    q = np.array([1.0, 0, 0, 0, 0])
    m = (p + q) / 2
    js = 0.5 * sum(a * math.log2(a / b) for a, b in zip(p, m, strict=True) if a > 0) + 0.5 * math.log2(1 / m[0])
    assert cat.statistic(cat.histogram(np.zeros(50))) == pytest.approx(js)


def test_thresholds_are_higher_for_small_windows_and_never_below_the_floors():
    ref, x = reference()
    monitor = FeatureDriftMonitor(ref)
    small, large = monitor.thresholds(30), monitor.thresholds(1000)
    assert small[0] > large[0] >= PSI_FLOOR and small[1] >= large[1] >= JS_FLOOR
    monitor.observe(x[:40])
    status = monitor.status()
    assert status["judged"] and status["drifting"] == [] and status["window_rows"] == 40
    # Unseen category values count in the NaN bucket and are reported.
    monitor.observe(np.column_stack([np.zeros(200), np.full(200, np.nan)]), [{"feature": "cat"}] * 200)
    status = monitor.status()
    assert set(status["drifting"]) == {"num", "cat"} and status["features"]["cat"]["unseen_values"] == 200


def test_a_reference_survives_save_and_load(tmp_path):
    ref, _x = reference()
    ref.save(tmp_path)
    loaded = FeatureReference.load(tmp_path)
    assert loaded.features == ref.features and np.array_equal(loaded.sample, ref.sample, equal_nan=True)
