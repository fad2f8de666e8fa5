"""`runyard serve` for a table or image model: POST /v1/predict beside the language-model server.

Routes:
- `POST /v1/predict`: `{"rows": [...]}` (tables) or `{"images": [...]}` / `{"images_base64": [...]}`
  (images), a batch per request. Every input is validated against the export's schema first; a missing,
  mistyped or unknown feature (or a bad image) is a 422 in OpenAI's error shape whose `problems` name each
  row and feature. Answers: per row, the predicted label with every class's probability, or the value.
- `GET /v1/schema`: the feature schema, and one row as JSON Schema.
- `GET /v1/drift`: feature drift of the recent inputs against training (serve/feature_drift.py): PSI per
  numeric feature, Jensen-Shannon divergence per categorical one, each with its threshold for the window
  size judged at the stated false-alarm rate (all features corrected together), how a drifting feature's
  summary moved, and the drift events so far.
- `GET /v1/models`, `GET /healthz`, `GET /metrics` (Prometheus).

With `--log-requests DIR` every predicted row or image is also kept there (serve/request_log.py
PredictLog: rows as JSONL with the feature schema, images as .npz, bounded), and each answer carries
the request's `id`. Nothing retrains on them: they carry no labels (`/v1/drift` says so).

The model runs in FastAPI's worker threads behind a lock (a prediction is short; the lock keeps LightGBM
and torch from sharing one model across threads).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from runyard.serve.drift import DEFAULT_FALSE_ALARM_RATE
from runyard.serve.errors import InvalidRequest
from runyard.serve.feature_drift import FeatureDriftMonitor
from runyard.serve.predict_export import KIND_TABLE, Predictor, image_drift_features, load_predictor
from runyard.serve.predict_inputs import InputProblems, image_batch, table_rows
from runyard.serve.protocol import check_content_type, check_unicode
from runyard.serve.request_log import PredictLog
from runyard.serve.responses import error_body

MAX_BODY_BYTES = 16 * 1024 * 1024
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _Metrics:
    def __init__(self, monitor: FeatureDriftMonitor | None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("runyard_predict_requests", "predict requests answered, by HTTP status", ["status"], registry=r)
        self.rows = Counter("runyard_predict_rows", "rows or images predicted", registry=r)
        self.latency = Histogram("runyard_predict_request_duration_seconds", "predict request latency",
                                 buckets=LATENCY_BUCKETS, registry=r)
        drifting = Gauge("runyard_drift_features_drifting", "features past their drift threshold", registry=r)
        drifting.set_function(lambda: float(len(monitor.status()["drifting"])) if monitor else 0.0)


def _refuse(status: int, message: str, param: str | None = None, problems: list | None = None) -> JSONResponse:
    body = error_body(message, "invalid_request_error" if status < 500 else "server_error", param)
    if problems is not None:
        body["error"]["problems"] = problems
    return JSONResponse(body, status_code=status)


def _answers(predictor: Predictor, output: np.ndarray) -> list[dict[str, Any]]:
    classes = predictor.classes
    if classes is None:
        return [{"value": float(v)} for v in output]
    return [{"label": classes[int(np.argmax(p))], "probabilities": {c: float(v) for c, v in zip(classes, p, strict=True)}}
            for p in output]


def create_predict_app(predictor: Predictor, model_name: str, max_body_bytes: int = MAX_BODY_BYTES,
                       drift_window: int = 1000, false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE,
                       input_log: PredictLog | None = None) -> FastAPI:
    """The FastAPI app serving `predictor` under `model_name`; `input_log` keeps what it predicted."""
    app = FastAPI(title="runyard predict", description=f"POST /v1/predict for a {predictor.kind} model ({predictor.task})")
    monitor = None
    if predictor.reference:
        names = ({f.name: list(f.categories) for f in predictor.table_schema.features if f.kind == "categorical"}
                 if predictor.kind == KIND_TABLE else {})
        monitor = FeatureDriftMonitor(predictor.reference, window=drift_window, false_alarm_rate=false_alarm_rate,
                                      category_names=names)
        threading.Thread(target=monitor.warm, name="runyard-drift-null", daemon=True).start()
    metrics = _Metrics(monitor)
    lock = threading.Lock()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _refuse(exc.status_code, str(exc.detail))

    async def read_json(request: Request) -> Any:
        check_content_type(request.headers.get("content-type"))
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > max_body_bytes):
            raise InputProblems(f"the request body exceeds {max_body_bytes} bytes", [], None)
        body = await request.body()
        if len(body) > max_body_bytes:
            raise InputProblems(f"the request body exceeds {max_body_bytes} bytes", [], None)
        try:
            parsed = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputProblems(f"the request body is not JSON: {exc}", [], None) from None
        check_unicode(parsed)
        return parsed

    def run_model(body: Any) -> dict[str, Any]:
        if isinstance(body, dict) and body.get("model") not in (None, model_name):
            raise InputProblems(f"model {body['model']!r} is not served here; this server has {model_name!r}", [], "model")
        if predictor.kind == KIND_TABLE:
            rows = table_rows(body)
            matrix, problems, unseen = predictor.encode_rows(rows)
            if problems:
                first = problems[0]
                param = f"rows[{first['row']}]" + (f".{first['feature']}" if first["feature"] else "")
                raise InputProblems(f"{len(problems)} problem{'s' if len(problems) > 1 else ''} in the rows; first: "
                                    f"{param}: {first['problem']}", problems, param)
            drift_inputs = matrix
        else:
            matrix = image_batch(body, predictor.schema)
            unseen = []
            drift_inputs = image_drift_features(matrix)[0]
        with lock:
            output = predictor.predict_matrix(matrix)
        if monitor is not None:
            monitor.observe(drift_inputs, unseen)
        request_id = f"pred-{uuid.uuid4().hex}"
        if input_log is not None:  # only inputs the schema accepted: a refused request is not data
            if predictor.kind == KIND_TABLE:
                input_log.log_rows(request_id, rows)
            else:
                input_log.log_images(request_id, matrix)
        return {"id": request_id, "object": "prediction", "model": model_name,
                "predictions": _answers(predictor, output), **({"unseen_categories": unseen} if unseen else {})}

    @app.post("/v1/predict")
    async def predict(request: Request):
        start = time.perf_counter()
        try:
            body = await read_json(request)
            # The model and the drift window are CPU work: off the event loop.
            result = await run_in_threadpool(run_model, body)
        except InvalidRequest as exc:  # not JSON by its content type (415), or a string that is not Unicode (400)
            metrics.requests.labels(str(exc.status)).inc()
            return _refuse(exc.status, exc.message, exc.param)
        except InputProblems as exc:
            status = 413 if "exceeds" in exc.message else (404 if exc.param == "model" else 422)
            metrics.requests.labels(str(status)).inc()
            return _refuse(status, exc.message, exc.param, exc.problems)
        metrics.requests.labels("200").inc()
        metrics.rows.inc(len(result["predictions"]))
        metrics.latency.observe(time.perf_counter() - start)
        return result

    @app.get("/v1/schema")
    async def schema() -> dict[str, Any]:
        out = {"kind": predictor.kind, "task": predictor.task, "schema": predictor.schema}
        if predictor.kind == KIND_TABLE:
            out["row_json_schema"] = predictor.table_schema.json_schema()
        return out

    @app.get("/v1/drift")
    async def drift() -> dict[str, Any]:
        logged = {"input_log": input_log.status() if input_log is not None else None}
        if monitor is None:
            return {"enabled": False, "reason": "the export has no feature_drift.json", **logged}
        return {"enabled": True, **monitor.status(), **logged}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "runyard",
                                            "task": predictor.task, "family": predictor.family}]}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    return app


def serve_predictor(export_dir: Path, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                    device: str = "cpu", false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE,
                    log_requests: Path | None = None) -> None:
    """Load a table or image export and serve it until interrupted (logging its inputs to `log_requests`)."""
    predictor = load_predictor(export_dir, device=device)
    name = model_name or predictor.record.get("extra", {}).get("run_name") or Path(export_dir).resolve().parent.name
    input_log = PredictLog(log_requests, predictor.kind, predictor.schema) if log_requests is not None else None
    app = create_predict_app(predictor, name, false_alarm_rate=false_alarm_rate, input_log=input_log)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
    finally:
        if input_log is not None:
            input_log.close()  # seal the open segment
