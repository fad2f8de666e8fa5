"""`runyard plan` reads every documented source of a table or images through the run's own readers: an
image folder (as the docs write it: a folder of class folders), a glob of PNGs, .npz arrays, the sets
scikit-learn ships, CSV and Parquet each plan, with the rows, features, classes and image shape the
run's data stage then sees (prepare_table / prepare_images, the very calls run/predictive.py makes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from runyard.cli import main
from runyard.data.image_prep import prepare_images
from runyard.data.tabular import prepare_table
from runyard.plan.task_data import split_seed
from runyard.spec.job import load_spec

pytest.importorskip("sklearn")


def image_folder(root: Path, classes=("cat", "dog", "owl"), per_class: int = 7, size=(10, 12)) -> Path:
    rng = np.random.default_rng(1)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, size=size, dtype=np.uint8), mode="L").save(root / c / f"{i}.png")
    return root


def survey_rows(n: int = 80) -> dict[str, list]:
    rng = np.random.default_rng(2)
    return {"respondent": list(range(n)), "age": [int(a) for a in rng.integers(18, 80, n)],
            "region": [["north", "south", None][i % 3] for i in range(n)],
            "score": [float(s) for s in rng.normal(size=n).round(3)], "answer": ["yes" if i % 3 else "no" for i in range(n)]}


def write_csv(path: Path, rows: dict[str, list]) -> Path:
    names = list(rows)
    lines = [",".join(names)] + [",".join("" if rows[k][i] is None else str(rows[k][i]) for k in names)
                                 for i in range(len(rows[names[0]]))]
    path.write_text("\n".join(lines) + "\n")
    return path


def spec_file(tmp: Path, task: str, sources: list[dict], **data) -> Path:
    spec = {"task": task, "name": "sources", "data": {"sources": sources, **data}}
    path = tmp / "spec.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def planned_facts(spec: Path, capsys) -> dict:
    assert main(["plan", str(spec), "--no-calibrate", "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["data"]["facts"]


def images_case(tmp: Path, kind: str) -> Path:
    if kind == "folder":
        return spec_file(tmp, "image_classification", [{"path": str(image_folder(tmp / "imgs")), "format": "image_folder"}])
    if kind == "glob":
        image_folder(tmp / "imgs")
        return spec_file(tmp, "image_classification", [{"path": str(tmp / "imgs" / "*" / "*.png"), "format": "image_folder"}])
    if kind == "npz":
        rng = np.random.default_rng(3)
        np.savez(tmp / "a.npz", x=rng.integers(0, 255, (40, 9, 9, 3), dtype=np.uint8), y=np.arange(40) % 4)
        return spec_file(tmp, "image_classification", [{"path": str(tmp / "a.npz"), "format": "npz"}])
    return spec_file(tmp, "image_classification", [{"path": "digits", "format": "sklearn"}])


@pytest.mark.parametrize(("kind", "rows", "shape", "classes"), [
    ("folder", 21, [1, 10, 12], 3), ("glob", 21, [1, 10, 12], 3), ("npz", 40, [3, 9, 9], 4),
    ("sklearn", 1797, [1, 8, 8], 10)])
def test_every_image_source_plans_with_what_the_runs_reader_sees(kind, rows, shape, classes, tmp_path, capsys):
    spec = images_case(tmp_path, kind)
    facts = planned_facts(spec, capsys)
    loaded = load_spec(spec)
    prepared = prepare_images(loaded.data, split_seed(loaded.seed), tmp_path / "cache")
    seen = sum(prepared.stats["split"]["counts"].values())
    assert (facts["rows"], facts["image_shape"], facts["classes"]) == (seen, list(prepared.shape), prepared.n_classes)
    assert (seen, list(prepared.shape), prepared.n_classes) == (rows, shape, classes)
    assert facts["features"] == int(np.prod(shape))


def table_case(tmp: Path, kind: str) -> tuple[Path, str]:
    if kind == "csv":
        path = write_csv(tmp / "survey.csv", survey_rows())
        return spec_file(tmp, "tabular_classification", [{"path": str(path), "format": "csv"}],
                         table={"target": "answer", "drop": ["respondent"]}), "tabular_classification"
    if kind == "csv-glob":
        rows = survey_rows()
        write_csv(tmp / "part-1.csv", {k: v[:40] for k, v in rows.items()})
        write_csv(tmp / "part-2.csv", {k: v[40:] for k, v in rows.items()})
        return spec_file(tmp, "tabular_classification", [{"path": str(tmp / "part-*.csv"), "format": "csv"}],
                         table={"target": "answer", "drop": ["respondent"]}), "tabular_classification"
    if kind == "parquet":
        pq.write_table(pa.table(survey_rows()), tmp / "survey.parquet")
        return spec_file(tmp, "tabular_regression", [{"path": str(tmp / "survey.parquet"), "format": "parquet"}],
                         table={"target": "score", "drop": ["respondent"]}), "tabular_regression"
    return spec_file(tmp, "tabular_classification", [{"path": "wine", "format": "sklearn"}],
                     table={"target": "target"}), "tabular_classification"


@pytest.mark.parametrize(("kind", "rows", "features", "classes"), [
    ("csv", 80, 3, 2), ("csv-glob", 80, 3, 2), ("parquet", 80, 3, None), ("sklearn", 178, 13, 3)])
def test_every_table_source_plans_with_what_the_runs_reader_sees(kind, rows, features, classes, tmp_path, capsys):
    spec, task = table_case(tmp_path, kind)
    facts = planned_facts(spec, capsys)
    loaded = load_spec(spec)
    prepared = prepare_table(loaded.data, task, split_seed(loaded.seed))
    seen = prepared.train.rows + prepared.valid.rows + prepared.test.rows
    counted = (seen, len(prepared.schema.features), len(prepared.schema.classes) if prepared.schema.classes else None)
    assert (facts["rows"], facts["features"], facts["classes"]) == counted == (rows, features, classes)
    # The features are the run's: the dropped id and the target are not among them.
    assert "respondent" not in prepared.schema.names and loaded.data.table.target not in prepared.schema.names


def test_plan_help_says_what_is_calibrated_and_what_is_estimated(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "every stage is calibrated here" in text and "real fits of two row samples" in text
    assert "measured once per machine by a tiny real run" in text
    assert "read and checked in full by the run's own reader" in text
