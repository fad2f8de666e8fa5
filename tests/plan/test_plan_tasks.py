"""`runyard plan` on a table and on images, as a user runs it on the shipped examples and on their own CSV:
the family the run would train (recommended when the spec leaves it out), sized from the data's counted
facts, with no data prepared. (The language model's plan is tested in test_planner.py.)"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from runyard.model import choice
from runyard.model.registry import FamilyUnavailable, get_family
from runyard.plan.planner import make_plan
from runyard.run.preflight import preflight
from runyard.spec.job import parse_spec

REPO = Path(__file__).resolve().parents[2]


def _plan(spec: Path, cwd: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "runyard", "plan", str(spec), "--no-calibrate", "--json"],
                         capture_output=True, text=True, cwd=cwd, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize(("example", "family", "rows", "classes"), [
    ("tabular-wine.yaml", "lightgbm", 178, 3),
    ("digits-cnn.yaml", "cnn", 1797, 10),
])
def test_the_shipped_table_and_image_examples_plan(example, family, rows, classes, tmp_path):
    pytest.importorskip("sklearn")
    plan = _plan(REPO / "examples" / example, tmp_path)
    facts = plan["data"]["facts"]
    assert (facts["rows"], facts["classes"]) == (rows, classes)
    assert [s["family"] for s in plan["stages"]] == [family]
    assert plan["stages"][0]["parameters"] > 0
    assert "sklearn:" in plan["preflight"]["sources"][0]["path"]


def test_a_csv_table_without_a_family_is_planned_with_the_one_the_run_would_choose(tmp_path):
    pytest.importorskip("lightgbm")
    with open(tmp_path / "t.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["a", "b", "label"])
        for i in range(60):  # under 100 rows: too few for trees, the linear model is chosen
            w.writerow([i, i % 7, "yes" if i % 3 else "no"])
    (tmp_path / "spec.yaml").write_text(
        "task: tabular_classification\nname: small\ndata:\n  sources:\n    - {path: t.csv, format: csv}\n"
        "  table: {target: label}\n")
    plan = _plan(tmp_path / "spec.yaml", tmp_path)
    assert (plan["data"]["facts"]["rows"], plan["data"]["facts"]["features"], plan["data"]["facts"]["classes"]) == (60, 2, 2)
    assert plan["family"]["family"] == "linear" and plan["stages"][0]["family"] == "linear"


def test_an_unknown_bundled_set_is_a_spec_error_naming_the_source(tmp_path):
    (tmp_path / "spec.yaml").write_text(
        "task: tabular_classification\nname: x\ndata:\n  sources:\n    - {path: nosuchset, format: sklearn}\n"
        "  table: {target: y}\n")
    out = subprocess.run([sys.executable, "-m", "runyard", "plan", "spec.yaml", "--no-calibrate"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 2 and "data.sources[0].path" in out.stderr and "nosuchset" in out.stderr


def test_a_table_without_its_extra_is_refused_naming_the_extra(tmp_path, monkeypatch):
    (tmp_path / "t.csv").write_text("a,y\n" + "".join(f"{i},{i % 2}\n" for i in range(20)))
    spec = parse_spec({"task": "tabular_classification", "name": "t",
                       "data": {"sources": [{"path": str(tmp_path / "t.csv"), "format": "csv"}], "table": {"target": "y"}}})
    monkeypatch.setattr(choice, "installed_families", lambda: [get_family("decoder"), get_family("cnn")])
    with pytest.raises(FamilyUnavailable, match=r"runyard\[predict\]"):
        make_plan(spec, preflight(spec, tmp_path / "run").files, tmp_path / "run", calibrate=False)
