"""An OpenAI-compatible HTTP API over a `Generator`.

- `POST /v1/completions`: OpenAI's completions request and response shapes (`prompt`, `max_tokens`,
  `temperature`, `top_p`, `stop`, `seed`, `stream`; plus `top_k`). With `"stream": true` the
  completion arrives as server-sent events, one `data: {chunk}` per text piece, then `data: [DONE]`.
- `GET /healthz`: liveness and the model's name.
- `GET /metrics`: Prometheus text: request, error and token counters, and latency quantiles
  (whole request, time to first token, per output token) over the most recent requests.

One model serves one request at a time (a lock): generation already uses every core, and a CPU
model interleaving requests would only slow each one down.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from runyard.serve.drift import DriftMonitor, DriftReference
from runyard.serve.engine import Generator

WINDOW = 1000  # latency quantiles are over this many most recent requests


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)

    model: str | None = None
    prompt: str
    max_tokens: int = Field(default=16, ge=0, le=4096)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=1, description="one completion per request")
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    seed: int = Field(default=0, ge=0)
    stream: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop is up to 4 non-empty strings")
        return stops


class LatencyMetrics:
    """Counters and recent latencies, safe to update from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.errors = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.request_s: deque[float] = deque(maxlen=WINDOW)
        self.first_token_s: deque[float] = deque(maxlen=WINDOW)
        self.per_token_s: deque[float] = deque(maxlen=WINDOW)

    def record(self, prompt_tokens: int, completion_tokens: int, total_s: float, first_token_s: float | None):
        with self._lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.request_s.append(total_s)
            if first_token_s is not None:
                self.first_token_s.append(first_token_s)
            if completion_tokens:
                self.per_token_s.append(total_s / completion_tokens)

    def record_error(self) -> None:
        with self._lock:
            self.errors += 1

    def prometheus(self) -> str:
        with self._lock:
            lines = []
            for name, value, help_ in (
                ("runyard_requests_total", self.requests, "completed completion requests"),
                ("runyard_request_errors_total", self.errors, "rejected or failed requests"),
                ("runyard_prompt_tokens_total", self.prompt_tokens, "prompt tokens processed"),
                ("runyard_completion_tokens_total", self.completion_tokens, "tokens generated"),
            ):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
            for name, values, help_ in (
                ("runyard_request_seconds", self.request_s, "whole-request latency"),
                ("runyard_time_to_first_token_seconds", self.first_token_s, "prefill and first token"),
                ("runyard_time_per_output_token_seconds", self.per_token_s, "request time per token"),
            ):
                lines += [f"# HELP {name} {help_} (last {WINDOW} requests)", f"# TYPE {name} summary"]
                ordered = sorted(values)
                for q in (0.5, 0.9, 0.99):
                    value = ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")
                    lines.append(f'{name}{{quantile="{q}"}} {value:.6f}')
                lines += [f"{name}_sum {sum(ordered):.6f}", f"{name}_count {len(ordered)}"]
        return "\n".join(lines) + "\n"


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


class _StopScanner:
    """Cuts streamed text at the first stop string, holding back a tail that could begin one."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending, self.stopped = stops, "", False

    def feed(self, piece: str) -> str:
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        hold = max(
            (k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0
        )
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def create_app(generator: Generator, model_name: str = "runyard", drift: DriftMonitor | None = None) -> FastAPI:
    """The HTTP app serving `generator` under `model_name`; with `drift`, every prompt is observed and
    `/v1/drift` reports how far live inputs have moved from the training distribution."""
    app = FastAPI(title="runyard", description="OpenAI-compatible completions over a runyard export")
    metrics = LatencyMetrics()
    lock = threading.Lock()
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.record_error()
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return _error(400, f"{param}: {first['msg']}", param)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "model": model_name}

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus_metrics() -> str:
        text = metrics.prometheus()
        if drift is not None:
            report = drift.report()
            for name, value in (("token_js", report.token_js), ("length_psi", report.length_psi)):
                if value is not None:
                    text += f"runyard_drift_{name} {value}\n"
            text += f"runyard_drift_alert {int(report.drifting)}\n"
        return text

    @app.get("/v1/drift")
    def drift_report() -> dict:
        if drift is None:
            return {"enabled": False}
        return {"enabled": True, **asdict(drift.report())}

    def run(req: CompletionRequest) -> Iterator[tuple[str, str | None, int, int]]:
        """Yield (text piece, finish reason or None, prompt tokens, completion tokens so far)."""
        prompt_ids = generator.encode(req.prompt)
        ctx = generator.model.cfg.context_length
        prompt_ids = prompt_ids[-ctx:]  # longer prompts keep their most recent tokens
        if drift is not None:
            drift.observe(prompt_ids)
        with lock:
            started = time.perf_counter()
            first_token_s = None
            count = 0

            def counted():
                nonlocal count, first_token_s
                for token in generator.iter_ids(
                    prompt_ids,
                    max_tokens=req.max_tokens,
                    temperature=req.temperature,
                    top_k=req.top_k,
                    top_p=req.top_p if req.top_p < 1.0 else None,
                    seed=req.seed,
                ):
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - started
                    count += 1
                    yield token

            scanner = _StopScanner(req.stop)
            for piece in generator.decode_stream(prompt_ids, counted()):
                text = scanner.feed(piece)
                if text:
                    yield text, None, len(prompt_ids), count
                if scanner.stopped:
                    break
            if not scanner.stopped and (tail := scanner.flush()):
                yield tail, None, len(prompt_ids), count
            reason = "stop" if scanner.stopped or count < req.max_tokens else "length"
            metrics.record(len(prompt_ids), count, time.perf_counter() - started, first_token_s)
            yield "", reason, len(prompt_ids), count

    @app.post("/v1/completions")
    def completions(req: CompletionRequest):
        if req.model is not None and req.model != model_name:
            metrics.record_error()
            return _error(
                404, f"model {req.model!r} is not served here; this server has {model_name!r}", "model"
            )
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def chunk(text: str, reason: str | None) -> dict:
            return {
                "id": completion_id,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}],
            }

        if req.stream:

            def events() -> Iterator[str]:
                for text, reason, _, _ in run(req):
                    yield f"data: {json.dumps(chunk(text, reason))}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        steps = list(run(req))
        _, reason, n_prompt, n_completion = steps[-1]
        body = chunk("".join(text for text, *_ in steps), reason)
        body["usage"] = {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion,
        }
        return body

    return app


def serve_export(export_dir: Path, host: str = "127.0.0.1", port: int = 8000, device: str = "cpu") -> None:
    """Load an export and serve it until interrupted."""
    import uvicorn

    from runyard.serve.export import load_export, read_export_config

    model, _, tokenizer = load_export(export_dir, device=device)
    name = (
        read_export_config(export_dir).get("extra", {}).get("run_name")
        or Path(export_dir).resolve().parent.name
    )
    reference = DriftReference.load(Path(export_dir))
    monitor = DriftMonitor(reference) if reference is not None else None
    app = create_app(Generator(model, tokenizer, device=device), str(name), drift=monitor)
    uvicorn.run(app, host=host, port=port)
