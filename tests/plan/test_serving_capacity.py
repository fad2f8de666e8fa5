"""Serving hardware by need (issue 28 items 3 and 6): every kind, a CPU core included, is a candidate for
every family and the cheapest day at the traffic wins; a table's capacity is its POST /v1/predict measured
here through the real server, and the printed plan names the figure and where it came from."""

import json
import time

import numpy as np
import pytest
import yaml
from starlette.testclient import TestClient
from threadpoolctl import threadpool_limits

from runyard import cli
from runyard.data.table_schema import encode_records
from runyard.data.tabular import prepare_table
from runyard.model.registry import Sizing, get_family
from runyard.model.tabular import TableFacts
from runyard.plan.cost import cost_of
from runyard.plan.lifetime import Traffic, lifetime_of, serving_kinds, table_capacity
from runyard.plan.planner import make_plan
from runyard.plan.serving_capacity import PredictTiming, cache_root, measured_timing
from runyard.run.preflight import resolve_sources
from runyard.run.serving_probe import predict_probe
from runyard.serve.feature_drift import FeatureReference
from runyard.serve.predict import create_predict_app
from runyard.serve.predict_export import Predictor
from runyard.spec.job import CostsSpec, load_spec, parse_spec, resolved_stage

from .test_planner import SPEC


def test_a_small_decoder_at_modest_traffic_serves_on_a_cpu(tmp_path, monkeypatch, capsys):
    # The planner's tiny decoder at 3,000 requests a day of its 32-token context: one CPU core carries
    # the peak for under 1 USD a day, a fifth or less of the cheapest GPU's day.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RUNYARD_CACHE_DIR", str(tmp_path / "cache"))
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    assert cli.main(["plan", str(spec), "--no-calibrate", "--json", "--traffic", "3000"]) == 0
    life = json.loads(capsys.readouterr().out)["lifetime"]
    assert (life["serving"]["kind"], life["serving"]["devices"]) == ("cpu", 1)
    gpus = [c for c in life["candidates"] if c["kind"] != "cpu"]
    assert gpus and min(c["cost_per_day"] for c in gpus) > 5 * life["serving"]["cost_per_day"]["minor_units"]
    assert "the table says GPUs for a language model" in life["check"]


def test_a_one_billion_parameter_decoder_at_a_billion_tokens_a_day_serves_on_gpus():
    spec = parse_spec({**SPEC, "model": {"d_model": 2048, "n_layers": 18, "n_heads": 16, "context_length": 1024}})
    stage = resolved_stage(spec, "main")
    family = get_family("decoder")
    size = family.sizing(family.config_from_spec(stage.model, vocab_size=32000))
    assert 0.8e9 < size.parameters < 1.3e9
    traffic = Traffic(1_000_000, 1000, "token")  # 1e9 tokens a day
    costs = CostsSpec()
    caps = [table_capacity(k, "language_model", size, traffic) for k in serving_kinds("language_model")]
    life = lifetime_of("language_model", cost_of("h100-80gb", 1, 3600, costs), caps, traffic, costs)
    assert life.serving.capacity.kind != "cpu"
    cpu = next(c for c in life.candidates if c["kind"] == "cpu")
    assert cpu["devices"] > 100 and cpu["cost_per_day"] > life.serving.cost_per_day.minor_units
    assert life.check == ""  # GPUs for a language model at scale: the seed's table agrees


def survey_csv(path, n=400):
    rng = np.random.default_rng(4)
    lines = ["age,region,score,answer"]
    for i in range(n):
        age, score = int(rng.integers(18, 80)), float(rng.normal())
        lines.append(f"{age},{['north', 'south', 'east'][i % 3]},{score:.3f},{'yes' if score + age / 50 > 1 else 'no'}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_tables_serving_capacity_is_measured_through_predict_and_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNYARD_CACHE_DIR", str(tmp_path / "cache"))
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(json.dumps({
        "task": "tabular_classification", "name": "survey",
        "data": {"sources": [{"path": str(survey_csv(tmp_path / "s.csv")), "format": "csv"}], "table": {"target": "answer"}},
        "model": {"family": "lightgbm", "trees": {"num_boost_round": 60}}, "resources": {"threads": 1}}))
    spec = load_spec(spec_path)
    files, _ = resolve_sources(spec.data)
    calls = []

    def probe(*args):
        calls.append(args)
        return predict_probe(*args)

    traffic = Traffic(100_000, 1000, "row")
    plan = make_plan(spec, files, tmp_path / "run", traffic=traffic, budget_s=0.5, serving_probe=probe)
    assert len(calls) == 1  # measured, once
    serving = plan.lifetime.serving
    assert serving.capacity.kind == "cpu" and "measured here: POST /v1/predict over loopback HTTP" in serving.capacity.how
    text = "\n".join(plan.lifetime.lines())
    assert f"serving capacity: {serving.capacity.units_per_s:,.1f} rows/s per replica of cpu: measured here" in text
    assert "one-row requests/s" in text and "in 1,000-row requests on 1 core" in text

    # The same shape timed directly here, on one thread: the predictor's app called in process with 1,000
    # rows (the plan's figure within 3x of it), and the schema's encoding and the forward alone (an upper bound).
    prepared = prepare_table(spec.data, spec.task, 0)
    family = get_family("lightgbm")
    config = family.config_from_spec(resolved_stage(spec, "main").model,
                                     table=TableFacts(len(prepared.schema.features),
                                                      tuple(prepared.schema.categorical_indices), 2))
    config = type(config).from_dict({**config.to_dict(), "early_stopping_rounds": None})
    with threadpool_limits(1):
        fitted = family.fit(config, prepared.train.x, prepared.train.y, prepared.valid.x, prepared.valid.y, 0, 1)
        rows = [dict(zip(prepared.schema.names, r, strict=True)) for r in decoded_rows(prepared, 1000)]
        times = []
        for _ in range(5):
            start = time.perf_counter()
            x, problems, _ = encode_records(rows, prepared.schema)
            fitted.model.predict(x)
            times.append(time.perf_counter() - start)
        parts = 1000 / float(np.median(times))
        # The whole predictor path in process: the same app, called without a socket.
        reference = FeatureReference.build(prepared.train.x, prepared.schema.names,
                                           [f.kind for f in prepared.schema.features],
                                           [len(f.categories) for f in prepared.schema.features], 0)
        predictor = Predictor("table", spec.task, "lightgbm", config, fitted.model, prepared.schema.to_dict(),
                              reference, {})
        client = TestClient(create_predict_app(predictor, "direct"))
        body = {"rows": rows}
        assert client.post("/v1/predict", json=body).status_code == 200
        times = []
        for _ in range(5):
            start = time.perf_counter()
            client.post("/v1/predict", json=body)
            times.append(time.perf_counter() - start)
    assert not problems
    direct = 1000 / float(np.median(times))
    measured = serving.capacity.units_per_s
    assert direct / 3 <= measured <= direct * 3, (measured, direct)
    assert measured <= parts * 1.5, (measured, parts)  # never faster than its encoding and forward alone

    # A second plan on this machine reads the measurement back.
    again = make_plan(spec, files, tmp_path / "run", traffic=traffic, budget_s=0.5, serving_probe=probe)
    assert len(calls) == 1 and "cached for this machine" in again.lifetime.serving.capacity.how
    assert list(cache_root().glob("lightgbm-*.json"))


def decoded_rows(prepared, n):
    """Request rows as a client sends them: each feature's value, categories by name."""
    x = prepared.test.x if len(prepared.test.x) else prepared.train.x
    out = []
    for i in range(n):
        row = x[i % len(x)]
        values = []
        for f, v in zip(prepared.schema.features, row, strict=True):
            values.append(f.categories[int(v)] if f.kind == "categorical" and not np.isnan(v) else
                          (None if np.isnan(v) else float(v)))
        out.append(values)
    return out


def test_a_gpu_speeds_a_networks_forward_but_not_a_host_library():
    timing = PredictTiming(one_row_s=0.002, batch_rows=1000, batch_s=0.05, model_row_s=0.00004, cores=1, requests=9,
                           path="by hand")
    cnn = Sizing(parameters=10**5, non_embedding_parameters=10**5, flops_per_unit=3e7, unit="row", activation_bytes=0)
    traffic = Traffic(1000, 1000, "row")
    cpu = table_capacity("cpu", "image_classification", cnn, traffic, timing)
    assert cpu.units_per_s == pytest.approx(1000 / timing.request_s(1000))
    net = table_capacity("t4", "image_classification", cnn, traffic, timing, forward_on_device=True)
    trees = table_capacity("t4", "tabular_classification", cnn, traffic, timing, forward_on_device=False)
    assert net.units_per_s > cpu.units_per_s and trees.units_per_s == pytest.approx(cpu.units_per_s)
    assert "host part of" in net.how and "runs on the host" in trees.how


def test_a_measurement_is_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNYARD_CACHE_DIR", str(tmp_path))
    timing = PredictTiming(0.002, 1000, 0.05, 4e-5, 1, 9, "by hand")
    calls = []

    def probe(*args):
        calls.append(args)
        return timing

    first = measured_timing(probe, "tabular_regression", "linear", None, {"a": 1})
    second = measured_timing(probe, "tabular_regression", "linear", None, {"a": 1})
    third = measured_timing(probe, "tabular_regression", "linear", None, {"a": 2})
    assert len(calls) == 2 and not first.cached and second.cached and not third.cached
    assert second.one_row_s == first.one_row_s
