"""Data sets scikit-learn ships inside its wheel (a source `format: sklearn`): read from the installed
package, never downloaded. Tables come back as named columns, `digits` also as 8x8 images.

scikit-learn is the optional extra `runyard[predict]`; it is imported where a data set is read.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

import numpy as np

from runyard.errors import DataError

# name -> (loader in sklearn.datasets, whether the target is a class)
LOADERS = {
    "breast_cancer": ("load_breast_cancer", True),
    "wine": ("load_wine", True),
    "iris": ("load_iris", True),
    "digits": ("load_digits", True),
    "diabetes": ("load_diabetes", False),
}


@dataclass(frozen=True)
class BundledSet:
    name: str
    features: np.ndarray  # [rows, features] float64
    feature_names: list[str]
    target: np.ndarray  # class names (str) for classification, floats for regression
    images: np.ndarray | None  # digits: [rows, 8, 8] values 0..16
    version: str  # scikit-learn's version: part of the data's fingerprint

    def columns(self, target_name: str) -> dict[str, np.ndarray]:
        cols = {name: self.features[:, i] for i, name in enumerate(self.feature_names)}
        if target_name in cols:
            raise DataError(f"sklearn:{self.name}: a feature is already named {target_name!r}; name the target otherwise")
        cols[target_name] = self.target
        return cols


def load_bundled(name: str) -> BundledSet:
    """The bundled data set `name` (one of LOADERS)."""
    if name not in LOADERS:
        raise DataError(f"sklearn:{name}: scikit-learn ships no such data set here; one of {sorted(LOADERS)}")
    try:
        from sklearn import datasets  # the optional extra runyard[predict]
    except ImportError as exc:
        raise DataError(f"sklearn:{name} needs scikit-learn: pip install 'runyard[predict]' ({exc})") from None
    loader, is_class = LOADERS[name]
    bunch = getattr(datasets, loader)()
    target = bunch.target
    if is_class:
        names = getattr(bunch, "target_names", None)
        target = np.asarray([str(names[t]) if names is not None else str(t) for t in target], dtype=object)
    else:
        target = np.asarray(target, dtype=np.float64)
    feature_names = [str(n) for n in bunch.feature_names] if hasattr(bunch, "feature_names") else [
        f"x{i}" for i in range(bunch.data.shape[1])
    ]
    return BundledSet(
        name=name,
        features=np.asarray(bunch.data, dtype=np.float64),
        feature_names=feature_names,
        target=target,
        images=np.asarray(bunch.images) if hasattr(bunch, "images") else None,
        version=importlib.metadata.version("scikit-learn"),
    )
