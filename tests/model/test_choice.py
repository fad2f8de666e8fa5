"""The one family rule (runyard.model.choice): the task's kind of data picks loop-trained families or
not, and each family's `min_rows` decides between those that fit."""

from __future__ import annotations

import pytest

from runyard.model import registry
from runyard.model.choice import choose_family, needs_deep_network
from tests.model.toy_family import ToyFamily


def test_the_registered_families_by_task_and_rows():
    pytest.importorskip("lightgbm")  # the tabular families register with the predict extra only
    pytest.importorskip("sklearn")
    assert choose_family("language_model", None).family.name == "decoder"
    assert choose_family("image_classification", 10).family.name == "cnn"
    big = choose_family("tabular_classification", 569)
    assert big.family.name == "lightgbm" and big.wanting_more_rows == ()
    small = choose_family("tabular_regression", 99)
    assert small.family.name == "linear"
    assert [f.name for f in small.wanting_more_rows] == ["lightgbm"] and small.fewest_rows_wanted == 100
    assert choose_family("tabular_regression", 100).family.name == "lightgbm"  # the threshold is inclusive
    assert choose_family("tabular_regression", None).family.name == "lightgbm"  # rows not counted: as if plenty


def test_the_family_wanting_the_most_rows_the_data_has_wins(monkeypatch):
    pytest.importorskip("lightgbm")  # the registered trees are one of the contenders
    for family in (ToyFamily("aa-deep-tabular", ("tabular_classification",), deep=True, min_rows=0),
                   ToyFamily("zz-big", ("tabular_classification",), deep=False, min_rows=10_000)):
        monkeypatch.setitem(registry._FAMILIES, family.name, family)
    assert choose_family("tabular_classification", 10_000).family.name == "zz-big"
    mid = choose_family("tabular_classification", 5_000)
    assert mid.family.name == "lightgbm"  # never the deep tabular family: low-dimensional data
    assert {f.name for f in mid.wanting_more_rows} == {"zz-big"} and mid.fewest_rows_wanted == 10_000


def test_no_family_and_unknown_tasks(monkeypatch):
    monkeypatch.setattr(type(registry.get_family("cnn")), "tasks", ())
    assert choose_family("image_classification", 10).family is None
    assert needs_deep_network("language_model") and not needs_deep_network("tabular_regression")
    with pytest.raises(ValueError, match="unknown task 'audio'"):
        choose_family("audio", 10)
