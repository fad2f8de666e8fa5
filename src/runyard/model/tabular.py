"""What the tabular families (gradient-boosted trees, the linear model) share: they are fit by their own
library rather than by runyard's loop, on the feature matrix the data stage encodes
(runyard.data.table_schema), and follow scikit-learn's estimator contract: a fitted model's `predict`
gives class probabilities [rows, classes] for classification and values [rows] for regression.

A fit reports its history as metrics rows (`step`, `loss` on the training rows, `heldout_loss` on the
validation rows), the same rows the loop writes, so a stage's gates read them the same way.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from runyard.model.registry import ModelFamily, NotTrainedByLoop


class TabularModel(Protocol):
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Probabilities [rows, classes] (classification) or predictions [rows] (regression)."""


@dataclass(frozen=True)
class TableFacts:
    """What a tabular config needs from the prepared data."""

    n_features: int
    categorical: tuple[int, ...]  # indices of categorical features (their values are category codes)
    n_classes: int | None  # None: regression
    feature_names: tuple[str, ...] = ()


@dataclass
class FitResult:
    model: Any
    history: list[dict[str, float]]  # one row per round: step, loss, heldout_loss
    best_step: int
    details: dict[str, Any] = field(default_factory=dict)


def loss_name(n_classes: int | None) -> str:
    return "log loss (nats per row)" if n_classes else "mean squared error"


def table_loss(n_classes: int | None, prediction: np.ndarray, y: np.ndarray) -> float:
    """Mean log loss (classification, probabilities clipped as LightGBM and scikit-learn clip them) or
    mean squared error (regression): the loss every tabular family's history reports."""
    if n_classes:
        p = np.clip(prediction[np.arange(len(y)), y.astype(np.int64)], 1e-15, 1.0)
        return float(-np.log(p).mean())
    return float(np.mean((prediction - y) ** 2))


class TabularFamily(ModelFamily):
    """A family fit by its own library; `fit` replaces the loop."""

    trains_with_loop: ClassVar[bool] = False
    tasks = ("tabular_classification", "tabular_regression")

    @abstractmethod
    def fit(self, config: Any, train_x: np.ndarray, train_y: np.ndarray, valid_x: np.ndarray, valid_y: np.ndarray,
            seed: int, threads: int | None) -> FitResult:
        """Fit on the training rows, using the validation rows for early stopping (where the family has
        it) and for the history's held-out loss."""

    def build(self, config: Any) -> Any:
        raise NotTrainedByLoop(f"model family {self.name!r} is fit by its library: use fit()")
