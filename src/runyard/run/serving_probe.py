"""The planner's serving measurement (plan/serving_capacity.PredictProbe): a model of the spec's shape served
through the real POST /v1/predict app (serve/predict.py) on loopback, timed at one row per request and at a
batch, with one CPU thread so the figure is one core's.

It lives here, above serve/, because the planner sits below the serving stack and may not import it; the
`plan` command and the run pass it down.

The model: a table family fit on synthetic rows of the configuration's shape (its features, categorical
columns and classes) with every boosting round kept (early stopping off: an upper bound, since a real run
keeps at most that many); an image family built with its configuration (a forward costs the same trained
or not). Inputs go as clients send them: rows as JSON objects by feature name, images as base64 PNG.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import io
import json
import socket
import threading
import time
from typing import Any

import numpy as np
import torch
import uvicorn
from PIL import Image
from threadpoolctl import ThreadpoolController, threadpool_limits

from runyard.data.table_schema import Feature, TableSchema, encode_records
from runyard.model.registry import get_family
from runyard.plan.serving_capacity import PredictTiming
from runyard.serve.feature_drift import FeatureReference
from runyard.serve.predict import create_predict_app
from runyard.serve.predict_export import KIND_IMAGE, KIND_TABLE, Predictor, image_drift_features
from runyard.serve.predict_inputs import MAX_ITEMS

FIT_ROWS = 1000
CATEGORIES = 8  # per categorical column of the synthetic table
IMAGE_BATCH_MAX = 256  # images in the batch request (a PNG each)
MIN_REQUESTS = 3  # per request size, whatever the budget


def predict_probe(task: str, family_name: str, config: Any, batch_rows: int, budget_s: float) -> PredictTiming:
    """Time /v1/predict for a model of `config`'s shape on one core (module doc)."""
    family = get_family(family_name)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1):
            if task.startswith("tabular"):
                predictor, one, batch = _table(task, family, config, min(batch_rows, MAX_ITEMS))
            else:
                predictor, one, batch = _images(task, family, config, min(batch_rows, IMAGE_BATCH_MAX))
            return _time_server(predictor, one, batch, budget_s)
    finally:
        torch.set_num_threads(saved)


_CONTROLLER = ThreadpoolController()


class _OneCore(Predictor):
    """The predictor, its forward limited to one thread in whichever thread calls it: the server calls it
    from its worker threads, where an OpenMP thread count set in this one does not reach (it is per thread)."""

    def predict_matrix(self, x: np.ndarray) -> np.ndarray:
        with _CONTROLLER.limit(limits=1):
            return super().predict_matrix(x)


def _table(task: str, family: Any, config: Any, batch_rows: int) -> tuple[Predictor, list[dict], list[dict]]:
    rng = np.random.default_rng(0)
    n = config.n_features
    categorical = set(config.categorical)
    features = [Feature(f"f{j}", "categorical" if j in categorical else "numeric", "native",
                        [f"c{k}" for k in range(CATEGORIES)] if j in categorical else [], None) for j in range(n)]
    classes = [f"k{k}" for k in range(config.n_classes)] if config.n_classes else None
    schema = TableSchema(task, "target", classes, features)
    rows = FIT_ROWS + batch_rows
    raw = rng.normal(size=(rows, n))
    records = [{f.name: (f"c{int(abs(v) * 3) % CATEGORIES}" if f.kind == "categorical" else float(v))
                for f, v in zip(features, r, strict=True)} for r in raw]
    x, problems, _ = encode_records(records, schema)
    assert not problems, problems  # the synthetic rows are built to the schema
    score = np.sin(raw).sum(axis=1) + 0.3 * rng.normal(size=rows)
    y = (np.digitize(score, np.quantile(score, np.linspace(0, 1, config.n_classes + 1)[1:-1])) if classes
         else score)
    fit_config = dataclasses.replace(config, early_stopping_rounds=None) if hasattr(config, "early_stopping_rounds") \
        else config
    half = FIT_ROWS // 2
    fitted = family.fit(fit_config, x[:half], y[:half], x[half:FIT_ROWS], y[half:FIT_ROWS], 0, 1)
    kinds = [f.kind for f in features]
    reference = FeatureReference.build(x[:FIT_ROWS], schema.names, kinds, [len(f.categories) for f in features], 0)
    predictor = _OneCore(KIND_TABLE, task, family.name, config, fitted.model, schema.to_dict(), reference, {})
    return predictor, records[FIT_ROWS:FIT_ROWS + 1], records[FIT_ROWS:]


def _images(task: str, family: Any, config: Any, batch: int) -> tuple[Predictor, list[str], list[str]]:
    rng = np.random.default_rng(0)
    model = family.build(config).eval()
    shape = [config.in_channels, config.height, config.width]
    pixels = rng.integers(0, 256, size=(batch, config.height, config.width, config.in_channels), dtype=np.uint8)
    encoded = []
    for image in pixels:
        buf = io.BytesIO()
        Image.fromarray(image[..., 0] if config.in_channels == 1 else image).save(buf, format="PNG")
        encoded.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    sample = pixels.transpose(0, 3, 1, 2).astype(np.float32) / 255
    features, names = image_drift_features(sample)
    reference = FeatureReference.build(features, names, ["numeric"] * len(names), [0] * len(names), 0)
    schema = {"kind": KIND_IMAGE, "shape": shape, "classes": [f"k{k}" for k in range(config.n_classes)],
              "resize": None, "pixel_range": [0.0, 1.0]}
    predictor = _OneCore(KIND_IMAGE, task, family.name, config, model, schema, reference, {})
    return predictor, encoded[:1], encoded


def _time_server(predictor: Predictor, one: list, batch: list, budget_s: float) -> PredictTiming:
    """Serve the predictor with uvicorn on a loopback port in a thread, and time requests from one client."""
    key = "rows" if predictor.kind == KIND_TABLE else "images_base64"
    bodies = [json.dumps({key: one}).encode(), json.dumps({key: batch}).encode()]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted connections inherit it (Linux)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_predict_app(predictor, "probe"), log_level="warning",
                                           access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="serving-probe")
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the serving probe's loopback server did not start")
            time.sleep(0.01)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.connect()
        # No Nagle delay on the client's small writes (a load generator's default; 40 ms stalls otherwise).
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        seconds, requests = [], 0
        for body in bodies:
            _request(conn, body)  # warm: the first request builds what later ones reuse
            times = []
            until = time.perf_counter() + budget_s / 2
            while len(times) < MIN_REQUESTS or time.perf_counter() < until:
                start = time.perf_counter()
                _request(conn, body)
                times.append(time.perf_counter() - start)
            seconds.append(float(np.median(times)))
            requests += len(times)
        conn.close()
        matrix = _matrix(predictor, batch)
        start = time.perf_counter()
        predictor.predict_matrix(matrix)
        model_row_s = (time.perf_counter() - start) / len(batch)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
    what = "tables: rows as JSON objects" if predictor.kind == KIND_TABLE else "images: base64 PNG"
    return PredictTiming(seconds[0], len(batch), seconds[1], model_row_s, 1, requests,
                         f"POST /v1/predict over loopback HTTP ({predictor.family}, {what}, one client)")


def _request(conn: http.client.HTTPConnection, body: bytes) -> None:
    conn.request("POST", "/v1/predict", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RuntimeError(f"the serving probe's request was refused ({response.status}): {data[:300]!r}")


def _matrix(predictor: Predictor, batch: list) -> np.ndarray:
    if predictor.kind == KIND_TABLE:
        return encode_records(batch, predictor.table_schema)[0]
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(b))), dtype=np.float32) / 255 for b in batch]
    stacked = np.stack(images)
    return stacked[:, None] if stacked.ndim == 3 else stacked.transpose(0, 3, 1, 2)
