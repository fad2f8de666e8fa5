"""A run's family (a spec that leaves `model.family` out) and `runyard plan`'s recommendation come from
one rule, runyard.model.choice: for the same data they name the same family."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from runyard.model.registry import FamilyUnavailable, get_family
from runyard.plan.dataprep import estimate_data
from runyard.plan.families import recommend_family
from runyard.plan.recommend import recommend_family as plan_recommendation
from runyard.plan.task_data import summarize_data
from runyard.run.predictive import run_family
from runyard.run.preflight import resolve_sources
from runyard.spec.job import parse_spec


def _table(tmp_path, rows: int):
    path = tmp_path / f"t{rows}.csv"
    rng = np.random.default_rng(rows)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["a", "b", "y"])
        writer.writerows([[f"{a:.3f}", f"{b:.3f}", int(a + b > 0)] for a, b in rng.normal(size=(rows, 2))])
    return {"task": "tabular_classification", "name": "t", "data": {"sources": [{"path": str(path), "format": "csv"}],
                                                                  "table": {"target": "y"}}}


def _images(tmp_path):
    path = tmp_path / "digits.npz"
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.integers(0, 255, size=(30, 8, 8), dtype=np.uint8), y=np.arange(30) % 3)
    return {"task": "image_classification", "name": "i", "data": {"sources": [{"path": str(path), "format": "npz"}]}}


def _text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    return {"name": "lm", "data": {"sources": [{"path": str(path)}], "tokenizer": {"vocab_size": 300}}}


@pytest.mark.parametrize(("data", "family"), [(lambda p: _table(p, 60), "linear"),
                                              (lambda p: _table(p, 300), "lightgbm"),
                                              (_images, "cnn"),
                                              (_text, "decoder")],
                         ids=["small-table", "large-table", "images", "text"])
def test_the_run_and_the_plan_choose_the_same_family_for_the_same_data(tmp_path, data, family):
    spec = parse_spec(data(tmp_path))
    files, _ = resolve_sources(spec.data)
    facts = estimate_data(spec.task, spec.data, spec.seed, files, 1, measure=False).facts
    planned = plan_recommendation(spec.task, facts)
    # A language model's spec names the decoder itself (runyard.spec.job); cleared, so the run's rule answers.
    left_to_data = spec.model_copy(update={"model": spec.model.model_copy(update={"family": None})})
    ran, chosen = run_family(left_to_data, summarize_data(spec))
    assert planned.family == ran == family
    assert chosen.startswith("recommended from the data")


def test_a_small_table_says_which_family_wanted_more_rows(tmp_path):
    spec = parse_spec(_table(tmp_path, 60))
    rec = recommend_family(spec.task, summarize_data(spec))
    assert rec.family == "linear" and rec.reason.startswith("a table of 60 rows (< 100): too few for lightgbm;")
    files, _ = resolve_sources(spec.data)
    why = plan_recommendation(spec.task, estimate_data(spec.task, spec.data, spec.seed, files, 1, measure=False).facts).why
    assert "60 rows are too few for lightgbm (< 100)" in why and get_family("linear").why_recommended in why


def test_a_run_with_no_family_for_its_task_says_what_to_install(monkeypatch):
    monkeypatch.setattr(type(get_family("cnn")), "tasks", ())
    with pytest.raises(FamilyUnavailable, match="no registered family trains 'image_classification'.*runyard\\[predict\\]"):
        recommend_family("image_classification")
