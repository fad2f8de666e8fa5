"""A linear model through scikit-learn (family `linear`), and the baseline the trees are compared with.

Numeric features: missing values imputed with the training median, then standardised; categorical
features (category codes): one-hot, a category never seen in training all zeros. Then logistic
regression (classification) or ridge regression. The fitted pipeline's numbers (medians, means, scales,
categories, coefficients, intercepts) are the export, `linear.json`: no pickle, and the prediction is
the same few lines of numpy whether the model was just fit or loaded (a test holds them equal to
scikit-learn's own `predict_proba`). scikit-learn's pipeline object stays on the in-memory model for the
ONNX converter (skl2onnx).

scikit-learn is the optional extra `runyard[predict]`; runyard.model registers this family lazily.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.compose import ColumnTransformer
from sklearn.impute import SimpleImputer
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from runyard.model.registry import ExportError, Sizing, register
from runyard.model.tabular import FitResult, TableFacts, TabularFamily, table_loss
from runyard.spec.predictive import LinearSpec

MODEL_FILE = "linear.json"


@dataclass(frozen=True)
class LinearConfig:
    n_features: int
    categorical: tuple[int, ...]
    n_classes: int | None
    l2: float
    max_iter: int

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "categorical": list(self.categorical)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinearConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"a linear config has keys {sorted(names)}, got {got}")
        return cls(**{**data, "categorical": tuple(data["categorical"])})

    @property
    def numeric(self) -> list[int]:
        return [i for i in range(self.n_features) if i not in set(self.categorical)]


@dataclass
class LinearModel:
    """The fitted numbers; `pipeline` is scikit-learn's fitted object when the model was just fit."""

    params: dict[str, Any]
    pipeline: Any = None

    def design(self, x: np.ndarray) -> np.ndarray:
        p = self.params
        x = np.asarray(x, dtype=np.float64)
        numeric = x[:, p["numeric"]]
        numeric = np.where(np.isnan(numeric), np.asarray(p["medians"]), numeric)
        parts = [(numeric - np.asarray(p["means"])) / np.asarray(p["scales"])]
        for index, categories in zip(p["categorical"], p["categories"], strict=True):
            parts.append((x[:, [index]] == np.asarray(categories)[None, :]).astype(np.float64))
        return np.concatenate(parts, axis=1)

    def predict(self, x: np.ndarray) -> np.ndarray:
        p = self.params
        scores = self.design(x) @ np.asarray(p["coef"]).T + np.asarray(p["intercept"])
        if p["n_classes"] is None:
            return scores[:, 0]
        if p["n_classes"] == 2:  # scikit-learn's binary model: one score for the positive class
            positive = 1.0 / (1.0 + np.exp(-scores[:, 0]))
            return np.stack([1.0 - positive, positive], axis=1)
        shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)


def _pipeline(config: LinearConfig, seed: int) -> Pipeline:
    steps = []
    if config.numeric:
        steps.append(("numeric", Pipeline([("impute", SimpleImputer(strategy="median", keep_empty_features=True)),
                                           ("scale", StandardScaler())]), config.numeric))
    if config.categorical:
        steps.append(("categorical", OneHotEncoder(handle_unknown="ignore", sparse_output=False), list(config.categorical)))
    estimator = (Ridge(alpha=config.l2) if config.n_classes is None
                 else LogisticRegression(C=1.0 / config.l2, max_iter=config.max_iter, random_state=seed % 2**32))
    return Pipeline([("features", ColumnTransformer(steps)), ("model", estimator)])


def _params(config: LinearConfig, pipeline: Pipeline) -> dict[str, Any]:
    columns = pipeline.named_steps["features"]
    estimator = pipeline.named_steps["model"]
    params: dict[str, Any] = {"n_classes": config.n_classes, "numeric": config.numeric,
                              "categorical": list(config.categorical), "medians": [], "means": [], "scales": [],
                              "categories": []}
    if config.numeric:
        numeric = columns.named_transformers_["numeric"]
        params["medians"] = numeric.named_steps["impute"].statistics_.tolist()
        params["means"] = numeric.named_steps["scale"].mean_.tolist()
        params["scales"] = numeric.named_steps["scale"].scale_.tolist()
    if config.categorical:
        params["categories"] = [c.tolist() for c in columns.named_transformers_["categorical"].categories_]
    params["coef"] = np.atleast_2d(estimator.coef_).tolist()
    params["intercept"] = np.atleast_1d(estimator.intercept_).tolist()
    return params


class LinearFamily(TabularFamily):
    name = "linear"
    why_recommended = "a regularised linear model, which learns from few rows"

    def config_from_spec(self, spec: Any, *, table: TableFacts | None = None, **data_facts: Any) -> LinearConfig:
        if table is None:
            raise ValueError("the linear model's config needs the prepared table's facts (features, classes)")
        section = spec.linear or LinearSpec()
        return LinearConfig(table.n_features, tuple(table.categorical), table.n_classes, section.l2, section.max_iter)

    def config_from_dict(self, data: dict[str, Any]) -> LinearConfig:
        return LinearConfig.from_dict(data)

    def sizing(self, config: LinearConfig, micro_batch: int = 1) -> Sizing:
        """Coefficients per output (a class, or the value) per feature (one-hot categories counted once:
        their number is the data's); solver work per row ~ 2 FLOPs per coefficient per iteration."""
        outputs = 1 if config.n_classes in (None, 2) else config.n_classes
        parameters = outputs * (config.n_features + 1)
        return Sizing(parameters=parameters, non_embedding_parameters=parameters,
                      flops_per_unit=float(2 * parameters * config.max_iter), unit="row",
                      activation_bytes=micro_batch * config.n_features * 8)

    def fit(self, config: LinearConfig, train_x, train_y, valid_x, valid_y, seed: int, threads: int | None) -> FitResult:
        pipeline = _pipeline(config, seed).fit(train_x, train_y)
        model = LinearModel(_params(config, pipeline), pipeline)
        # Step 0 is the intercept-only model (the class frequencies, or the mean), so the loss-drop gate
        # measures what the features added.
        if config.n_classes:
            prior = np.bincount(train_y.astype(np.int64), minlength=config.n_classes) / len(train_y)
            base_train, base_valid = np.tile(prior, (len(train_y), 1)), np.tile(prior, (len(valid_y), 1))
        else:
            base_train, base_valid = np.full(len(train_y), train_y.mean()), np.full(len(valid_y), train_y.mean())
        history = [
            {"step": 0, "loss": table_loss(config.n_classes, base_train, train_y),
             "heldout_loss": table_loss(config.n_classes, base_valid, valid_y)},
            {"step": 1, "loss": table_loss(config.n_classes, model.predict(train_x), train_y),
             "heldout_loss": table_loss(config.n_classes, model.predict(valid_x), valid_y)},
        ]
        iterations = getattr(pipeline.named_steps["model"], "n_iter_", None)
        return FitResult(model, history, 1, {"solver_iterations": None if iterations is None else int(np.max(iterations))})

    def export_files(self, model: LinearModel, config: LinearConfig, directory: Path) -> list[str]:
        (directory / MODEL_FILE).write_text(json.dumps(model.params, indent=1) + "\n", encoding="utf-8")
        return [MODEL_FILE]

    def load_files(self, directory: Path, config: LinearConfig, device: Any = "cpu") -> LinearModel:
        path = directory / MODEL_FILE
        try:
            params = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ExportError(f"{path} cannot be read: {exc}") from None
        outputs = 1 if config.n_classes in (None, 2) else config.n_classes
        coef = np.asarray(params.get("coef", []))
        if coef.shape[0] != outputs or params.get("n_classes") != config.n_classes:
            raise ExportError(f"{path} does not match its config ({outputs} outputs, n_classes {config.n_classes})")
        return LinearModel(params)


LINEAR = register(LinearFamily())
