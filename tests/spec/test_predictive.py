"""A spec's task and its sections must agree: each disagreement is a SpecError naming its field."""

from __future__ import annotations

import pytest
import yaml

from runyard.errors import SpecError
from runyard.spec.job import dump_spec, parse_spec, resolved_stage
from runyard.spec.templates import TEMPLATES


def tabular(**over):
    base = {"task": "tabular_classification", "name": "t",
            "data": {"sources": [{"path": "t.csv", "format": "csv"}], "table": {"target": "y"}}}
    base.update(over)
    return base


def problems(raw) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(raw)
    return {path: expected for path, _value, expected in info.value.problems}


def test_a_tabular_spec_needs_a_target_and_table_formats():
    found = problems({"task": "tabular_regression", "name": "t", "data": {"sources": [{"path": "a.txt"}]}})
    assert "data.table" in found and "needs data.table naming at least its target column" in found["data.table"]
    assert "one of csv, parquet, sklearn for task tabular_regression" in found["data.sources[0].format"]
    assert "it defaults to text; set format: for 'a.txt'" in found["data.sources[0].format"]  # left unset
    stated = problems({"task": "tabular_regression", "name": "t", "data": {"sources": [{"path": "a", "format": "jsonl"}]}})
    assert "defaults" not in stated["data.sources[0].format"]
    found = problems(tabular(data={"sources": [{"path": "digits", "format": "sklearn"}], "table": {"target": "y"}},
                             task="tabular_regression"))
    assert "a data set scikit-learn ships for task tabular_regression: one of diabetes" in found["data.sources[0].path"]


def test_fields_of_another_task_are_errors_not_silently_ignored():
    found = problems(tabular(model={"d_model": 64, "cnn": {"channels": [4]}}, train={"steps": 5},
                             resources={"nproc": 2}, stages=[{"name": "main", "gates": {"min_tokens_per_s": 5}}]))
    assert "a language-model field" in found["model.d_model"]
    assert "model.cnn is the image family's" in found["model.cnn"]
    assert "fit by LightGBM or scikit-learn" in found["train"]
    assert "1: task tabular_classification fits in one process" in found["resources.nproc"]
    assert "a language-model gate" in found["stages[0].gates.min_tokens_per_s"]
    found = problems({"name": "lm", "data": {"sources": [{"path": "a"}], "table": {"target": "y"}},
                      "eval": {"prediction": {"min_accuracy": 0.9}}})
    assert "for the tabular and image tasks" in found["data.table"] and "eval.prediction" in found


def test_families_must_belong_to_the_task():
    found = problems(tabular(model={"family": "cnn"}))
    assert found["model.family"].startswith("one of lightgbm, linear for task tabular_classification")
    found = problems({"task": "image_classification", "name": "i", "data": {"sources": [{"path": "d", "format": "npz"}]},
                      "stages": [{"name": "a", "model": {"family": "lightgbm"}}]})
    assert found["stages[0].model.family"].startswith("one of cnn for task image_classification")


def test_a_stage_changes_a_family_section_field_by_field():
    spec = parse_spec({"task": "image_classification", "name": "i",
                       "data": {"sources": [{"path": "digits", "format": "sklearn"}]},
                       "model": {"family": "cnn", "cnn": {"channels": [8, 16], "hidden": 32}},
                       "stages": [{"name": "smoke", "model": {"cnn": {"hidden": 4}}}, {"name": "main"}]})
    smoke, main = resolved_stage(spec, "smoke").model.cnn, resolved_stage(spec, "main").model.cnn
    assert smoke.channels == [8, 16] and smoke.hidden == 4 and main.hidden == 32
    assert spec.model.family == "cnn"
    assert parse_spec(tabular()).model.family is None  # left to the data (runyard.plan.families.recommend_family)


@pytest.mark.parametrize("task", ["tabular_classification", "tabular_regression", "image_classification"])
def test_a_stored_spec_with_every_default_written_out_loads_again(task):
    # A run directory stores the resolved spec (defaults included); resume must accept it as it is.
    spec = parse_spec(TEMPLATES[task]("x"))
    again = parse_spec(yaml.safe_load(dump_spec(spec)))
    assert again.fingerprint() == spec.fingerprint()
