"""A table's feature schema: each feature's name, kind (numeric or categorical), its categories and how a
missing value is handled; and the target's name and classes. The data stage writes it, the export
carries it (`feature_schema.json`), and serving validates requests against it and encodes them exactly
as training encoded its rows.

Encoding: a numeric feature is its float value (NaN when missing and the policy keeps it missing, the
training median under `median`); a categorical one is the index of its value in `categories` (as a
float, NaN for a value training never saw). Trees and the linear model both read this matrix.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MISSING_CATEGORY = "<missing>"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Feature:
    name: str
    kind: str  # "numeric" or "categorical"
    missing: str  # the policy: native | median | drop_rows | error | category
    categories: list[str] = field(default_factory=list)
    median: float | None = None

    @property
    def missing_allowed(self) -> bool:
        return self.missing in ("native", "median", "category")


@dataclass(frozen=True)
class TableSchema:
    task: str
    target: str
    classes: list[str] | None  # classification: the class names, in label order; regression: None
    features: list[Feature]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.features]

    @property
    def categorical_indices(self) -> list[int]:
        return [i for i, f in enumerate(self.features) if f.kind == "categorical"]

    def to_dict(self) -> dict[str, Any]:
        return {"version": SCHEMA_VERSION, "task": self.task, "target": self.target, "classes": self.classes,
                "features": [asdict(f) for f in self.features]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableSchema:
        if data.get("version") != SCHEMA_VERSION:
            raise ValueError(f"feature schema version {data.get('version')!r}; this runyard reads {SCHEMA_VERSION}")
        return cls(data["task"], data["target"], data.get("classes"), [Feature(**f) for f in data["features"]])

    def json_schema(self) -> dict[str, Any]:
        """One row of a predict request as JSON Schema (for the OpenAPI document and clients)."""
        props: dict[str, Any] = {}
        for f in self.features:
            if f.kind == "numeric":
                prop: dict[str, Any] = {"type": ["number", "null"] if f.missing_allowed else "number"}
            else:
                prop = {"type": ["string", "number", "boolean", "null"] if f.missing_allowed else ["string", "number", "boolean"],
                        "description": f"one of {len(f.categories)} categories seen in training"}
            props[f.name] = prop
        # Every feature is sent (null where the policy allows a missing value); no other key.
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def encode_numeric(values: np.ndarray, feature: Feature) -> np.ndarray:
    out = np.asarray(values, dtype=np.float64).copy()
    if feature.missing == "median" and feature.median is not None:
        out[np.isnan(out)] = feature.median
    return out


def encode_categorical(values: np.ndarray, feature: Feature) -> np.ndarray:
    """Category indices as floats; a value training never saw is NaN (missing)."""
    index = {c: float(i) for i, c in enumerate(feature.categories)}
    missing = index.get(MISSING_CATEGORY, math.nan)
    return np.asarray([missing if v is None else index.get(str(v), math.nan) for v in values], dtype=np.float64)


def encode_columns(columns: dict[str, np.ndarray], schema: TableSchema) -> np.ndarray:
    """The feature matrix [rows, features] of already-typed columns (the data stage's)."""
    parts = []
    for f in schema.features:
        parts.append(encode_numeric(columns[f.name], f) if f.kind == "numeric" else encode_categorical(columns[f.name], f))
    return np.stack(parts, axis=1) if parts else np.zeros((0, 0))


def category_text(value: Any) -> str | None:
    """A request's categorical value as the data stage wrote categories (numbers as in a CSV)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def encode_records(records: list[Any], schema: TableSchema) -> tuple[np.ndarray, list[dict[str, Any]], list[dict[str, Any]]]:
    """Validate request rows (JSON objects keyed by feature name) and encode them.

    Returns (matrix, problems, unseen): each problem names the row, the feature and what was wrong
    (absent, null where the policy refuses missing values, wrong type, unknown feature); `unseen` lists categorical values training never saw
    (encoded as missing, and shown in drift). The matrix is only meaningful without problems."""
    problems: list[dict[str, Any]] = []
    unseen: list[dict[str, Any]] = []
    known = set(schema.names)
    matrix = np.full((len(records), len(schema.features)), np.nan, dtype=np.float64)
    for r, record in enumerate(records):
        if not isinstance(record, dict):
            problems.append({"row": r, "feature": None, "problem": f"a row is a JSON object of features, got {type(record).__name__}"})
            continue
        for name in sorted(set(record) - known):
            problems.append({"row": r, "feature": name, "problem": "not a feature of this model"})
        for j, f in enumerate(schema.features):
            if f.name not in record:  # absent is an error even where null is allowed: a forgotten feature
                problems.append({"row": r, "feature": f.name, "problem": "missing: every feature must be sent"
                                 + (" (null for an unknown value)" if f.missing_allowed else
                                    f" with a value (the model was trained with missing values policy {f.missing!r})")})
                continue
            value = record[f.name]
            if value is None:
                if not f.missing_allowed:
                    problems.append({"row": r, "feature": f.name, "problem": f"null is not allowed (policy {f.missing!r})"})
                elif f.kind == "numeric":
                    matrix[r, j] = f.median if f.missing == "median" and f.median is not None else math.nan
                else:
                    matrix[r, j] = encode_categorical(np.asarray([None], dtype=object), f)[0]
                continue
            if f.kind == "numeric":
                if isinstance(value, bool) or not isinstance(value, int | float):
                    problems.append({"row": r, "feature": f.name,
                                     "problem": f"expected a number, got {type(value).__name__} {value!r}"})
                elif not math.isfinite(float(value)):
                    problems.append({"row": r, "feature": f.name, "problem": f"expected a finite number, got {value!r}"})
                else:
                    matrix[r, j] = float(value)
            else:
                if not isinstance(value, str | int | float | bool):
                    problems.append({"row": r, "feature": f.name,
                                     "problem": f"expected a category (text), got {type(value).__name__}"})
                    continue
                text = category_text(value)
                code = encode_categorical(np.asarray([text], dtype=object), f)[0]
                if math.isnan(code):
                    unseen.append({"row": r, "feature": f.name, "value": text})
                matrix[r, j] = code
    return matrix, problems, unseen
