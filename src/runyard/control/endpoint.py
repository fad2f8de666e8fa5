"""A deployment's endpoint: the tenant's door to its model, and the agent's eyes on it.

`Endpoint` runs, on the provider's side of a standing lease, next to the deployment's sandbox:

- a reverse proxy (an ASGI app on uvicorn, in a thread) on a TCP port of the provider's choosing.
  Every request must carry `Authorization: Bearer <token>` where sha256(token) is the deployment's
  `token_sha256`: the tenant chose the token and the market only ever saw its digest, so only the
  tenant can call its endpoint; anyone else gets 401 in OpenAI's error shape. An admitted request is
  passed, without the token, to the sandbox's Unix socket (`runyard.control.serve_relay`) and the
  answer streamed back as it comes (server-sent events included). A request the model server cannot
  take (it is down or restarting) gets 502.
- a prober (a thread) that asks the model server's `/healthz` through the same socket every
  `probe_interval_s`: the evidence of availability that the agent signs into availability records.
- counters of the requests served and their latencies (time to the answer's headers).

`take()` hands the agent what was seen since the last call (probes, healthy probes, requests,
latency percentiles) for one availability record; `consecutive_failures` tells it when a server
that is alive but unhealthy should be restarted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from runyard.system.http_thread import AppThread

log = logging.getLogger("runyard.control.endpoint")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "authorization", "content-length"}
MAX_SOCKET_PATH = 100  # AF_UNIX paths are limited to 108 bytes


@dataclass
class Window:
    """What the endpoint saw between two `take()`s."""

    probes: int = 0
    probes_ok: int = 0
    requests: int = 0
    latency_p50_ms: int | None = None
    latency_p99_ms: int | None = None


@dataclass
class _Seen:
    probes: int = 0
    probes_ok: int = 0
    latencies_ms: list[int] = field(default_factory=list)


def percentile(values: list[int], q: float) -> int | None:
    """The q-quantile of `values` by nearest rank (the smallest value with at least q of them at or
    below it), or None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def error(status: int, message: str, kind: str) -> JSONResponse:
    """An error in OpenAI's shape, so any OpenAI client reports it as such."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


class Endpoint:
    """The proxy, the prober and the counters of one deployment (see the module docstring)."""

    def __init__(self, socket_path: Path, token_sha256: str, host: str = "127.0.0.1", port: int | None = None,
                 probe_interval_s: float = 5.0, probe_timeout_s: float = 5.0):
        if len(str(socket_path)) > MAX_SOCKET_PATH:
            raise ValueError(f"the deployment's socket path {socket_path} is longer than {MAX_SOCKET_PATH} "
                             "characters; use a shorter state directory")
        self.socket_path = Path(socket_path)
        self._digest = token_sha256.removeprefix("sha256:")
        self.probe_interval_s, self.probe_timeout_s = probe_interval_s, probe_timeout_s
        self._lock = threading.Lock()
        self._seen = _Seen()
        self.consecutive_failures = 0
        self.ever_healthy = False
        self._stop = threading.Event()
        app = Starlette(routes=[Route("/{path:path}", self._forward,
                                      methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])],
                        lifespan=self._lifespan)
        self._server = AppThread(app, host=host, port=port, name="deployment-endpoint")
        self.port = self._server.port
        self._prober = threading.Thread(target=self._probe_loop, name="deployment-prober", daemon=True)
        self._client: httpx.AsyncClient | None = None

    @property
    def url(self) -> str:
        return self._server.url

    def start(self) -> Endpoint:
        self._server.__enter__()
        self._prober.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._server.__exit__(None, None, None)
        self._prober.join(timeout=self.probe_timeout_s + 1)

    # -- the tenant's requests ---------------------------------------------------------------------

    @asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        # One connection pool to the socket, in the server's own event loop, closed with it.
        transport = httpx.AsyncHTTPTransport(uds=str(self.socket_path))
        async with httpx.AsyncClient(transport=transport, base_url="http://deployment", timeout=None) as client:
            self._client = client
            yield

    def _admitted(self, request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        digest = hashlib.sha256(token.strip().encode("utf-8")).hexdigest()
        return hmac.compare_digest(digest, self._digest)

    async def _forward(self, request: Request):  # type: ignore[no-untyped-def]
        if not self._admitted(request):
            return error(401, "this endpoint needs the lease's bearer token (Authorization: Bearer ...)",
                         "authentication_error")
        assert self._client is not None, "the lifespan makes the client before the first request"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        body = await request.body()
        started = time.monotonic()
        upstream = self._client.build_request(request.method, request.url.path, params=request.query_params,
                                              headers=headers, content=body)
        try:
            response = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return error(502, f"the model server is not answering (restarting?): {type(exc).__name__}",
                         "server_error")
        latency = int((time.monotonic() - started) * 1000)
        with self._lock:
            self._seen.latencies_ms.append(latency)
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(response.aiter_raw(), status_code=response.status_code, headers=out_headers,
                                 background=BackgroundTask(response.aclose))

    # -- health -------------------------------------------------------------------------------------

    def probe_once(self) -> bool:
        """One health probe: GET /healthz through the sandbox's socket answers 200."""
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket_path)),
                              timeout=self.probe_timeout_s) as client:
                return client.get("http://deployment/healthz").status_code == 200
        except (httpx.HTTPError, OSError):
            return False

    def _probe_loop(self) -> None:
        while not self._stop.is_set():
            ok = self.probe_once()
            with self._lock:
                self._seen.probes += 1
                self._seen.probes_ok += ok
                self.consecutive_failures = 0 if ok else self.consecutive_failures + 1
                self.ever_healthy = self.ever_healthy or ok
            self._stop.wait(self.probe_interval_s)

    def put_back(self, window: Window) -> None:
        """Count again what a `take()` handed out and could not be reported (the market refused it)."""
        with self._lock:
            self._seen.probes += window.probes
            self._seen.probes_ok += window.probes_ok

    def take(self) -> Window:
        """What was seen since the last call, and start counting afresh."""
        with self._lock:
            seen, self._seen = self._seen, _Seen()
        return Window(seen.probes, seen.probes_ok, len(seen.latencies_ms), percentile(seen.latencies_ms, 0.5),
                      percentile(seen.latencies_ms, 0.99))
