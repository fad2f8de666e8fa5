"""Gradient-boosted trees through LightGBM (family `lightgbm`).

Why LightGBM rather than XGBoost: it reads categorical features natively (splits on category codes, no
one-hot blow-up), which is what our table encoding gives it; its histogram algorithm is the fastest of
the two on CPU for small and medium tables; its model file is plain text (no pickle), loads without the
training data, and onnxmltools converts it. XGBoost would do the same job with more preprocessing.

Training is `lightgbm.train` with early stopping on the validation split (the best round is kept), every
round's training and validation loss recorded, seeded and deterministic (`deterministic`,
`force_row_wise`): the same data, seed and thread count give the same model, so an interrupted stage is
simply fit again.

LightGBM is the optional extra `runyard[predict]`: runyard.model registers this family lazily, so this
module (and lightgbm) is imported only when a spec or an export names it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np

from runyard.model.registry import ExportError, Sizing, register
from runyard.model.tabular import FitResult, TableFacts, TabularFamily
from runyard.spec.predictive import TreesSpec

MODEL_FILE = "model.txt"


@dataclass(frozen=True)
class TreesConfig:
    n_features: int
    categorical: tuple[int, ...]
    n_classes: int | None
    num_boost_round: int
    learning_rate: float
    num_leaves: int
    max_depth: int
    min_data_in_leaf: int
    feature_fraction: float
    bagging_fraction: float
    bagging_freq: int
    lambda_l1: float
    lambda_l2: float
    max_bin: int
    early_stopping_rounds: int | None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["categorical"] = list(self.categorical)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TreesConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"a trees config has keys {sorted(names)}, got {got}")
        return cls(**{**data, "categorical": tuple(data["categorical"])})

    @property
    def objective(self) -> str:
        if self.n_classes is None:
            return "regression"
        return "binary" if self.n_classes == 2 else "multiclass"

    @property
    def metric(self) -> str:
        return {"regression": "l2", "binary": "binary_logloss", "multiclass": "multi_logloss"}[self.objective]

    def params(self, seed: int, threads: int | None) -> dict[str, Any]:
        """LightGBM's parameters for this config: what a plain `lightgbm.train` call needs to do the same."""
        params = {
            "objective": self.objective, "metric": self.metric, "learning_rate": self.learning_rate,
            "num_leaves": self.num_leaves, "max_depth": self.max_depth, "min_data_in_leaf": self.min_data_in_leaf,
            "feature_fraction": self.feature_fraction, "bagging_fraction": self.bagging_fraction,
            "bagging_freq": self.bagging_freq, "lambda_l1": self.lambda_l1, "lambda_l2": self.lambda_l2,
            "max_bin": self.max_bin, "seed": seed, "deterministic": True, "force_row_wise": True, "verbose": -1,
        }
        if self.objective == "multiclass":
            params["num_class"] = self.n_classes
        if threads:
            params["num_threads"] = threads
        return params


@dataclass
class TreeModel:
    """A fitted booster, cut at its best round."""

    booster: lgb.Booster
    n_classes: int | None

    def predict(self, x: np.ndarray) -> np.ndarray:
        raw = self.booster.predict(np.asarray(x, dtype=np.float64))
        if self.n_classes == 2:
            return np.stack([1.0 - raw, raw], axis=1)
        return np.asarray(raw)


def tree_datasets(config: TreesConfig, train_x, train_y, valid_x, valid_y) -> tuple[lgb.Dataset, lgb.Dataset]:
    """LightGBM's training and validation datasets (the validation one binned like the training one)."""
    categorical = list(config.categorical) or "auto"
    train = lgb.Dataset(train_x, label=train_y, categorical_feature=categorical, free_raw_data=False,
                        params={"max_bin": config.max_bin, "verbose": -1})
    valid = lgb.Dataset(valid_x, label=valid_y, reference=train, categorical_feature=categorical, free_raw_data=False)
    return train, valid


class TreesFamily(TabularFamily):
    name = "lightgbm"
    # Fewer rows are too few for trees with a validation split to early-stop on (each leaf needs
    # min_data_in_leaf rows, the validation split a useful size): such a table gets the linear model.
    min_rows = 100
    why_recommended = ("gradient-boosted trees, the strong default for low-dimensional tabular data (no deep network "
                       "needed; CPU is enough to train and serve)")

    def config_from_spec(self, spec: Any, *, table: TableFacts | None = None, **data_facts: Any) -> TreesConfig:
        if table is None:
            raise ValueError("the trees' config needs the prepared table's facts (features, classes)")
        section = spec.trees or TreesSpec()
        return TreesConfig(n_features=table.n_features, categorical=tuple(table.categorical),
                           n_classes=table.n_classes, **section.model_dump())

    def config_from_dict(self, data: dict[str, Any]) -> TreesConfig:
        return TreesConfig.from_dict(data)

    def sizing(self, config: TreesConfig, micro_batch: int = 1) -> Sizing:
        """Per training row and round, histogram construction reads each feature once per tree built (one
        tree a round, or one per class); `parameters` counts the most leaves the model can hold (a value
        and a split each). `micro_batch` is rows: the binned dataset keeps a byte per feature per row."""
        trees_per_round = config.n_classes if config.objective == "multiclass" else 1
        trees = config.num_boost_round * trees_per_round
        return Sizing(
            parameters=2 * trees * config.num_leaves,
            non_embedding_parameters=2 * trees * config.num_leaves,
            flops_per_unit=float(2 * config.n_features * trees),
            unit="row",
            activation_bytes=micro_batch * max(1, config.n_features) * (1 if config.max_bin <= 255 else 2),
        )

    def fit(self, config: TreesConfig, train_x, train_y, valid_x, valid_y, seed: int, threads: int | None) -> FitResult:
        train, valid = tree_datasets(config, train_x, train_y, valid_x, valid_y)
        record: dict[str, dict[str, list[float]]] = {}
        callbacks = [lgb.record_evaluation(record)]
        if config.early_stopping_rounds:
            callbacks.append(lgb.early_stopping(config.early_stopping_rounds, first_metric_only=True, verbose=False))
        booster = lgb.train(config.params(seed, threads), train, num_boost_round=config.num_boost_round,
                            valid_sets=[train, valid], valid_names=["train", "validation"], callbacks=callbacks)
        train_loss = record["train"][config.metric]
        valid_loss = record["validation"][config.metric]
        best = booster.best_iteration or len(train_loss)
        history = [{"step": i + 1, "loss": float(train_loss[i]), "heldout_loss": float(valid_loss[i])}
                   for i in range(len(train_loss))]
        # The model as it will be saved and served: cut at the best round.
        cut = lgb.Booster(model_str=booster.model_to_string(num_iteration=best))
        return FitResult(TreeModel(cut, config.n_classes), history, best,
                         {"rounds_trained": len(train_loss), "best_round": best, "params": config.params(seed, threads)})

    def export_files(self, model: TreeModel, config: TreesConfig, directory: Path) -> list[str]:
        model.booster.save_model(str(directory / MODEL_FILE))
        return [MODEL_FILE]

    def load_files(self, directory: Path, config: TreesConfig, device: Any = "cpu") -> TreeModel:
        path = directory / MODEL_FILE
        if not path.is_file():
            raise ExportError(f"{path} is missing from the export")
        try:
            booster = lgb.Booster(model_file=str(path))
        except lgb.basic.LightGBMError as exc:
            raise ExportError(f"{path} is not a LightGBM model file: {exc}") from None
        if booster.num_feature() != config.n_features:
            raise ExportError(f"{path} reads {booster.num_feature()} features; its config says {config.n_features}")
        return TreeModel(booster, config.n_classes)


TREES = register(TreesFamily())
