"""The evaluation report weighs the run's measured training against a lifetime of inference when the spec
gives traffic."""

import json

import pytest

from runyard.plan.runlife import training_seconds
from runyard.run.execute import execute_run
from runyard.spec.job import parse_spec

from .test_planner import SPEC


def test_training_seconds_are_the_data_stage_and_each_stage_span_by_hand():
    stats = {"timings": {"clean_s": 1.0, "tokenize_s": 2.0}}
    rows = {"a": [{"step": 1, "time": 10.0}, {"step": 2, "time": 12.0}, {"step": 3, "time": 14.0}],
            "b": [{"step": 1, "time": 20.0}]}  # a single step has no span to measure
    assert training_seconds(stats, rows) == pytest.approx(3.0 + (4.0 + 2.0))


@pytest.mark.slow
def test_a_run_with_traffic_reports_its_lifetime(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNYARD_CACHE_DIR", str(tmp_path / "cache"))
    spec = parse_spec({**SPEC, "stages": [{"name": "main", "gates": {"min_loss_drop": None}}],
                       "traffic": {"requests_per_day": 20000, "tokens_per_request": 48, "horizon_days": 90},
                       "costs": {"prices": {"cpu": 3}}})
    summary = execute_run(spec, tmp_path / "run", show_progress=False)
    assert summary.evaluated
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    life = report["lifetime"]
    assert life["traffic"] == {"requests_per_day": 20000, "units_per_request": 48, "unit": "token",
                               "peak_to_mean": 2.0, "horizon_days": 90}
    # Training measured here: this process's CPU threads at the spec's 3 cents a core-hour.
    assert life["training"]["kind"] == "cpu" and life["training"]["price_per_device_hour"] == 3
    assert life["training"]["seconds"] > 0
    per_day = life["serving"]["cost_per_day"]["minor_units"]
    assert life["crossover_day"] == life["training"]["minor_units"] // per_day + 1
    assert [row["day"] for row in life["table"]] == [1, 7, 30, 90]
    markdown = (tmp_path / "run" / "eval" / "report.md").read_text()
    assert "## Training against a lifetime of inference" in markdown and "![lifetime.png](lifetime.png)" in markdown
    assert (tmp_path / "run" / "eval" / "lifetime.png").read_bytes()[:4] == b"\x89PNG"
