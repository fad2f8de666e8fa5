"""Reading a table's sources (CSV, Parquet, or a data set scikit-learn ships) into named columns, and
inferring each column's type.

Every source must have the same columns. A column is numeric when all its present values are numbers,
categorical when they are text or booleans (or the spec names it in `data.table.categorical`); a column
holding both numbers and text is an error naming the file, the column and an example of each, since a
typo in a numeric column would otherwise turn the whole column into categories without a word.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from runyard.data.sklearn_sets import load_bundled
from runyard.data.sources import list_source_files
from runyard.errors import DataError
from runyard.spec.data import SourceSpec

NUMERIC, CATEGORICAL = "numeric", "categorical"


@dataclass
class RawTable:
    """Columns as read: numeric columns float64 (NaN missing), the others object arrays of str (None
    missing). `origin[i]` says where row i came from (file and row number) for error messages."""

    columns: dict[str, np.ndarray]
    kinds: dict[str, str]
    origin_files: list[str]
    origin_index: np.ndarray  # per row: index into origin_files
    origin_row: np.ndarray  # per row: row number in its file (0-based, header not counted)
    input_fingerprints: dict[str, str] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(self.origin_row)

    def where(self, row: int) -> str:
        """'file row N' for error messages (N counts data rows from 1)."""
        return f"{self.origin_files[int(self.origin_index[row])]} row {int(self.origin_row[row]) + 1}"

    def take(self, mask: np.ndarray) -> RawTable:
        return RawTable({k: v[mask] for k, v in self.columns.items()}, dict(self.kinds), self.origin_files,
                        self.origin_index[mask], self.origin_row[mask], self.input_fingerprints)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _arrow_to_column(array: pa.ChunkedArray) -> tuple[np.ndarray, str]:
    kind = array.type
    if pa.types.is_dictionary(kind):
        array = array.cast(kind.value_type)
        kind = array.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        return np.asarray(array.cast(pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64), NUMERIC
    if pa.types.is_boolean(kind):
        values = array.to_pylist()
        return np.asarray([None if v is None else str(v).lower() for v in values], dtype=object), CATEGORICAL
    values = array.to_pylist()
    return np.asarray([None if v is None else str(v) for v in values], dtype=object), CATEGORICAL


def _read_file(source: SourceSpec, path: str) -> pa.Table:
    try:
        if source.format == "csv":
            # Every column as read: typing is ours (mixed columns must be caught, not coerced).
            return pa_csv.read_csv(path, convert_options=pa_csv.ConvertOptions(strings_can_be_null=True))
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: cannot read it as {source.format}: {exc}") from None


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_table(sources: list[SourceSpec], target: str, forced_categorical: list[str]) -> RawTable:
    """Every source's rows, in order, as one table of typed columns. DataError naming the file and the
    column for: no file, different columns between files, no `target` column, a mixed column."""
    parts: list[tuple[str, dict[str, np.ndarray], dict[str, str]]] = []
    fingerprints: dict[str, str] = {}
    for i, source in enumerate(sources):
        if source.format == "sklearn":
            bundled = load_bundled(source.path)
            columns = bundled.columns(target)  # the spec names the bundled target column
            kinds = {name: (CATEGORICAL if values.dtype == object else NUMERIC) for name, values in columns.items()}
            parts.append((f"sklearn:{source.path}", columns, kinds))
            fingerprints[f"sources[{i}] sklearn:{source.path}"] = f"scikit-learn {bundled.version}"
            continue
        files = list_source_files(source, i)
        if not files:
            raise DataError(f"data.sources[{i}].path {source.path!r} matched no files")
        for f in files:
            table = _read_file(source, f.path)
            columns, kinds = {}, {}
            for name in table.column_names:
                columns[name], kinds[name] = _arrow_to_column(table.column(name))
            parts.append((f.path, columns, kinds))
            fingerprints[f"sources[{i}] {f.path}"] = _file_digest(f.path)
    if not parts:
        raise DataError("data.sources: no table to read")
    first_file, first_cols, _ = parts[0]
    names = list(first_cols)
    for path, columns, _kinds in parts[1:]:
        if list(columns) != names:
            missing = [n for n in names if n not in columns]
            extra = [n for n in columns if n not in names]
            raise DataError(f"{path}: its columns differ from {first_file}'s: missing {missing}, extra {extra}")
    if target not in names:
        raise DataError(
            f"data.table.target {target!r}: {first_file} has no such column; its columns are {names}"
        )
    columns = {}
    kinds = {}
    for name in names:
        pieces = [(path, cols[name], knds[name]) for path, cols, knds in parts]
        columns[name], kinds[name] = _merge_column(name, pieces, name in forced_categorical)
    origin_files = [path for path, _, _ in parts]
    counts = [len(cols[names[0]]) for _, cols, _ in parts]
    origin_index = np.repeat(np.arange(len(parts)), counts)
    origin_row = np.concatenate([np.arange(n) for n in counts]) if counts else np.zeros(0, dtype=np.int64)
    return RawTable(columns, kinds, origin_files, origin_index, origin_row, fingerprints)


def _merge_column(name: str, pieces: list[tuple[str, np.ndarray, str]], categorical: bool) -> tuple[np.ndarray, str]:
    """One column from every file's piece, typed: numeric unless a piece holds text (then every value
    must be text, or the column is mixed: an error naming the file and examples)."""
    if categorical:
        out = []
        for _path, values, kind in pieces:
            if kind == NUMERIC:
                out += [None if math.isnan(v) else _number_text(v) for v in values]
            else:
                out += list(values)
        return np.asarray(out, dtype=object), CATEGORICAL
    if all(kind == NUMERIC for _, _, kind in pieces):
        return np.concatenate([values for _, values, _ in pieces]), NUMERIC
    # Some piece is text: it is categorical only if no value anywhere reads as a number.
    numeric_example = text_example = None
    for path, values, kind in pieces:
        if kind == NUMERIC:
            present = values[~np.isnan(values)]
            if len(present) and numeric_example is None:
                numeric_example = (path, _number_text(present[0]))
            continue
        for row, value in enumerate(values):
            if value is None:
                continue
            if _is_number(value):
                if numeric_example is None:
                    numeric_example = (path, value, row)
            elif text_example is None:
                text_example = (path, value, row)
        if numeric_example and text_example:
            break
    if numeric_example is not None and text_example is not None:
        def where(example: tuple) -> str:
            return f"{example[0]}" + (f" row {example[2] + 1}" if len(example) > 2 else "")

        raise DataError(
            f"column {name!r} mixes numbers and text: {numeric_example[1]!r} ({where(numeric_example)}) and "
            f"{text_example[1]!r} ({where(text_example)}). Fix the values, drop the column (data.table.drop), or "
            f"read it as categories (data.table.categorical)"
        )
    out = []
    for _path, values, kind in pieces:
        out += [None if (kind == NUMERIC and math.isnan(v)) else (v if kind != NUMERIC else _number_text(v))
                for v in values]
    if numeric_example is not None:  # text pieces that are all numbers (a CSV column read as text elsewhere)
        return np.asarray([np.nan if v is None else float(v) for v in out], dtype=np.float64), NUMERIC
    return np.asarray(out, dtype=object), CATEGORICAL


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
