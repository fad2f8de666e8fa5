"""The control plane's HTTP API on loopback (standard library `http.server`, JSON in and out).

    GET  /health                      pid, backend, devices
    GET  /capacity                    inventory, free devices, running jobs
    POST /jobs                        {"jobs": [JobRequest, ...]} -> {"jobs": [job, ...]}
    GET  /jobs[?state=a,b&lease=L]    the queue
    GET  /jobs/ID                     one job and its transitions
    GET  /jobs/ID/logs?offset=N       {"text", "offset", "finished"}
    POST /jobs/ID/cancel | /requeue
    POST /shutdown                    stop the daemon (jobs keep running; a restart adopts them)
"""

from __future__ import annotations

import json
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from runyard.control.jobs import JobRequestError, add_jobs
from runyard.control.loop import HOLDING, ControlLoop
from runyard.control.states import IllegalTransition, JobState
from runyard.control.store import JobNotFound

MAX_LOG_CHUNK = 1 << 20


class ControlServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, loop: ControlLoop, host: str, port: int, on_shutdown: threading.Event):
        self.loop, self.on_shutdown = loop, on_shutdown
        super().__init__((host, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: ControlServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the daemon log is for the loop
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise JobRequestError("the request body must be a JSON object")
        return body

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        loop = self.server.loop
        try:
            if method == "GET" and url.path == "/health":
                return self._send(200, {"ok": True, "backend": loop.backend.name, "devices": loop.config.inventory})
            if method == "GET" and url.path == "/capacity":
                return self._send(200, capacity(loop))
            if method == "POST" and url.path == "/shutdown":
                self._send(200, {"ok": True})
                self.server.on_shutdown.set()
                return None
            if url.path == "/jobs":
                if method == "POST":
                    with loop.mutex:
                        jobs = add_jobs(loop.store, self._body().get("jobs"), loop.config, actor="api")
                    loop.wake.set()
                    return self._send(201, {"jobs": [j.to_dict() for j in jobs]})
                states = [JobState(s) for s in query["state"].split(",")] if "state" in query else None
                jobs = loop.store.jobs(states, lease_id=query.get("lease"))
                return self._send(200, {"jobs": [j.to_dict() for j in jobs]})
            m = re.fullmatch(r"/jobs/(\d+)(?:/(logs|cancel|requeue))?", url.path)
            if m is None:
                return self._send(404, {"error": f"no route {method} {url.path}"})
            job_id, action = int(m.group(1)), m.group(2)
            if method == "GET" and action is None:
                job = loop.store.get(job_id)
                return self._send(200, {"job": job.to_dict(), "history": loop.store.history(job_id)})
            if method == "GET" and action == "logs":
                return self._send(200, read_log(loop, job_id, int(query.get("offset", 0))))
            if method == "POST" and action == "cancel":
                return self._send(200, {"job": loop.cancel(job_id, actor="api").to_dict()})
            if method == "POST" and action == "requeue":
                return self._send(200, {"job": loop.requeue(job_id, actor="api").to_dict()})
            return self._send(405, {"error": f"{method} not allowed on {url.path}"})
        except JobNotFound as exc:
            return self._send(HTTPStatus.NOT_FOUND, {"error": str(exc)})
        except (JobRequestError, IllegalTransition, ValueError) as exc:
            return self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})


def capacity(loop: ControlLoop) -> dict[str, Any]:
    """Devices this control plane has and which of them no job holds."""
    holders = loop.store.jobs(HOLDING)
    held = {d for j in holders for d in j.allocation}
    free = [d for d in loop.config.inventory if d not in held]
    return {"inventory": loop.config.inventory, "free": free, "active_jobs": len(holders),
            "pending_jobs": len(loop.store.ids_in([JobState.PENDING]))}  # counted, not decoded


def read_log(loop: ControlLoop, job_id: int, offset: int) -> dict[str, Any]:
    job = loop.store.get(job_id)
    path = Path(job.log_path)
    text = b""
    if path.exists():
        with open(path, "rb") as fh:
            fh.seek(max(0, offset))
            text = fh.read(MAX_LOG_CHUNK)
    return {"text": text.decode("utf-8", "replace"), "offset": max(0, offset) + len(text),
            "finished": job.state.terminal, "state": str(job.state)}
