"""Task metrics against hand computations and their baselines, and the fit-to-ship verdict."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runyard.evaluate.prediction import (
    calibration,
    evaluate_classification,
    evaluate_regression,
    prediction_verdict,
)
from runyard.spec.predictive import PredictionEvalSpec


def test_binary_metrics_and_the_class_frequency_baseline_by_hand():
    y = np.array([0, 0, 1, 1, 1, 0])
    p1 = np.array([0.1, 0.6, 0.8, 0.7, 0.3, 0.2])
    proba = np.stack([1 - p1, p1], axis=1)
    train_y = np.array([0, 0, 0, 1])  # prior 0.75 / 0.25
    r = evaluate_classification(y, proba, train_y, ["no", "yes"], PredictionEvalSpec())
    assert r.metrics["accuracy"] == pytest.approx(4 / 6)  # wrong: row 1 (0.6 -> yes), row 4 (0.3 -> no)
    # F1 of the positive class: tp 2, fp 1, fn 1 -> precision 2/3, recall 2/3
    assert r.metrics["f1"] == pytest.approx(2 / 3) and r.f1_average == "binary"
    expected_ll = -np.mean(np.log([0.9, 0.4, 0.8, 0.7, 0.3, 0.8]))
    assert r.metrics["log_loss"] == pytest.approx(expected_ll)
    # AUC: the share of (positive, negative) pairs in which the positive row scores higher
    pairs = [(p, n) for p in p1[y == 1] for n in p1[y == 0]]
    assert r.metrics["roc_auc"] == pytest.approx(sum(a > b for a, b in pairs) / len(pairs))
    assert r.baseline["accuracy"] == pytest.approx(3 / 6)  # always "no"
    assert r.baseline["log_loss"] == pytest.approx(-(3 * math.log(0.75) + 3 * math.log(0.25)) / 6)
    assert r.baseline["roc_auc"] == 0.5
    assert r.confusion == [[2, 1], [1, 2]]


def test_multiclass_metrics_average_and_calibration_by_hand():
    y = np.array([0, 1, 2, 2])
    proba = np.array([[0.8, 0.1, 0.1], [0.2, 0.5, 0.3], [0.1, 0.6, 0.3], [0.0, 0.1, 0.9]])
    r = evaluate_classification(y, proba, np.array([0, 1, 2]), ["a", "b", "c"], PredictionEvalSpec(calibration_bins=2))
    assert r.f1_average == "macro" and r.metrics["accuracy"] == 0.75
    # per class F1: a 1, b (tp1 fp1 fn0) 2/3, c (tp1 fp0 fn1) 2/3
    assert r.metrics["f1"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)
    cal = r.calibration  # top-label confidence 0.8, 0.5, 0.6, 0.9; correct 1, 1, 0, 1; bins [0, .5) [.5, 1]
    assert cal["counts"] == [4] and cal["predicted"] == [pytest.approx(0.7)] and cal["observed"] == [0.75]
    assert cal["ece"][0] == pytest.approx(0.05)


def test_regression_metrics_and_the_mean_baseline_by_hand():
    y = np.array([1.0, 2.0, 3.0, 4.0])
    pred = np.array([1.5, 2.0, 2.0, 5.0])
    r = evaluate_regression(y, pred, train_y=np.array([2.0, 2.0, 5.0]))  # mean 3
    assert r.metrics["rmse"] == pytest.approx(math.sqrt((0.25 + 0 + 1 + 1) / 4))
    assert r.metrics["mae"] == pytest.approx((0.5 + 0 + 1 + 1) / 4)
    assert r.metrics["r2"] == pytest.approx(1 - 2.25 / 5.0)
    assert r.baseline["rmse"] == pytest.approx(math.sqrt((4 + 1 + 0 + 1) / 4))


def test_the_verdict_names_each_failing_bound_and_the_baseline_margin():
    y = np.array([0, 1] * 10)
    proba = np.tile([[0.45, 0.55], [0.55, 0.45]], (10, 1))[:, ::-1]  # right 100%, barely confident
    r = evaluate_classification(y, proba, y, ["x", "y"], PredictionEvalSpec())
    ok = prediction_verdict(r, PredictionEvalSpec(min_accuracy=0.9, baseline_margin=0.1))
    # log loss -ln(0.55) = 0.598 against the baseline's ln 2 = 0.693: 13.7% lower, and 10% is asked
    assert ok.fit_to_ship and ok.reasons == [] and len(ok.passed) == 2
    assert not prediction_verdict(r, PredictionEvalSpec(baseline_margin=0.2)).fit_to_ship
    strict = prediction_verdict(r, PredictionEvalSpec(min_accuracy=0.9, max_log_loss=0.1, min_r2=0.5, baseline_margin=0.5))
    assert not strict.fit_to_ship
    text = " ".join(strict.reasons)
    assert "log loss 0.5978 against the bound 0.1 (eval.prediction.max_log_loss)" in text
    assert "R² is not available for this classification run" in text
    assert "needs at least 50% (eval.prediction.baseline_margin)" in text
    assert any("accuracy 1.0000 against the bound 0.9" in line for line in strict.passed)


def test_calibration_of_a_binary_model_bins_the_positive_probability():
    y = np.array([0, 1, 1, 0])
    proba = np.array([[0.9, 0.1], [0.2, 0.8], [0.4, 0.6], [0.3, 0.7]])
    cal = calibration(y, proba, bins=2)
    assert cal["counts"] == [1, 3] and cal["observed"] == [0.0, pytest.approx(2 / 3)]
