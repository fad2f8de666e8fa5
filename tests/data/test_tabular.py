"""The table data stage on real CSV and Parquet files: types inferred, missing values by their policy,
cleaning counted, splits stratified or keyed, and every bad input refused before training with an error
that names the column, the field or the file and row."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runyard.data.row_split import TEST, TRAIN, VALID
from runyard.data.table_schema import MISSING_CATEGORY
from runyard.data.tabular import prepare_table
from runyard.data.task_report import write_table_report
from runyard.errors import DataError, SpecError
from runyard.spec.job import parse_spec


def spec_for(path, table: dict, task: str = "tabular_classification", fmt: str = "csv", heldout: float = 0.2):
    return parse_spec({"task": task, "name": "t", "data": {"heldout_fraction": heldout,
                       "sources": [{"path": str(path), "format": fmt}], "table": table}})


def write_csv(path, header: list[str], rows: list[list]) -> None:
    lines = [",".join(header)] + [",".join("" if v is None else str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")


def prepare(spec):
    return prepare_table(spec.data, spec.task, seed=7)


def test_types_are_inferred_and_categories_and_missing_values_follow_their_policy(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(200):
        colour = ["red", "green", "blue"][i % 3] if i % 17 else None
        size = None if i % 13 == 0 else round(float(rng.normal()), 3)
        rows.append([i, size, colour, i % 2, "yes" if (i % 3 == 0) else "no"])
    write_csv(tmp_path / "t.csv", ["id", "size", "colour", "code", "label"], rows)
    prepared = prepare(spec_for(tmp_path / "t.csv", {"target": "label", "drop": ["id"], "categorical": ["code"]}))
    kinds = {f.name: f.kind for f in prepared.schema.features}
    assert kinds == {"size": "numeric", "colour": "categorical", "code": "categorical"}
    colour = next(f for f in prepared.schema.features if f.name == "colour")
    assert colour.categories == sorted(["blue", "green", "red", MISSING_CATEGORY])  # missing is its own category
    assert prepared.schema.classes == ["no", "yes"]
    # native: a missing numeric value stays missing (NaN) for the trees
    assert np.isnan(prepared.train.x[:, 0]).any()
    stats = {f["name"]: f for f in prepared.stats["feature_summary"]}
    assert stats["size"]["missing"] == int(np.isnan(prepared.train.x[:, 0]).sum())

    median = prepare(spec_for(tmp_path / "t.csv", {"target": "label", "drop": ["id"], "missing_numeric": "median"}))
    size = median.schema.features[0]
    assert not np.isnan(median.train.x[:, 0]).any() and size.median is not None

    dropped = prepare(spec_for(tmp_path / "t.csv", {"target": "label", "drop": ["id"], "missing_numeric": "drop_rows"}))
    assert dropped.stats["removed"]["missing_size"] == sum(1 for i in range(200) if i % 13 == 0)
    assert dropped.stats["rows_used"] == 200 - dropped.stats["removed"]["missing_size"]

    with pytest.raises(DataError, match=r"column 'size' has \d+ missing values, e.g. at .*t.csv row 1; data.table.missing_numeric is 'error'"):
        prepare(spec_for(tmp_path / "t.csv", {"target": "label", "drop": ["id"], "missing_numeric": "error"}))


def test_rows_without_a_target_and_duplicates_are_removed_and_counted(tmp_path):
    rows = [[i % 10, "a" if i % 2 else "b"] for i in range(40)] + [[99, None], [98, None]]
    write_csv(tmp_path / "t.csv", ["x", "y"], rows)
    prepared = prepare(spec_for(tmp_path / "t.csv", {"target": "y", "dedup": "rows"}))
    assert prepared.stats["removed"]["missing_target"] == 2
    assert prepared.stats["removed"]["duplicate_rows"] == 30  # 40 rows hold 10 distinct (x, y) pairs
    assert prepared.stats["rows_used"] == 10
    assert prepared.stats["dedup"] == {"policy": "rows", "key": None, "exact_duplicate_rows": 30}


def test_identical_answers_are_kept_by_default_and_counted_in_the_report(tmp_path):
    # A survey: distinct respondents (ids) giving identical answers are real rows; the default keeps them.
    rows = [[i, i % 3, "yes" if i % 3 else "no"] for i in range(60)] + [[5, 2, "yes"]]  # row 61 repeats row 6 whole
    write_csv(tmp_path / "t.csv", ["id", "q1", "answer"], rows)
    kept = prepare(spec_for(tmp_path / "t.csv", {"target": "answer", "drop": ["id"]}))
    assert kept.stats["rows_used"] == 61 and "duplicate_rows" not in kept.stats["removed"]
    assert kept.stats["dedup"] == {"policy": "none", "key": None, "exact_duplicate_rows": 1}
    # rows: only a row repeating another in every column read (the dropped id included) is removed.
    rows_policy = prepare(spec_for(tmp_path / "t.csv", {"target": "answer", "drop": ["id"], "dedup": "rows"}))
    assert rows_policy.stats["rows_used"] == 60 and rows_policy.stats["removed"]["duplicate_rows"] == 1
    # key: a repeated id is the same respondent, whatever it answered.
    keyed = prepare(spec_for(tmp_path / "t.csv", {"target": "answer", "drop": ["id"], "dedup": "key",
                                                  "dedup_key": ["id"]}))
    assert keyed.stats["rows_used"] == 60 and keyed.stats["removed"]["duplicate_keys"] == 1
    report = write_table_report(tmp_path / "report", kept.stats, kept.train_columns,
                                {f.name: f.kind for f in kept.schema.features})
    assert report["dedup"]["exact_duplicate_rows"] == 1
    assert ("Duplicates (data.table.dedup): none (every row kept); 1 row repeats an earlier row exactly in every "
            "column read (kept)") in (tmp_path / "report" / "report.md").read_text()
    # The old boolean still reads, mapped onto the policy.
    assert spec_for(tmp_path / "t.csv", {"target": "answer", "drop_duplicates": True}).data.table.dedup == "rows"
    assert spec_for(tmp_path / "t.csv", {"target": "answer", "drop_duplicates": False}).data.table.dedup == "none"
    with pytest.raises(SpecError, match="dedup: key needs dedup_key"):
        spec_for(tmp_path / "t.csv", {"target": "answer", "dedup": "key"})
    with pytest.raises(SpecError, match="old name of dedup"):
        spec_for(tmp_path / "t.csv", {"target": "answer", "dedup": "rows", "drop_duplicates": True})


def test_a_stratified_split_keeps_the_class_balance_and_a_keyed_split_keeps_keys_apart(tmp_path):
    rows = [[float(i), i // 4, i // 4, "pos" if i % 5 == 0 else "neg"] for i in range(500)]
    write_csv(tmp_path / "t.csv", ["x", "patient", "patient_copy", "y"], rows)
    prepared = prepare(spec_for(tmp_path / "t.csv", {"target": "y", "drop": ["patient"]}))
    share = {name: balance["pos"] / sum(balance.values()) for name, balance in prepared.stats["class_balance"].items()}
    assert all(abs(s - 0.2) < 0.03 for s in share.values()), share
    assert prepared.stats["split"]["method"].startswith("stratified")

    keyed = prepare(spec_for(tmp_path / "t.csv", {"target": "y", "split_key": "patient"}))
    assert keyed.stats["split"]["method"].startswith("keyed")
    # patient_copy is a feature equal to the key: each of its values lives in exactly one split.
    column = keyed.schema.names.index("patient_copy")
    seen = [set(split.x[:, column].tolist()) for split in (keyed.train, keyed.valid, keyed.test)]
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert all(seen) and sum(len(s) for s in seen) == 125


def test_the_keyed_split_function_never_splits_a_key():
    from runyard.data.row_split import keyed_split

    keys = np.repeat(np.arange(50), 4)
    split = keyed_split(keys, seed=3, test_fraction=0.2, validation_fraction=0.2)
    for key in range(50):
        assert len(set(split.assignment[keys == key])) == 1
    assert {TRAIN, VALID, TEST} <= set(split.assignment.tolist())


def test_parquet_and_several_csv_files_read_as_one_table(tmp_path):
    table = pa.table({"a": [1.0, 2.0, 3.0, 4.0] * 10, "kind": ["x", "y", "x", "z"] * 10, "t": [0, 1, 0, 1] * 10,
                      "n": list(range(40))})
    pq.write_table(table, tmp_path / "t.parquet")
    prepared = prepare(spec_for(tmp_path / "t.parquet", {"target": "t"}, fmt="parquet"))
    assert {f.name: f.kind for f in prepared.schema.features} == {"a": "numeric", "kind": "categorical", "n": "numeric"}
    for part in ("p1", "p2"):
        write_csv(tmp_path / f"{part}.csv", ["a", "t"], [[i, i % 2] for i in range(20)])
    glob_spec = spec_for(tmp_path / "p*.csv", {"target": "t", "drop_duplicates": False})
    assert prepare(glob_spec).stats["rows_read"] == 40


def test_a_missing_target_column_names_the_file_and_the_columns(tmp_path):
    write_csv(tmp_path / "t.csv", ["a", "b"], [[1, 2]] * 5)
    with pytest.raises(DataError, match=r"data.table.target 'label': .*t.csv has no such column; its columns are \['a', 'b'\]"):
        prepare(spec_for(tmp_path / "t.csv", {"target": "label"}))


def test_a_target_with_one_class_is_refused(tmp_path):
    write_csv(tmp_path / "t.csv", ["a", "y"], [[i, "same"] for i in range(30)])
    with pytest.raises(DataError, match=r"data.table.target 'y' has one class \('same'\) in its 30 usable rows"):
        prepare(spec_for(tmp_path / "t.csv", {"target": "y"}))


def test_a_column_mixing_numbers_and_text_names_the_column_file_and_rows(tmp_path):
    rows = [[i, i % 2] for i in range(20)]
    rows[13][0] = "n/a?"
    write_csv(tmp_path / "t.csv", ["amount", "y"], rows)
    with pytest.raises(DataError, match=r"column 'amount' mixes numbers and text: '0' \(.*t.csv row 1\) and 'n/a\?' \(.*t.csv row 14\)"):
        prepare(spec_for(tmp_path / "t.csv", {"target": "y"}))
    # Declared categorical, the same column is read as categories.
    prepared = prepare(spec_for(tmp_path / "t.csv", {"target": "y", "categorical": ["amount"]}))
    assert prepared.schema.features[0].kind == "categorical"


def test_files_with_different_columns_and_unknown_named_columns_are_refused(tmp_path):
    write_csv(tmp_path / "a.csv", ["x", "y"], [[1, 0], [2, 1]])
    write_csv(tmp_path / "b.csv", ["x", "z", "y"], [[1, 0, 1]])
    with pytest.raises(DataError, match=r"b.csv: its columns differ from .*a.csv's: missing \[\], extra \['z'\]"):
        prepare(spec_for(tmp_path / "*.csv", {"target": "y"}))
    with pytest.raises(DataError, match=r"data.table.drop names \['nope'\], not columns of the table"):
        prepare(spec_for(tmp_path / "a.csv", {"target": "y", "drop": ["nope"]}))


def test_regression_needs_a_numeric_target_and_an_identifier_column_is_refused(tmp_path):
    write_csv(tmp_path / "t.csv", ["x", "y"], [[i, "high" if i % 2 else "low"] for i in range(20)])
    with pytest.raises(DataError, match=r"data.table.target 'y' must be numeric for tabular_regression; it holds text, e.g. 'low' at .*row 1"):
        prepare(spec_for(tmp_path / "t.csv", {"target": "y"}, task="tabular_regression"))
    write_csv(tmp_path / "ids.csv", ["user", "y"], [[f"u{i}", i % 2] for i in range(300)])
    with pytest.raises(DataError, match=r"column 'user' has \d+ distinct values in the training rows, more than data.table.max_categories \(50\)"):
        prepare(spec_for(tmp_path / "ids.csv", {"target": "y", "max_categories": 50}))


def test_a_test_category_never_seen_in_training_is_encoded_missing_and_counted(tmp_path):
    rows = [["common", i % 2] for i in range(100)] + [["rare", 0]]
    write_csv(tmp_path / "t.csv", ["c", "y"], rows)
    spec = spec_for(tmp_path / "t.csv", {"target": "y"})
    for seed in range(40):  # find a split that put the one rare row in the test split
        prepared = prepare_table(spec.data, spec.task, seed=seed)
        if prepared.stats["unseen_categories_in_test"]:
            break
    assert prepared.stats["unseen_categories_in_test"] == {"c": 1}
    assert np.isnan(prepared.test.x[:, 0]).sum() == 1


def test_a_missing_value_kept_as_its_own_category_is_never_counted_as_unseen(tmp_path):
    # `<missing>` is a training category here; the test rows' missing values are not unseen categories
    # (the count was once negative: missing values subtracted though they encode to a known code).
    rows = [[["red", "blue", None][i % 3], i % 2] for i in range(300)] + [["violet", 0]]
    write_csv(tmp_path / "t.csv", ["c", "y"], rows)
    spec = spec_for(tmp_path / "t.csv", {"target": "y"})
    counts = set()
    for seed in range(20):
        prepared = prepare_table(spec.data, spec.task, seed=seed)
        unseen = prepared.stats["unseen_categories_in_test"]
        assert all(v > 0 for v in unseen.values()), unseen
        counts.add(unseen.get("c", 0))
    assert counts == {0, 1}  # the one violet row is counted when the split puts it in the test rows
