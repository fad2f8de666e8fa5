"""A table or an image folder the run could not train on stops `runyard plan` and `runyard run` before
any work: exit 2, the same message from both, naming the file, row, column or field, and the run
directory never made (no spec.yaml, manifest or environment lock)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from runyard.cli import main


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    path.write_text("\n".join([",".join(header)] + [",".join("" if v is None else str(v) for v in r) for r in rows]) + "\n")
    return path


def table_spec(tmp: Path, rows: list[list], header=("age", "region", "answer"), **table) -> Path:
    csv = write_csv(tmp / "survey.csv", list(header), rows)
    spec = {"task": "tabular_classification", "name": "bad-table", "resources": {"device": "cpu", "threads": 1},
            "data": {"sources": [{"path": str(csv), "format": "csv"}], "table": {"target": "answer", **table}}}
    (tmp / "spec.yaml").write_text(json.dumps(spec))
    return tmp / "spec.yaml"


def folder_spec(tmp: Path, break_it) -> Path:
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp / "imgs" / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8), mode="L").save(tmp / "imgs" / c / f"{i}.png")
    break_it(tmp / "imgs")
    spec = {"task": "image_classification", "name": "bad-images", "resources": {"device": "cpu", "threads": 1},
            "data": {"sources": [{"path": str(tmp / "imgs"), "format": "image_folder"}]}}
    (tmp / "spec.yaml").write_text(json.dumps(spec))
    return tmp / "spec.yaml"


GOOD = [[20 + i % 50, ["north", "south"][i % 2], "yes" if i % 3 else "no"] for i in range(60)]


def _empty_class(root: Path) -> None:
    (root / "c").mkdir()


def _mixed_sizes(root: Path) -> None:
    Image.fromarray(np.zeros((9, 8), dtype=np.uint8), mode="L").save(root / "b" / "9.png")


def _undecodable(root: Path) -> None:
    (root / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")


CASES = {
    "target column missing": (lambda t: table_spec(t, GOOD, header=("age", "region", "label")),
                              "data.table.target 'answer'", "has no such column"),
    "one class": (lambda t: table_spec(t, [[r[0], r[1], "yes"] for r in GOOD]), "has one class ('yes')", ""),
    "mixed types": (lambda t: table_spec(t, [[("n/a?" if i == 13 else r[0]), r[1], r[2]] for i, r in enumerate(GOOD)]),
                    "column 'age' mixes numbers and text", "'n/a?' ("),
    "missing value under error": (lambda t: table_spec(t, [[None if i == 4 else r[0], r[1], r[2]] for i, r in enumerate(GOOD)],
                                                       missing_numeric="error"),
                                  "column 'age' has 1 missing values", "survey.csv row 5"),
    "empty class folder": (lambda t: folder_spec(t, _empty_class), "class folder", "is empty"),
    "mixed image sizes": (lambda t: folder_spec(t, _mixed_sizes), "9.png is 8x9 (width x height)", "data.images.resize"),
    "image that does not decode": (lambda t: folder_spec(t, _undecodable), "broken.png does not decode as an image", ""),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_is_refused_by_plan_and_run_before_any_work(case, tmp_path, capsys):
    make, says, also = CASES[case]
    spec = make(tmp_path)
    run_dir = tmp_path / "run"
    assert main(["plan", str(spec), "--no-calibrate"]) == 2
    planned = capsys.readouterr().err
    assert main(["run", str(spec), "--run-dir", str(run_dir), "--no-progress"]) == 2
    ran = capsys.readouterr().err
    assert not run_dir.exists()  # nothing written: no spec.yaml, manifest or environment lock
    assert planned == ran
    assert says in ran and also in ran and "refused before any work" in ran
