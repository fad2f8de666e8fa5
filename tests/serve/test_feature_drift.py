"""Feature drift of tables and images: the statistics against hand computations, held-out rows for the
null, a stated false-alarm rate measured over 500 in-distribution windows per family and window size
(all features judged together), detection of a shifted feature mean and of brighter images within a
bounded number of rows, and an event naming what moved."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runyard.serve.feature_drift import JS_FLOOR, PSI_FLOOR, FeatureDriftMonitor, FeatureReference
from runyard.serve.predict_export import image_drift_features

RATE = 0.01
WINDOWS = 500


def reference(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    x = np.stack([rng.normal(size=n), rng.integers(0, 4, size=n).astype(float)], axis=1)
    return FeatureReference.build(x, ["num", "cat"], ["numeric", "categorical"], [0, 4], seed=1), x


def table_rows(n: int, rng: np.random.Generator, mean_shift: float = 0.0) -> np.ndarray:
    """A table's rows: a normal, a skewed (log-normal) with 5% missing, a categorical of 5 uneven
    categories, and an integer count; `mean_shift` moves the normal's mean by that many sds."""
    skewed = rng.lognormal(0, 1, size=n)
    skewed[rng.random(n) < 0.05] = np.nan
    return np.stack([rng.normal(mean_shift, 1, size=n), skewed,
                     rng.choice(5, size=n, p=[0.4, 0.3, 0.15, 0.1, 0.05]).astype(float),
                     rng.poisson(3, size=n).astype(float)], axis=1)


def table_reference(seed: int = 0) -> FeatureReference:
    x = table_rows(6000, np.random.default_rng(seed))
    return FeatureReference.build(x, ["normal", "skewed", "city", "visits"], ["numeric", "numeric", "categorical", "numeric"],
                                  [0, 0, 5, 0], seed=seed)


def images(n: int, rng: np.random.Generator, brighter: float = 0.0) -> np.ndarray:
    """n 3-channel 8x8 images: per-image, per-channel brightness and texture; `brighter` adds to every pixel."""
    base = rng.uniform(0.3, 0.6, size=(n, 3, 1, 1)) + brighter
    return np.clip(base + rng.normal(0, 1, size=(n, 3, 8, 8)) * rng.uniform(0.05, 0.15, size=(n, 1, 1, 1)), 0, 1)


def image_reference(seed: int = 0) -> FeatureReference:
    features, names = image_drift_features(images(4000, np.random.default_rng(seed)))
    return FeatureReference.build(features, names, ["numeric"] * len(names), [0] * len(names), seed=seed)


def binomial_upper(n: int, rate: float, confidence: float = 0.999) -> int:
    """The count of alarms that n judgements at `rate` stay at or under with `confidence`."""
    total = 0.0
    for k in range(n + 1):
        total += math.comb(n, k) * rate**k * (1 - rate) ** (n - k)
        if total >= confidence:
            return k
    return n


def test_psi_and_js_match_hand_computations():
    ref, x = reference()
    num, cat = ref.features
    assert len(num.edges) == 9 and sum(num.counts) == 500  # decile bins (10) plus the missing bin, of the histogram half
    live = np.full(100, 10.0)  # every live value above the top decile: all in the last bin
    expected_share = np.maximum(np.asarray(num.counts) / 500, 1e-4)
    live_share = np.maximum(np.bincount([9], minlength=11) * 1.0, 1e-4)
    psi = float(np.sum((live_share - expected_share) * np.log(live_share / expected_share)))
    assert num.statistic(num.histogram(live)) == pytest.approx(psi)
    # All live rows in category 0: JS(p, q) in bits by hand.
    p = np.asarray(cat.counts, dtype=float) / sum(cat.counts)
    q = np.array([1.0, 0, 0, 0, 0])
    m = (p + q) / 2
    js = 0.5 * sum(a * math.log2(a / b) for a, b in zip(p, m, strict=True) if a > 0) + 0.5 * math.log2(1 / m[0])
    assert cat.statistic(cat.histogram(np.zeros(50))) == pytest.approx(js)


def test_the_null_rows_are_held_out_from_the_histograms():
    ref, x = reference()
    assert ref.heldout and len(ref.sample) == 500
    held = {tuple(r) for r in ref.sample}
    body = [r for r in x if tuple(r) not in held]
    assert len(body) == 500 and sum(ref.features[0].counts) == len(body)
    # The histogram is the body's, not the whole sample's.
    assert ref.features[1].counts[:4] == np.bincount(np.asarray(body)[:, 1].astype(int), minlength=4).tolist()


def test_thresholds_are_higher_for_small_windows_and_never_below_the_floors():
    ref, x = reference()
    monitor = FeatureDriftMonitor(ref)
    small, large = monitor.thresholds((30,))[0], monitor.thresholds((50, 200, 1000))[-1]
    assert small[0] > large[0] >= PSI_FLOOR and small[1] >= large[1] >= JS_FLOOR
    assert monitor.sizes_for(29) == () and monitor.sizes_for(40) == (30,) and monitor.sizes_for(120) == (50, 100)
    assert monitor.sizes_for(5000) == (50, 200, 1000)
    monitor.observe(x[:40])
    status = monitor.status()
    assert status["judged"] and status["drifting"] == [] and status["window_rows"] == 30 and status["rows_in_window"] == 40
    assert status["false_alarm_rate"] == RATE and status["null_rows"] == "held-out training rows"
    # Unseen category values count in the NaN bucket and are reported.
    monitor.observe(np.column_stack([np.zeros(200), np.full(200, np.nan)]), [{"feature": "cat"}] * 200)
    status = monitor.status()
    assert set(status["drifting"]) == {"num", "cat"} and status["features"]["cat"]["unseen_values"] == 200
    assert status["windows_judged"] == [50, 200] and status["features"]["num"]["window_rows"] in (50, 200)
    moved = status["features"]["num"]["moved"]
    assert moved["live"]["mean"] == 0.0 and abs(moved["training"]["mean"]) < 0.2
    assert status["features"]["cat"]["moved"]["categories"][0] == {
        "category": "(missing or unseen)", "live_share": 1.0, "training_share": 0.0}
    # The events: judged every 50 rows, one when drift first shows, naming what moved.
    assert len(status["events"]) == 1 and set(status["events"][0]["features"]) == {"num", "cat"}


def test_a_reference_survives_save_and_load(tmp_path):
    ref, _x = reference()
    ref.save(tmp_path)
    loaded = FeatureReference.load(tmp_path)
    assert loaded.features == ref.features and np.array_equal(loaded.sample, ref.sample, equal_nan=True)
    assert loaded.heldout


def alarms(monitor: FeatureDriftMonitor, draw, size: int) -> int:
    """Alarms over `WINDOWS` judgements of `size` fresh rows (every window size that fits, judged together)."""
    count = 0
    for _ in range(WINDOWS):
        judged, _features, drifting = monitor.judge(draw(size))
        assert judged[-1] == size
        count += bool(drifting)
    return count


@pytest.mark.parametrize("size", [30, 100, pytest.param(500, marks=pytest.mark.full)])
def test_in_distribution_table_rows_alarm_at_most_at_the_stated_rate(size):
    """500 windows of fresh rows from the training distribution, every feature judged together: the
    alarm count stays within what a 1% rate allows (a 99.9% binomial bound)."""
    monitor = FeatureDriftMonitor(table_reference(), window=1000)
    rng = np.random.default_rng(size)
    count = alarms(monitor, lambda n: table_rows(n, rng), size)
    print(f"table: {count} alarms in {WINDOWS} windows of {size} rows")  # the figure, with -s
    assert count <= binomial_upper(WINDOWS, RATE), f"{count} alarms in {WINDOWS} windows of {size} rows"


@pytest.mark.parametrize("size", [30, 100, pytest.param(500, marks=pytest.mark.full)])
def test_in_distribution_images_alarm_at_most_at_the_stated_rate(size):
    monitor = FeatureDriftMonitor(image_reference(), window=1000)
    rng = np.random.default_rng(size)
    count = alarms(monitor, lambda n: image_drift_features(images(n, rng))[0], size)
    print(f"image: {count} alarms in {WINDOWS} windows of {size} images")  # the figure, with -s
    assert count <= binomial_upper(WINDOWS, RATE), f"{count} alarms in {WINDOWS} windows of {size} images"


def delay(monitor: FeatureDriftMonitor, batches, limit: int) -> int:
    """Rows sent (in batches of 10, after 500 in-distribution rows) until /v1/drift says drifting."""
    for rows in batches(500, shifted=False):
        monitor.observe(rows)
    assert monitor.status()["drifting"] == []
    sent = 0
    while sent < limit:
        monitor.observe(batches(10, shifted=True)[0])
        sent += 10
        if monitor.status()["drifting"]:
            return sent
    return sent + 1


@pytest.mark.parametrize(("shift", "bound"), [(1.0, 60), (0.5, 300)])
def test_a_shifted_feature_mean_is_found_within_a_bounded_number_of_rows(shift, bound):
    monitor = FeatureDriftMonitor(table_reference(), window=500)
    rng = np.random.default_rng(7)
    rows = delay(monitor, lambda n, shifted: [table_rows(n, rng, shift if shifted else 0.0)], bound)
    print(f"table: mean shift {shift} sd found after {rows} rows")  # the figure, with -s
    assert rows <= bound, f"a {shift} sd shift of one feature's mean not found in {bound} rows"
    status = monitor.status()
    assert status["drifting"][0] == "normal"
    assert status["features"]["normal"]["moved"]["live"]["mean"] > status["features"]["normal"]["moved"]["training"]["mean"]


@pytest.mark.parametrize(("brighter", "bound"), [(0.1, 60), (0.05, 200)])
def test_brighter_images_are_found_within_a_bounded_number_of_images(brighter, bound):
    monitor = FeatureDriftMonitor(image_reference(), window=500)
    rng = np.random.default_rng(8)
    sent = delay(monitor, lambda n, shifted: [image_drift_features(images(n, rng, brighter if shifted else 0.0))[0]], bound)
    print(f"image: brightness +{brighter} found after {sent} images")  # the figure, with -s
    assert sent <= bound, f"images {brighter} brighter not found in {bound} images"
    assert monitor.status()["drifting"][0].startswith("mean_c")
