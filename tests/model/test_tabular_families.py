"""The tabular families (LightGBM trees, the linear model): fit with early stopping on held-out rows,
their history, their export round trip, and the linear model's numpy prediction against scikit-learn's."""

from __future__ import annotations

import numpy as np
import pytest

from runyard.model import get_family
from runyard.model.tabular import TableFacts, table_loss
from runyard.spec.predictive import LinearSpec, TreesSpec
from runyard.spec.sections import ModelSpec


def make_table(n=400, seed=0, classes=2):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    x[:, 3] = rng.integers(0, 3, size=n)  # a categorical feature (codes)
    score = x[:, 0] + 0.5 * x[:, 1] + (x[:, 3] == 2) + rng.normal(scale=0.3, size=n)
    y = np.digitize(score, np.quantile(score, np.linspace(0, 1, classes + 1)[1:-1])) if classes else score
    x[rng.random(n) < 0.05, 2] = np.nan  # some missing values
    return x, y


FACTS = TableFacts(4, (3,), 2, ("a", "b", "c", "k"))


def split(x, y):
    return x[:250], y[:250], x[250:320], y[250:320], x[320:], y[320:]


def test_trees_early_stop_on_the_validation_rows_and_keep_the_best_round():
    x, y = make_table()
    tx, ty, vx, vy, _, _ = split(x, y)
    family = get_family("lightgbm")
    cfg = family.config_from_spec(ModelSpec(family="lightgbm", trees=TreesSpec(num_boost_round=2000, learning_rate=0.3,
                                                                                 early_stopping_rounds=10)), table=FACTS)
    fit = family.fit(cfg, tx, ty, vx, vy, seed=1, threads=1)
    assert fit.best_step < len(fit.history) < 2000  # stopped early, after `early_stopping_rounds` without a gain
    assert len(fit.history) - fit.best_step == 10
    best = min(r["heldout_loss"] for r in fit.history)
    assert fit.history[fit.best_step - 1]["heldout_loss"] == best
    # The kept model is cut at the best round: its validation loss is that round's.
    assert table_loss(2, fit.model.predict(vx), vy) == pytest.approx(best, rel=1e-9)
    again = family.fit(cfg, tx, ty, vx, vy, seed=1, threads=1)
    assert np.array_equal(again.model.predict(vx), fit.model.predict(vx))  # deterministic


def test_trees_and_linear_export_and_load_give_the_same_predictions(tmp_path):
    x, y = make_table(classes=3)
    tx, ty, vx, vy, test_x, _ = split(x, y)
    facts = TableFacts(4, (3,), 3)
    for name in ("lightgbm", "linear"):
        family = get_family(name)
        cfg = family.config_from_spec(ModelSpec(family=name), table=facts)
        fit = family.fit(cfg, tx, ty, vx, vy, seed=0, threads=1)
        out = tmp_path / name
        out.mkdir()
        family.export_files(fit.model, cfg, out)
        loaded = family.load_files(out, family.config_from_dict(family.config_to_dict(cfg)))
        assert np.array_equal(loaded.predict(test_x), fit.model.predict(test_x)), name
        assert fit.model.predict(test_x).shape == (len(test_x), 3)


def test_the_linear_models_numpy_prediction_equals_scikit_learns():
    for classes in (2, 3, None):
        x, y = make_table(classes=classes, seed=classes or 7)
        tx, ty, vx, vy, test_x, _ = split(x, y)
        family = get_family("linear")
        cfg = family.config_from_spec(ModelSpec(family="linear", linear=LinearSpec(l2=0.5)),
                                      table=TableFacts(4, (3,), classes))
        fit = family.fit(cfg, tx, ty, vx, vy, seed=0, threads=1)
        ours = fit.model.predict(test_x)
        theirs = fit.model.pipeline.predict_proba(test_x) if classes else fit.model.pipeline.predict(test_x)
        assert np.allclose(ours, theirs, rtol=1e-10, atol=1e-12), classes
        # The history starts at the intercept-only model, and the fit must do better than it.
        assert [r["step"] for r in fit.history] == [0, 1] and fit.history[1]["loss"] < fit.history[0]["loss"]


def test_tabular_sizing_counts_from_the_config():
    trees = get_family("lightgbm")
    cfg = trees.config_from_spec(ModelSpec(family="lightgbm", trees=TreesSpec(num_boost_round=100, num_leaves=8)),
                                 table=TableFacts(10, (), 3))
    size = trees.sizing(cfg, micro_batch=1000)
    assert size.unit == "row" and size.parameters == 2 * 100 * 3 * 8  # a tree per class per round
    assert size.flops_per_unit == 2 * 10 * 300 and size.activation_bytes == 1000 * 10
    linear = get_family("linear")
    lcfg = linear.config_from_spec(ModelSpec(family="linear"), table=TableFacts(10, (), 3))
    assert linear.sizing(lcfg).parameters == 3 * 11
