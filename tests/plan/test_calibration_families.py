"""Every family's plan is calibrated here: trees and the linear model by real fits of row samples of the
user's own table, the CNN by real training steps at the stage's batch, and a table's or images' fixed costs
(start-up, environment, reports, export, ONNX) by a tiny real run measured once and cached. Timings are
never compared with a threshold: what is checked is that the measurement happened, that it scales as its
model says (more rows, rounds or steps: proportionally more time) and that the plan names what it measured."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runyard.cli import main
from runyard.model.registry import get_family
from runyard.plan.calibrate import calibrate_stage, table_machine
from runyard.plan.fit_calibration import calibrate_fit, table_facts_of
from runyard.plan.fixed_costs import PARTS, fixed_costs
from runyard.plan.planner import stage_phases
from runyard.plan.sizing import plan_stage
from runyard.plan.task_data import check_task_data
from runyard.spec.job import OptimSpec, load_spec, resolved_stage

pytest.importorskip("lightgbm")
pytest.importorskip("sklearn")


def write_table(path: Path, rows: int) -> Path:
    gen = np.random.default_rng(0)
    x = gen.normal(size=(rows, 6)).round(4)
    colour = gen.choice(["red", "green", "blue"], size=rows)
    label = np.where(x[:, 0] + x[:, 1] > 0, "yes", "no")
    lines = ["a,b,c,d,e,f,colour,label"] + [",".join([*map(str, x[i]), colour[i], label[i]]) for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def table_spec(tmp: Path, rows: int, family: str | None = None) -> Path:
    spec = {"task": "tabular_classification", "name": "calibrated-table", "seed": 0,
            "data": {"sources": [{"path": str(write_table(tmp / "table.csv", rows)), "format": "csv"}],
                     "table": {"target": "label"}},
            "model": {"trees": {"num_boost_round": 60, "early_stopping_rounds": 10}, **({"family": family} if family else {})},
            "stages": [{"name": "main"}], "resources": {"device": "cpu", "threads": 1}}
    path = tmp / "table.yaml"
    path.write_text(json.dumps(spec))
    return path


def image_spec(tmp: Path, steps: int = 20) -> Path:
    gen = np.random.default_rng(1)
    np.savez(tmp / "images.npz", x=gen.integers(0, 255, (60, 12, 12), dtype=np.uint8), y=np.arange(60) % 3)
    spec = {"task": "image_classification", "name": "calibrated-images", "seed": 0,
            "data": {"sources": [{"path": str(tmp / "images.npz"), "format": "npz"}]},
            "model": {"family": "cnn", "cnn": {"channels": [8], "hidden": 16}},
            "train": {"steps": steps, "batch_size": 16}, "stages": [{"name": "main"}],
            "resources": {"device": "cpu", "threads": 1}}
    path = tmp / "images.yaml"
    path.write_text(json.dumps(spec))
    return path


@pytest.fixture(scope="module")
def plan_cache(tmp_path_factory):
    """One machine measurement of the fixed costs for the module (a tiny real run; cached after)."""
    return tmp_path_factory.mktemp("plan-cache")


@pytest.mark.parametrize("family", ["lightgbm", "linear"])
def test_a_fit_is_timed_on_row_samples_and_scales_with_rows(family, tmp_path, monkeypatch):
    import runyard.plan.fit_calibration as fc

    spec = load_spec(table_spec(tmp_path, 1200))
    table = check_task_data(spec.task, spec.data, spec.seed).table
    fam = get_family(family)
    config = fam.config_from_spec(resolved_stage(spec, "main").model, table=table_facts_of(table))
    monkeypatch.setattr(fc, "SAMPLE_ROWS", 200)  # samples smaller than the table: the estimate extrapolates
    cal = calibrate_fit(fam, config, table, 0, 1, budget_s=0.5)
    assert cal.rows == (100, 200) and cal.train_rows == table.train.rows > 200
    assert cal.repeats >= 1 and min(cal.seconds) > 0 and cal.spread >= 0
    if family == "lightgbm":
        assert 1 <= cal.best_round <= cal.rounds <= 60  # early stopping's rounds, from the spec's own fit
    else:
        assert cal.rounds == 1
    # R x (a + b x rows): more rows cost more, never more than in proportion to the larger sample's fit.
    assert cal.seconds[1] <= cal.estimate_s * 1.0001
    assert cal.estimate_s <= cal.rounds * (cal.seconds[1] / cal.rounds) * cal.train_rows / 200 * 1.0001
    assert "real fits here of 100 and 200 training rows" in cal.describe()


def test_a_table_the_sample_holds_is_estimated_by_its_own_fit(tmp_path):
    spec = load_spec(table_spec(tmp_path, 300))
    table = check_task_data(spec.task, spec.data, spec.seed).table
    fam = get_family("lightgbm")
    config = fam.config_from_spec(resolved_stage(spec, "main").model, table=table_facts_of(table))
    cal = calibrate_fit(fam, config, table, 0, 1, budget_s=0.3)
    assert cal.rows[1] == table.train.rows
    assert cal.estimate_s == pytest.approx(cal.seconds[1])  # the table itself was fit: no extrapolation
    more = dataclasses.replace(config, num_boost_round=cal.rounds * 4, early_stopping_rounds=None)
    longer = calibrate_fit(fam, more, table, 0, 1, budget_s=0.3)
    assert longer.rounds == cal.rounds * 4
    # Four times the rounds: more time, within a loose factor of four times (a fit also builds its dataset).
    assert 1.2 < longer.estimate_s / cal.estimate_s < 12


def test_the_cnn_is_calibrated_on_real_steps_over_a_time_budget(tmp_path):
    spec = load_spec(image_spec(tmp_path))
    facts = {"shape": (1, 12, 12), "n_classes": 3}
    cnn = get_family("cnn")
    config = cnn.config_from_spec(resolved_stage(spec, "main").model, **facts)
    x, y = cnn.synthetic_batch(config, 16, torch.Generator().manual_seed(0))
    assert x.shape == (16, 1, 12, 12) and x.min() >= 0 and x.max() <= 1 and y.max() < 3
    machine = dataclasses.replace(table_machine("cpu", 1), calibrated=True)
    cal = calibrate_stage("main", cnn, config, OptimSpec(), 16, machine, "fp32", 1, budget_s=1.0)
    assert cal is not None and cal.steps >= 2 and cal.forward_backward_s > 0 and cal.spread >= 0
    phases, how = stage_phases(spec, plan_stage(spec, "main", data_facts=facts), machine, cal)
    longer = load_spec(image_spec(tmp_path, steps=80))
    phases4, _ = stage_phases(longer, plan_stage(longer, "main", data_facts=facts), machine, cal)
    step = cal.forward_backward_s + cal.optimizer_s
    assert phases4["training"] - phases["training"] == pytest.approx(60 * step)  # steps x the measured step
    assert f"{cal.steps} real steps" in how and "spread" in how


def test_fixed_costs_are_measured_once_by_a_tiny_run_and_cached(plan_cache, monkeypatch):
    monkeypatch.setenv("RUNYARD_PLAN_CACHE", str(plan_cache))
    first = fixed_costs("tabular_classification", "lightgbm", 1)
    assert first.measured and "measured now by a tiny real run" in first.how
    assert set(first.parts) == set(PARTS) and all(v >= 0 for v in first.parts.values())
    assert first.parts["start-up"] > 0 and first.parts["export"] > 0
    again = fixed_costs("tabular_classification", "lightgbm", 1)
    assert "cached in" in again.how and "scaled x" in again.how
    # The cached parts, scaled by one factor (this core's speed now against then).
    factor = again.parts["start-up"] / first.parts["start-up"]
    assert again.parts == pytest.approx({k: v * factor for k, v in first.parts.items()})
    stated = fixed_costs("tabular_classification", "lightgbm", 1, measure=False)
    assert not stated.measured and "stated" in stated.how


def test_a_table_plan_names_its_measured_fits_and_fixed_costs(plan_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RUNYARD_PLAN_CACHE", str(plan_cache))
    spec = table_spec(tmp_path, 400)
    assert main(["plan", str(spec), "--budget-s", "0.5"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "calibrated: real fits here of" in out and "spread" in out
    assert "linear baseline" in out  # the trees' run fits the linear model beside them: calibrated too
    assert "fixed costs of the run:" in out and "start-up" in out and "export" in out
    assert main(["plan", str(spec), "--budget-s", "0.5", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    stage = plan["stages"][0]
    assert stage["fit_calibration"]["repeats"] >= 1 and stage["phases"]["training"] > 0
    assert plan["fixed_costs"]["measured"]
    parts = plan["fixed_costs"]["parts"]
    # The total counts the data, the stage, the final phase and every fixed part once.
    total = (plan["data"]["seconds"] + sum(s["estimated_seconds"] for s in plan["stages"])
             + sum(plan["final_phases"].values()) + sum(parts.values()) - parts["stage setup"])
    assert plan["estimated_seconds"] == pytest.approx(total)


@pytest.mark.full  # a second tiny run (the image run's fixed costs): the table's test covers the rest fast
def test_an_image_plan_names_its_measured_steps_and_fixed_costs(plan_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RUNYARD_PLAN_CACHE", str(plan_cache))
    spec = image_spec(tmp_path)
    assert main(["plan", str(spec), "--budget-s", "0.5", "--json"]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    stage = plan["stages"][0]
    assert stage["calibration"]["steps"] >= 1 and "real step" in stage["how"] and "spread" in stage["how"]
    assert plan["fixed_costs"]["measured"] and plan["fixed_costs"]["parts"]["export"] > 0
    assert plan["final_phases"]["test predictions"] > 0  # the run's test split, at the measured forward pass
