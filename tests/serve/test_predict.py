"""POST /v1/predict on a real server over loopback: a table model's predictions through HTTP equal the
model's own, a missing, mistyped or unknown feature is a 422 naming the row and the feature, feature drift
is judged per feature (PSI for numbers, JS divergence for categories), and an image model takes pixel
arrays and PNG bytes."""

from __future__ import annotations

import base64
import io
import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from runyard.data.tabular import prepare_table
from runyard.model import get_family
from runyard.model.registry import ExportError
from runyard.serve.feature_drift import FeatureReference
from runyard.serve.predict import create_predict_app
from runyard.serve.predict_export import (
    KIND_IMAGE,
    KIND_TABLE,
    export_predictor,
    image_drift_features,
    load_predictor,
)
from runyard.serve.request_log import PredictLog
from runyard.spec.job import parse_spec
from runyard.system.http_thread import AppThread
from runyard.train.tabular_stage import table_facts


@pytest.fixture(scope="module")
def table_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("table")
    rng = np.random.default_rng(0)
    lines = ["age,city,income,bought"]
    for i in range(600):
        age = rng.integers(18, 80)
        city = ["paris", "lyon", "nice"][i % 3]
        income = "" if i % 29 == 0 else f"{rng.normal(50, 15):.2f}"
        bought = "yes" if (age < 40) ^ (city == "nice") else "no"
        lines.append(f"{age},{city},{income},{bought}")
    (root / "t.csv").write_text("\n".join(lines) + "\n")
    spec = parse_spec({"task": "tabular_classification", "name": "shop", "data": {
        "sources": [{"path": str(root / "t.csv"), "format": "csv"}], "heldout_fraction": 0.2,
        "table": {"target": "bought"}}, "model": {"family": "lightgbm"}})
    prepared = prepare_table(spec.data, spec.task, seed=1)
    family = get_family("lightgbm")
    config = family.config_from_spec(spec.model, table=table_facts(prepared))
    fit = family.fit(config, prepared.train.x, prepared.train.y, prepared.valid.x, prepared.valid.y, seed=0, threads=1)
    schema = prepared.schema
    reference = FeatureReference.build(prepared.train.x, schema.names, [f.kind for f in schema.features],
                                       [len(f.categories) for f in schema.features], seed=3)
    expected = fit.model.predict(prepared.test.x)
    export_predictor(fit.model, config, "lightgbm", root / "export", kind=KIND_TABLE, task=spec.task,
                     schema=schema.to_dict(), reference=reference, check_x=prepared.test.x, expected=expected,
                     extra={"run_name": "shop"})
    return root / "export", prepared, fit.model


def rows_of(prepared, split, n):
    """Request rows rebuilt from encoded rows: category codes back to their names, NaN to null."""
    out = []
    for values in split.x[:n]:
        row = {}
        for f, v in zip(prepared.schema.features, values, strict=True):
            if np.isnan(v):
                row[f.name] = None
            elif f.kind == "categorical":
                row[f.name] = f.categories[int(v)]
            else:
                row[f.name] = float(v)
        out.append(row)
    return out


@pytest.fixture()
def table_server(table_export):
    export, _prepared, _model = table_export
    with AppThread(create_predict_app(load_predictor(export), "shop", drift_window=200), lifespan="off") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client


def test_predictions_through_the_server_equal_the_models(table_export, table_server):
    _export, prepared, model = table_export
    rows = rows_of(prepared, prepared.test, 50)
    response = table_server.post("/v1/predict", json={"rows": rows})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = model.predict(prepared.test.x[:50])
    got = np.array([[p["probabilities"][c] for c in prepared.schema.classes] for p in body["predictions"]])
    assert np.array_equal(got, expected)
    assert [p["label"] for p in body["predictions"]] == [prepared.schema.classes[i] for i in expected.argmax(1)]
    assert table_server.get("/v1/models").json()["data"][0]["family"] == "lightgbm"
    schema = table_server.get("/v1/schema").json()
    assert schema["row_json_schema"]["properties"]["income"]["type"] == ["number", "null"]


def test_a_missing_mistyped_or_unknown_feature_is_a_422_naming_it(table_server):
    good = {"age": 30, "city": "lyon", "income": 51.0}
    cases = [
        ({"rows": [good, {"city": "lyon", "income": 3.0}]}, "rows[1].age", "missing"),
        ({"rows": [{**good, "age": "thirty"}]}, "rows[0].age", "expected a number, got str 'thirty'"),
        ({"rows": [{**good, "city": ["lyon"]}]}, "rows[0].city", "expected a category (text), got list"),
        ({"rows": [{**good, "colour": "red"}]}, "rows[0].colour", "not a feature of this model"),
    ]
    for body, param, problem in cases:
        response = table_server.post("/v1/predict", json=body)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == param and problem in error["message"]
        assert error["problems"][0]["feature"] == param.split(".")[-1]
    assert table_server.post("/v1/predict", json={"rows": []}).status_code == 422
    assert table_server.post("/v1/predict", content=b"{not json").status_code == 422
    # A string that is not Unicode (a lone surrogate) is a 400 naming it; a JSON body sent as text/plain is a 415.
    raw = b'{"rows": [{"age": 30, "city": "ly\\ud800on", "income": 51.0}]}'
    bad = table_server.post("/v1/predict", content=raw, headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rows[0].city", bad.text
    plain = table_server.post("/v1/predict", content=json.dumps({"rows": [good]}), headers={"Content-Type": "text/plain"})
    assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
    # Null where the policy keeps missing values (income: native) is fine; an unseen city is answered and reported.
    ok = table_server.post("/v1/predict", json={"rows": [{**good, "income": None}, {**good, "city": "brest"}]})
    assert ok.status_code == 200 and ok.json()["unseen_categories"] == [{"row": 1, "feature": "city", "value": "brest"}]


def test_drift_is_judged_per_feature(table_export, table_server):
    _export, prepared, _model = table_export
    assert table_server.get("/v1/drift").json()["judged"] is False  # too few rows yet
    rows = rows_of(prepared, prepared.train, 200)  # training rows: nothing drifts
    assert table_server.post("/v1/predict", json={"rows": rows}).status_code == 200
    calm = table_server.get("/v1/drift").json()
    assert calm["judged"] and calm["drifting"] == [], calm
    shifted = [{**row, "age": row["age"] + 40, "city": "nice"} for row in rows]  # income untouched
    assert table_server.post("/v1/predict", json={"rows": shifted}).status_code == 200
    drift = table_server.get("/v1/drift").json()
    assert drift["drifting"] == ["age", "city"], drift
    assert drift["features"]["age"]["statistic"] == "psi" and drift["features"]["city"]["statistic"] == "js_bits"
    assert drift["features"]["age"]["value"] > drift["features"]["age"]["threshold"] >= 0.1
    assert drift["features"]["income"]["drifting"] is False
    # What moved: age's summary, city's shares; and one event naming both.
    moved = drift["features"]["age"]["moved"]
    assert moved["live"]["mean"] > moved["training"]["mean"] + 30
    assert drift["features"]["city"]["moved"]["categories"][0]["category"] == "nice"
    assert drift["features"]["city"]["moved"]["categories"][0]["live_share"] == 1.0
    assert drift["false_alarm_rate"] == 0.01 and drift["null_rows"] == "held-out training rows"
    assert len(drift["events"]) == 1 and set(drift["events"][0]["features"]) == {"age", "city"}
    metrics = table_server.get("/metrics").text
    assert "runyard_drift_features_drifting 2.0" in metrics and 'runyard_predict_requests_total{status="422"}' not in metrics


def test_the_export_records_its_onnx_check_and_refuses_a_tampered_file(table_export, tmp_path):
    export, _prepared, _model = table_export
    predictor = load_predictor(export)
    onnx = predictor.record["onnx"]
    assert onnx["written"] and onnx["matches"] and onnx["max_abs_diff"] < 1e-4 and onnx["rows_checked"] > 0
    copy = tmp_path / "export"
    shutil.copytree(export, copy)
    (copy / "model.txt").write_text((copy / "model.txt").read_text() + "\n")
    with pytest.raises(ExportError, match="model.txt fails its checksum"):
        load_predictor(copy)


def test_an_image_model_takes_pixel_arrays_and_png_bytes(tmp_path):
    family = get_family("cnn")
    spec = parse_spec({"task": "image_classification", "name": "img", "data": {"sources": [{"path": "digits", "format": "sklearn"}]},
                       "model": {"family": "cnn", "cnn": {"channels": [4], "hidden": 8}}})
    config = family.config_from_spec(spec.model, shape=(1, 6, 6), n_classes=3, mean=[0.5], std=[0.25])
    torch.manual_seed(0)
    model = family.build(config).eval()
    pixels = np.random.default_rng(0).random((20, 1, 6, 6)).astype(np.float32)
    features, names = image_drift_features(pixels)
    reference = FeatureReference.build(features, names, ["numeric"] * len(names), [0] * len(names), seed=1)
    with torch.no_grad():
        expected = torch.softmax(model(torch.from_numpy(pixels)).double(), -1).numpy()
    export_predictor(model, config, "cnn", tmp_path / "export", kind=KIND_IMAGE, task=spec.task,
                     schema={"kind": "image", "shape": [1, 6, 6], "classes": ["a", "b", "c"], "resize": None},
                     reference=reference, check_x=pixels, expected=expected)
    predictor = load_predictor(tmp_path / "export")
    assert predictor.record["onnx"]["written"] and predictor.record["onnx"]["matches"]
    buffer = io.BytesIO()
    Image.fromarray((pixels[0, 0] * 255).round().astype(np.uint8)).save(buffer, "PNG")
    images = PredictLog(tmp_path / "images", KIND_IMAGE, predictor.schema)
    with AppThread(create_predict_app(predictor, "img", input_log=images), lifespan="off") as srv, \
            httpx.Client(base_url=srv.url) as client:
        body = client.post("/v1/predict", json={"images": pixels[:3, 0].tolist()}).json()  # [H, W] for one channel
        [kept] = (tmp_path / "images").glob("images-*.npz")  # the batch as the model took it, keyed by the request
        with np.load(kept) as logged:
            assert np.allclose(logged["images"], pixels[:3]) and list(logged["ids"]) == [body["id"]] * 3
        got = np.array([[p["probabilities"][c] for c in ("a", "b", "c")] for p in body["predictions"]])
        assert np.allclose(got, expected[:3], atol=1e-12)
        png = client.post("/v1/predict", json={"images_base64": [base64.b64encode(buffer.getvalue()).decode()]})
        assert png.status_code == 200 and png.json()["predictions"][0]["label"] in ("a", "b", "c")
        wrong = client.post("/v1/predict", json={"images": [np.zeros((5, 6)).tolist()]})
        assert wrong.status_code == 422 and "images[0]: shape [1, 5, 6]; the model takes [1, 6, 6]" in wrong.json()["error"]["message"]
        bright = client.post("/v1/predict", json={"images": [np.full((6, 6), 2.0).tolist()]})
        assert bright.status_code == 422 and "in [0, 1]" in bright.json()["error"]["message"]


def test_logged_rows_keep_the_schema_are_bounded_and_cannot_retrain(table_export, tmp_path):
    export, prepared, _ = table_export
    predictor = load_predictor(export)
    log = PredictLog(tmp_path / "rows", KIND_TABLE, predictor.schema, max_inputs=5)
    rows = rows_of(prepared, prepared.test, 6)
    rows[0]["city"] = "jane.doe@gmail.com"  # an unseen category is answered, and scrubbed before it is kept
    with AppThread(create_predict_app(predictor, "shop", input_log=log), lifespan="off") as srv, \
            httpx.Client(base_url=srv.url) as client:
        first = client.post("/v1/predict", json={"rows": rows[:3]}).json()
        assert client.post("/v1/predict", json={"rows": [{"age": "old"}]}).status_code == 422  # refused: not kept
        client.post("/v1/predict", json={"rows": rows[3:]})  # 3 more would pass the bound of 5: dropped, counted
        status = client.get("/v1/drift").json()["input_log"]
    log.close()
    assert status["inputs_logged"] == 3 and status["inputs_dropped"] == 3
    assert status["retraining"].startswith("not available: logged rows and images carry no labels")
    records = [json.loads(line) for path in sorted((tmp_path / "rows").glob("*.jsonl"))
               for line in path.read_text().splitlines()]
    assert [(r["id"], r["row"]) for r in records] == [(first["id"], 0), (first["id"], 1), (first["id"], 2)]
    assert records[0]["features"]["city"] == "<EMAIL>" and records[1]["features"] == rows[1]
    assert json.loads((tmp_path / "rows" / "schema.json").read_text()) == predictor.schema
