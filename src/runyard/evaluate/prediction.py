"""Held-out metrics of the tabular and image tasks, each against a stated baseline, and the fit-to-ship
verdict against the spec's `eval.prediction` bounds.

Classification: accuracy, F1, ROC AUC and log loss (scikit-learn's implementations), a confusion matrix
and calibration figures. The baseline predicts the training split's class frequencies for every row (its
accuracy is the majority class's). Regression: RMSE, MAE and R²; the baseline predicts the training mean.
`must_beat_baseline` compares the loss (log loss, or RMSE) with the baseline's.

scikit-learn is the optional extra runyard[predict], which every tabular and image run has; it is loaded
when metrics are first computed, so that importing the run's modules needs no extra.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from runyard.errors import RunyardError
from runyard.evaluate.report import Verdict
from runyard.spec.predictive import PredictionEvalSpec
from runyard.train.gates import compared


def _sklearn_metrics() -> ModuleType:
    try:
        return importlib.import_module("sklearn.metrics")
    except ImportError as exc:
        raise RunyardError(f"held-out metrics of a table or image model need scikit-learn: "
                           f"pip install 'runyard[predict]' ({exc})") from None


MAJORITY, MEAN = "class frequencies of the training split (majority class for accuracy)", "mean of the training split"


@dataclass(frozen=True)
class PredictionMetrics:
    """One model's metrics on the test split; `baseline` holds the same metrics of the baseline, and
    `others` those of further models shown beside it (the linear model beside the trees)."""

    task: str
    rows: int
    metrics: dict[str, float | None]
    baseline: dict[str, float | None]
    baseline_name: str
    loss_name: str  # "log_loss" or "rmse": what must_beat_baseline compares
    classes: list[str] | None = None
    f1_average: str | None = None
    confusion: list[list[int]] | None = None
    calibration: dict[str, list[float]] | None = None
    others: dict[str, dict[str, float | None]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _f1_average(setting: str, n_classes: int) -> str:
    if setting == "auto":
        return "binary" if n_classes == 2 else "macro"
    if setting == "binary" and n_classes != 2:
        return "macro"
    return setting


def classification_scores(y: np.ndarray, proba: np.ndarray, n_classes: int, average: str,
                          notes: list[str] | None = None) -> dict[str, float | None]:
    """accuracy, f1, roc_auc (None when the test split lacks a class) and log_loss of probabilities."""
    skm = _sklearn_metrics()
    labels = list(range(n_classes))
    predicted = proba.argmax(axis=1)
    out: dict[str, float | None] = {
        "accuracy": float(skm.accuracy_score(y, predicted)),
        "f1": float(skm.f1_score(y, predicted, labels=labels, average=average, pos_label=1, zero_division=0)),
        "log_loss": float(skm.log_loss(y, proba, labels=labels)),
    }
    try:
        if n_classes == 2:
            out["roc_auc"] = float(skm.roc_auc_score(y, proba[:, 1]))
        else:
            out["roc_auc"] = float(skm.roc_auc_score(y, proba, multi_class="ovr", average="macro", labels=labels))
    except ValueError as exc:  # a class absent from the test split: AUC is undefined for it
        out["roc_auc"] = None
        if notes is not None:
            notes.append(f"ROC AUC undefined on this test split: {exc}")
    return out


def regression_scores(y: np.ndarray, prediction: np.ndarray) -> dict[str, float | None]:
    skm = _sklearn_metrics()
    return {
        "rmse": float(np.sqrt(skm.mean_squared_error(y, prediction))),
        "mae": float(skm.mean_absolute_error(y, prediction)),
        "r2": float(skm.r2_score(y, prediction)) if len(y) > 1 else None,
    }


def calibration(y: np.ndarray, proba: np.ndarray, bins: int) -> dict[str, list[float]]:
    """Reliability figures: binary, the positive class's predicted probability against its observed
    frequency; multiclass, the top class's confidence against its accuracy (top-label calibration). Bins
    of equal width; empty ones left out. Also the expected calibration error (ECE)."""
    if proba.shape[1] == 2:
        confidence, hit, label = proba[:, 1], (y == 1).astype(np.float64), "positive class"
    else:
        confidence, hit, label = proba.max(axis=1), (proba.argmax(axis=1) == y).astype(np.float64), "top class"
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(confidence, edges[1:-1]), 0, bins - 1)
    mean_pred, observed, counts = [], [], []
    for b in range(bins):
        sel = which == b
        if sel.any():
            mean_pred.append(float(confidence[sel].mean()))
            observed.append(float(hit[sel].mean()))
            counts.append(int(sel.sum()))
    ece = sum(c * abs(p - o) for p, o, c in zip(mean_pred, observed, counts, strict=True)) / max(1, len(y))
    return {"predicted": mean_pred, "observed": observed, "counts": counts, "ece": [float(ece)], "of": [label]}


def evaluate_classification(y: np.ndarray, proba: np.ndarray, train_y: np.ndarray, classes: list[str],
                            thresholds: PredictionEvalSpec) -> PredictionMetrics:
    skm = _sklearn_metrics()
    n = len(classes)
    average = _f1_average(thresholds.f1_average, n)
    notes: list[str] = []
    prior = np.bincount(train_y.astype(np.int64), minlength=n) / max(1, len(train_y))
    base = np.tile(prior, (len(y), 1))
    return PredictionMetrics(
        task="classification", rows=len(y),
        metrics=classification_scores(y, proba, n, average, notes),
        baseline=classification_scores(y, base, n, average),
        baseline_name=MAJORITY, loss_name="log_loss", classes=classes, f1_average=average,
        confusion=skm.confusion_matrix(y, proba.argmax(axis=1), labels=list(range(n))).tolist(),
        calibration=calibration(y, proba, thresholds.calibration_bins), notes=notes,
    )


def evaluate_regression(y: np.ndarray, prediction: np.ndarray, train_y: np.ndarray) -> PredictionMetrics:
    return PredictionMetrics(
        task="regression", rows=len(y), metrics=regression_scores(y, prediction),
        baseline=regression_scores(y, np.full(len(y), float(np.mean(train_y)))),
        baseline_name=MEAN, loss_name="rmse",
    )


_BOUNDS = (  # (field, metric, is a lower bound, words)
    ("min_accuracy", "accuracy", True, "accuracy"),
    ("min_f1", "f1", True, "F1"),
    ("min_roc_auc", "roc_auc", True, "ROC AUC"),
    ("max_log_loss", "log_loss", False, "log loss"),
    ("max_rmse", "rmse", False, "RMSE"),
    ("max_mae", "mae", False, "MAE"),
    ("min_r2", "r2", True, "R²"),
)


def prediction_verdict(result: PredictionMetrics, thresholds: PredictionEvalSpec) -> Verdict:
    """Every bound the spec sets must hold (a bound on a metric the task does not have is named as
    failing), and with must_beat_baseline the loss must be baseline_margin below the baseline's."""
    reasons, passed = [], []
    for field_name, metric, lower, words in _BOUNDS:
        bound = getattr(thresholds, field_name)
        if bound is None:
            continue
        value = result.metrics.get(metric)
        if value is None:
            reasons.append(f"{words} is not available for this {result.task} run, but eval.prediction.{field_name} "
                           f"bounds it")
            continue
        ok = value >= bound if lower else value <= bound
        line = f"{words} {value:.4f} against the bound {bound} (eval.prediction.{field_name})"
        (passed if ok else reasons).append(line)
    if thresholds.must_beat_baseline:
        loss, base = result.metrics[result.loss_name], result.baseline[result.loss_name]
        needed = base * (1 - thresholds.baseline_margin)
        line = (f"{result.loss_name} {loss:.4f} is {compared(loss, base)} the baseline's {base:.4f} ({result.baseline_name}); "
                f"fit to ship needs at least {thresholds.baseline_margin:.0%} (eval.prediction.baseline_margin)")
        (passed if loss < base and loss <= needed else reasons).append(line)
    return Verdict(fit_to_ship=not reasons, reasons=reasons, passed=passed)
