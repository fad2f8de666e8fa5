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
- when the export behind a socket is known, every answer says which one served it
  (`X-Runyard-Export: sha256:...`, the digest of the export's runyard.json), so the tenant sees a
  roll-out take effect.

`take()` hands the agent what was seen since the last call (probes, healthy probes, requests,
latency percentiles) for one availability record; `consecutive_failures` tells it when a server
that is alive but unhealthy should be restarted.

A roll-out (`runyard.control.rollout`) moves the endpoint to another server's socket with `switch()`:
each request is bound to the socket that was current when it arrived (picked and counted under one
lock), so requests already in flight finish on the old server while new ones go to the new one, and
`in_flight(socket)` tells when the old one has drained.
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
EXPORT_HEADER = "X-Runyard-Export"


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


class _Once:
    """Call `fn` the first time this is called, never again (a request's release has two ways to come)."""

    def __init__(self, fn):  # type: ignore[no-untyped-def]
        self._fn, self._done = fn, False

    def __call__(self) -> None:
        if not self._done:
            self._done = True
            self._fn()


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
                 probe_interval_s: float = 5.0, probe_timeout_s: float = 5.0, export_digest: str | None = None):
        self._check_socket(socket_path)
        self.socket_path = Path(socket_path)
        self._exports: dict[str, str] = {str(socket_path): export_digest} if export_digest else {}
        self._in_flight: dict[str, int] = {}
        self._clients: dict[str, httpx.AsyncClient] = {}
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

    @staticmethod
    def _check_socket(socket_path: Path) -> None:
        if len(str(socket_path)) > MAX_SOCKET_PATH:
            raise ValueError(f"the deployment's socket path {socket_path} is longer than {MAX_SOCKET_PATH} "
                             "characters; use a shorter state directory")

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
        # One connection pool per upstream socket, in the server's own event loop, closed with it.
        try:
            yield
        finally:
            for client in list(self._clients.values()):
                await client.aclose()
            self._clients.clear()

    # -- the upstream, and switching it ----------------------------------------------------------------

    def switch(self, socket_path: Path, export_digest: str | None = None) -> Path:
        """Send every request from now on to `socket_path` (serving the export `export_digest`, when
        known); returns the socket they went to before. Requests already bound to the old socket finish
        there (see `in_flight`)."""
        self._check_socket(socket_path)
        with self._lock:
            previous, self.socket_path = self.socket_path, Path(socket_path)
            if export_digest:
                self._exports[str(socket_path)] = export_digest
            self.consecutive_failures = 0  # the probes so far were of the other server
        return previous

    def name_export(self, socket_path: Path, export_digest: str) -> None:
        """Say which export the server behind `socket_path` serves (once it is known)."""
        with self._lock:
            self._exports[str(socket_path)] = export_digest

    def in_flight(self, socket_path: Path | None = None) -> int:
        """Requests bound to `socket_path` (the current one by default) whose answers are not yet done."""
        with self._lock:
            return self._in_flight.get(str(socket_path or self.socket_path), 0)

    def _bind(self) -> str:
        with self._lock:
            key = str(self.socket_path)
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
        return key

    def _release(self, key: str) -> None:
        with self._lock:
            self._in_flight[key] -= 1

    async def _client_for(self, key: str) -> httpx.AsyncClient:
        # Only the event loop's thread touches the clients: no lock needed. A drained old socket's pool
        # is closed here, the next time any request passes.
        for old in [k for k in self._clients if k != key and self.in_flight(Path(k)) == 0]:
            await self._clients.pop(old).aclose()
        if key not in self._clients:
            self._clients[key] = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=key),
                                                   base_url="http://deployment", timeout=None)
        return self._clients[key]

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
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        body = await request.body()
        key = self._bind()  # from here the request belongs to this socket's server until its answer ends
        done = _Once(lambda: self._release(key))
        try:
            client = await self._client_for(key)
            started = time.monotonic()
            upstream = client.build_request(request.method, request.url.path, params=request.query_params,
                                            headers=headers, content=body)
            response = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            done()
            return error(502, f"the model server is not answering (restarting?): {type(exc).__name__}",
                         "server_error")
        except BaseException:
            done()
            raise
        latency = int((time.monotonic() - started) * 1000)
        with self._lock:
            self._seen.latencies_ms.append(latency)
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
        if key in self._exports:
            out_headers[EXPORT_HEADER] = self._exports[key]

        async def body_then_release() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                done()

        async def close() -> None:
            await response.aclose()
            done()  # an answer the client never read to its end

        return StreamingResponse(body_then_release(), status_code=response.status_code, headers=out_headers,
                                 background=BackgroundTask(close))

    # -- health -------------------------------------------------------------------------------------

    def probe_once(self) -> bool:
        """One health probe: GET /healthz through the current socket answers 200."""
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
