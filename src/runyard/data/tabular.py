"""The data stage of the tabular tasks: read the table, check it, clean it, split it, encode it.

`prepare_table(data, task, seed)` reads the sources (data/table_read.py: types inferred, a mixed column
refused), picks the features, applies the missing-value policies (data.table.missing_*), removes rows
without a target and, as data.table.dedup says, duplicate rows (each removal counted; the exact
duplicates are counted and reported even when kept), refuses a target with one class, splits
train / validation / test (data/row_split.py) and encodes every split with the schema learned from the
training rows (data/table_schema.py). Every refusal is a DataError naming the column, the field or the
file and row, before any training starts. The result carries the statistics the data report shows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runyard.data.row_split import (
    TEST,
    TRAIN,
    VALID,
    Split,
    check_split,
    keyed_split,
    random_split,
    stratified_split,
)
from runyard.data.table_read import CATEGORICAL, NUMERIC, RawTable, read_table
from runyard.data.table_schema import MISSING_CATEGORY, Feature, TableSchema, encode_columns
from runyard.errors import DataError
from runyard.spec.data import DataSpec
from runyard.spec.data_predictive import TableSpec

PIPELINE_VERSION = 1


@dataclass(frozen=True)
class TableSplit:
    x: np.ndarray  # [rows, features] float64, the schema's encoding
    y: np.ndarray  # class indices (int64) or targets (float64)

    @property
    def rows(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class PreparedTable:
    """A prepared table: the schema and the three encoded splits, with what the report shows."""

    schema: TableSchema
    train: TableSplit
    valid: TableSplit
    test: TableSplit
    fingerprint: str
    input_fingerprints: dict[str, str]
    stats: dict[str, Any] = field(default_factory=dict)
    train_columns: dict[str, np.ndarray] = field(default_factory=dict)  # raw training columns (drift reference)

    @property
    def is_classification(self) -> bool:
        return self.schema.classes is not None


def _classes(values: np.ndarray) -> list[str]:
    unique = sorted({str(v) for v in values})
    try:  # numeric labels in numeric order ("2" before "10")
        return sorted(unique, key=float)
    except ValueError:
        return unique


def _feature_names(raw: RawTable, table: TableSpec) -> list[str]:
    names = list(raw.columns)
    for field_name, wanted in (("features", table.features or []), ("drop", table.drop),
                               ("categorical", table.categorical),
                               ("split_key", [table.split_key] if table.split_key else [])):
        unknown = [c for c in wanted if c not in raw.columns]
        if unknown:
            raise DataError(f"data.table.{field_name} names {unknown}, not columns of the table; its columns are {names}")
    excluded = {table.target, *table.drop, *([table.split_key] if table.split_key else [])}
    features = list(table.features) if table.features else [n for n in names if n not in excluded]
    if not features:
        raise DataError(f"data.table: no feature columns are left (columns {names}, target {table.target!r}, drop {table.drop})")
    return features


def _missing(values: np.ndarray, kind: str) -> np.ndarray:
    if kind == NUMERIC:
        return np.isnan(values)
    return np.asarray([v is None for v in values], dtype=bool)


def _duplicates(table: RawTable, columns: list[str]) -> np.ndarray:
    """Per row: whether its values in `columns` repeat an earlier row's (the first of each is not one)."""
    seen: set[tuple] = set()
    out = np.zeros(table.rows, dtype=bool)
    cols = [table.columns[n] for n in columns]
    for i in range(table.rows):
        key = tuple(repr(c[i]) for c in cols)  # repr: NaN equals NaN here, as a duplicate row should
        out[i] = key in seen
        seen.add(key)
    return out


def _clean(raw: RawTable, table: TableSpec, task: str, features: list[str], counts: dict[str, int],
           dedup: dict[str, Any]) -> RawTable:
    """Rows without a target, with a missing value a policy refuses or drops, and duplicates as
    data.table.dedup says out (`dedup` gets the exact duplicates found, removed or not)."""
    target = raw.columns[table.target]
    if task == "tabular_regression" and raw.kinds[table.target] != NUMERIC:
        bad = next(i for i, v in enumerate(target) if v is not None)
        raise DataError(f"data.table.target {table.target!r} must be numeric for tabular_regression; it holds text, "
                        f"e.g. {target[bad]!r} at {raw.where(bad)}")
    keep = ~_missing(target, raw.kinds[table.target])
    counts["missing_target"] = int((~keep).sum())
    for name in features:
        kind = raw.kinds[name]
        policy = table.missing_numeric if kind == NUMERIC else table.missing_categorical
        miss = _missing(raw.columns[name], kind) & keep
        if not miss.any():
            continue
        if policy == "error":
            first = int(np.flatnonzero(miss)[0])
            raise DataError(f"column {name!r} has {int(miss.sum())} missing values, e.g. at {raw.where(first)}; "
                            f"data.table.missing_{'numeric' if kind == NUMERIC else 'categorical'} is 'error'")
        if policy == "drop_rows":
            counts[f"missing_{name}"] = int(miss.sum())
            keep &= ~miss
    cleaned = raw.take(keep)
    for name in features:
        if cleaned.kinds[name] == CATEGORICAL:
            values = cleaned.columns[name]
            cleaned.columns[name] = np.asarray([MISSING_CATEGORY if v is None else v for v in values], dtype=object)
    duplicate = _duplicates(cleaned, list(cleaned.columns))
    counts_found = int(duplicate.sum())
    if table.dedup == "key":
        duplicate = _duplicates(cleaned, table.dedup_key or [])
    if table.dedup != "none":
        counts["duplicate_rows" if table.dedup == "rows" else "duplicate_keys"] = int(duplicate.sum())
        cleaned = cleaned.take(~duplicate)
    dedup["exact_duplicate_rows"] = counts_found
    if cleaned.rows == 0:
        raise DataError(f"data.table: no rows are left after cleaning ({counts})")
    return cleaned


def _split(cleaned: RawTable, table: TableSpec, task: str, test_fraction: float, seed: int) -> Split:
    if table.split_key:
        split = keyed_split(cleaned.columns[table.split_key], seed, test_fraction, table.validation_fraction)
    elif task == "tabular_classification" and table.stratify:
        labels = np.asarray([str(v) for v in cleaned.columns[table.target]], dtype=object)
        split = stratified_split(labels, seed, test_fraction, table.validation_fraction)
    else:
        split = random_split(cleaned.rows, seed, test_fraction, table.validation_fraction)
    check_split(split, f"data.table ({cleaned.rows} rows after cleaning)")
    return split


def _schema(train: RawTable, table: TableSpec, task: str, features: list[str], classes: list[str] | None) -> TableSchema:
    out = []
    for name in features:
        values = train.columns[name]
        if train.kinds[name] == NUMERIC:
            present = values[~np.isnan(values)]
            median = float(np.median(present)) if len(present) else 0.0
            out.append(Feature(name, "numeric", table.missing_numeric, median=median))
        else:
            categories = sorted({str(v) for v in values})
            if len(categories) > table.max_categories:
                raise DataError(f"column {name!r} has {len(categories)} distinct values in the training rows, more than "
                                f"data.table.max_categories ({table.max_categories}): an identifier? Drop it "
                                "(data.table.drop) or raise the bound")
            out.append(Feature(name, "categorical", table.missing_categorical, categories=categories))
    return TableSchema(task, table.target, classes, out)


def _unseen(values: np.ndarray, categories: list[str]) -> int:
    """Test values of a categorical column that no training row holds; a missing value is not a category
    (the feature's missing count reports it), whether or not `<missing>` occurred in training."""
    known = set(categories) | {MISSING_CATEGORY}
    return sum(1 for v in values if str(v) not in known)


def _labels(values: np.ndarray, classes: list[str] | None) -> np.ndarray:
    if classes is None:
        return np.asarray(values, dtype=np.float64)
    index = {c: i for i, c in enumerate(classes)}
    return np.asarray([index[str(v)] for v in values], dtype=np.int64)


def _feature_stats(raw: RawTable, features: list[str]) -> list[dict[str, Any]]:
    out = []
    for name in features:
        values = raw.columns[name]
        if raw.kinds[name] == NUMERIC:
            present = values[~np.isnan(values)]
            out.append({"name": name, "kind": NUMERIC, "missing": int(np.isnan(values).sum()),
                        "mean": float(present.mean()) if len(present) else None,
                        "std": float(present.std()) if len(present) else None,
                        "min": float(present.min()) if len(present) else None,
                        "max": float(present.max()) if len(present) else None})
        else:
            labels, counts = np.unique(np.asarray([str(v) for v in values], dtype=object), return_counts=True)
            order = np.argsort(-counts, kind="stable")[:5]
            out.append({"name": name, "kind": CATEGORICAL, "categories": len(labels),
                        "missing": int(sum(1 for v in values if v in (None, MISSING_CATEGORY))),
                        "top": [[str(labels[i]), int(counts[i])] for i in order]})
    return out


def _fingerprint(data: DataSpec, task: str, seed: int, inputs: dict[str, str]) -> str:
    settings = {"sources": [s.model_dump(mode="json") for s in data.sources], "table": data.table.model_dump(mode="json"),
                "heldout_fraction": data.heldout_fraction}
    blob = json.dumps({"v": PIPELINE_VERSION, "task": task, "seed": seed, "settings": settings, "inputs": inputs},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def prepare_table(data: DataSpec, task: str, seed: int) -> PreparedTable:
    """Read, check, clean, split and encode the spec's table (see the module's docstring)."""
    table = data.table
    if table is None:
        raise DataError(f"task {task} needs data.table naming its target column")
    raw = read_table(data.sources, table.target, table.categorical)
    features = _feature_names(raw, table)
    type_report = [{"name": n, "kind": raw.kinds[n]} for n in features]
    counts: dict[str, int] = {}
    dedup: dict[str, Any] = {"policy": table.dedup, "key": table.dedup_key}
    cleaned = _clean(raw, table, task, features, counts, dedup)
    classes = None
    if task == "tabular_classification":
        classes = _classes(cleaned.columns[table.target])
        if len(classes) < 2:
            raise DataError(f"data.table.target {table.target!r} has one class ({classes[0]!r}) in its {cleaned.rows} "
                            "usable rows: a classifier needs at least two")
    split = _split(cleaned, table, task, data.heldout_fraction, seed)
    parts = {which: cleaned.take(split.assignment == which) for which in (TRAIN, VALID, TEST)}
    if classes is not None:
        train_classes = {str(v) for v in parts[TRAIN].columns[table.target]}
        if len(train_classes) < 2:
            raise DataError(f"data.table.target {table.target!r}: the training split holds one class only "
                            f"({sorted(train_classes)}); add rows or turn data.table.stratify on")
    schema = _schema(parts[TRAIN], table, task, features, classes)
    splits = {which: TableSplit(encode_columns(part.columns, schema), _labels(part.columns[table.target], classes))
              for which, part in parts.items()}
    balance = None
    if classes is not None:
        balance = {name: {c: int((splits[which].y == i).sum()) for i, c in enumerate(classes)}
                   for which, name in ((TRAIN, "train"), (VALID, "validation"), (TEST, "test"))}
    unseen = {f.name: _unseen(parts[TEST].columns[f.name], f.categories)
              for f in schema.features if f.kind == "categorical"}
    stats = {
        "rows_read": raw.rows,
        "rows_used": cleaned.rows,
        "removed": counts,
        "columns": list(raw.columns),
        "target": table.target,
        "features": type_report,
        "feature_summary": _feature_stats(parts[TRAIN], features),
        "split": {"method": split.method, "counts": split.counts(), "seed": seed},
        "class_balance": balance,
        "target_summary": None if classes is not None else _feature_stats(
            RawTable({table.target: parts[TRAIN].columns[table.target]}, {table.target: NUMERIC}, [], np.zeros(0), np.zeros(0)),
            [table.target])[0],
        "unseen_categories_in_test": {k: v for k, v in unseen.items() if v},
        "dedup": dedup,
        "missing_policy": {"numeric": table.missing_numeric, "categorical": table.missing_categorical},
        "inputs": raw.input_fingerprints,
    }
    return PreparedTable(schema, splits[TRAIN], splits[VALID], splits[TEST],
                         _fingerprint(data, task, seed, raw.input_fingerprints), raw.input_fingerprints, stats,
                         {n: parts[TRAIN].columns[n] for n in features})
