"""The control plane's HTTP API on loopback (standard library `http.server`, JSON in and out).

    GET  /health                      pid, backend, devices
    GET  /capacity                    inventory, free devices, running jobs
    POST /jobs                        {"spec": YAML, ...} -> {"jobs": [job, ...]}   (see control/submit.py)
                                      {"jobs": [JobRequest, ...]} only with --allow-argv
    GET  /jobs[?state=a,b&lease=L]    the queue
    GET  /jobs/ID                     one job and its transitions
    GET  /jobs/ID/logs?offset=N       {"text", "offset", "finished"}
    POST /jobs/ID/cancel | /requeue
    POST /shutdown                    stop the daemon (jobs keep running; a restart adopts them)

Every call needs the daemon's bearer token and a loopback Host; a POST's body must be JSON and
say so (see control/auth.py): 401, 403 and 415 otherwise. Numbers that JSON cannot hold exactly
(NaN, Infinity, 1e400) are refused with 400, ids beyond 64 bits with 404, bodies over 1 MiB with 413.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from runyard.control import auth
from runyard.control.jobs import JobRequestError
from runyard.control.loop import HOLDING, ControlLoop
from runyard.control.states import IllegalTransition, JobState
from runyard.control.store import JobNotFound
from runyard.control.submit import ArgvNotAllowed, submit

log = logging.getLogger("runyard.control.api")
MAX_LOG_CHUNK = 1 << 20
MAX_BODY = 2 << 20
MAX_ID = 2**63 - 1


class BadRequest(ValueError):
    """A request the API refuses with the given status (4xx) and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ControlServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, loop: ControlLoop, host: str, port: int, on_shutdown: threading.Event, token: str,
                 allow_argv: bool = False):
        self.loop, self.on_shutdown, self.token, self.allow_argv = loop, on_shutdown, token, allow_argv
        super().__init__((host, port), _Handler)


def _no_constant(name: str) -> Any:
    raise BadRequest(400, f"{name} is not a number JSON can carry; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(400, f"{text[:40]} is out of range for a number; send a finite number")
    return value


def parse_json(raw: bytes) -> Any:
    """JSON as the API accepts it: finite numbers only (no NaN, Infinity or overflowing 1e400)."""
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(400, "the body nests too deeply") from None


class _Handler(BaseHTTPRequestHandler):
    server: ControlServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the daemon log is for the loop
        pass

    def _send(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _check_caller(self, method: str) -> None:
        """Host, token and (for a POST) Content-Type, in that order; BadRequest on the first that fails."""
        if not auth.host_ok(self.headers.get("Host")):
            raise BadRequest(403, "the control API answers only requests addressed to a loopback host")
        origin = self.headers.get("Origin")
        if origin is not None and not auth.host_ok(urlparse(origin).netloc):
            raise BadRequest(403, f"requests from the web origin {origin[:100]} are not accepted")
        if not auth.bearer_ok(self.headers.get("Authorization"), self.server.token):
            raise BadRequest(401, "a valid bearer token is required (the state directory's api-token file)")
        if method == "POST" and not auth.json_content_type(self.headers.get("Content-Type")):
            raise BadRequest(415, "POST bodies must be JSON, sent with Content-Type: application/json")

    def _body(self) -> dict[str, Any]:
        declared = self.headers.get("Content-Length") or "0"
        if not re.fullmatch(r"[0-9]{1,19}", declared):
            raise BadRequest(400, f"Content-Length {declared[:40]!r} is not a byte count")
        length = int(declared)
        if length > MAX_BODY:
            raise BadRequest(413, f"the body is {length} bytes; at most {MAX_BODY} are accepted")
        body = parse_json(self.rfile.read(length)) if length else {}
        if not isinstance(body, dict):
            raise BadRequest(400, "the request body must be a JSON object")
        return body

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        try:
            self._check_caller(method)
            self._route(method)
        except BadRequest as exc:
            extra = {"WWW-Authenticate": 'Bearer realm="runyard-control"'} if exc.status == 401 else None
            self._send(exc.status, {"error": str(exc)}, extra)
        except ArgvNotAllowed as exc:
            self._send(HTTPStatus.FORBIDDEN, {"error": str(exc)})
        except JobNotFound as exc:
            self._send(HTTPStatus.NOT_FOUND, {"error": str(exc)})
        except (JobRequestError, IllegalTransition, ValueError) as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        except OverflowError:  # an integer beyond what the store holds (e.g. depends_on: 2**70)
            self._send(HTTPStatus.BAD_REQUEST, {"error": "a number in the request is out of range (64 bits)"})
        except Exception:  # a bug, not the caller's fault: logged here, never a dropped connection
            log.exception("control API %s %s failed", method, self.path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error; see the daemon's log"})

    def _route(self, method: str) -> None:
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        loop = self.server.loop
        if method == "GET" and url.path == "/health":
            return self._send(200, {"ok": True, "backend": loop.backend.name, "devices": loop.config.inventory,
                                    "allow_argv": self.server.allow_argv})
        if method == "GET" and url.path == "/capacity":
            return self._send(200, capacity(loop))
        if method == "POST" and url.path == "/shutdown":
            self._body()
            self._send(200, {"ok": True})
            self.server.on_shutdown.set()
            return None
        if url.path == "/jobs" and method in ("GET", "POST"):
            if method == "POST":
                jobs = submit(loop, self._body(), self.server.allow_argv)
                loop.wake.set()
                return self._send(201, {"jobs": [j.to_dict() for j in jobs]})
            states = [JobState(s) for s in query["state"].split(",")] if "state" in query else None
            jobs = loop.store.jobs(states, lease_id=query.get("lease"))
            return self._send(200, {"jobs": [j.to_dict() for j in jobs]})
        m = re.fullmatch(r"/jobs/([0-9]{1,19})(?:/(logs|cancel|requeue))?", url.path)
        if m is None:
            known = url.path in ("/health", "/capacity", "/shutdown", "/jobs")
            return self._send(405 if known else 404, {"error": f"no route {method} {url.path[:200]}"})
        job_id, action = int(m.group(1)), m.group(2)
        if job_id > MAX_ID:
            raise JobNotFound(f"no job {m.group(1)[:30]}")
        if method == "GET" and action is None:
            job = loop.store.get(job_id)
            return self._send(200, {"job": job.to_dict(), "history": loop.store.history(job_id)})
        if method == "GET" and action == "logs":
            offset = query.get("offset", "0")
            if not re.fullmatch(r"[0-9]{1,19}", offset) or int(offset) > MAX_ID:
                raise BadRequest(400, f"offset {offset[:30]!r} must be a byte offset (0 to 2^63-1)")
            return self._send(200, read_log(loop, job_id, int(offset)))
        if method == "POST" and action == "cancel":
            self._body()
            return self._send(200, {"job": loop.cancel(job_id, actor="api").to_dict()})
        if method == "POST" and action == "requeue":
            self._body()
            return self._send(200, {"job": loop.requeue(job_id, actor="api").to_dict()})
        return self._send(405, {"error": f"{method} not allowed on {url.path}"})


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
            fh.seek(offset)
            text = fh.read(MAX_LOG_CHUNK)
    return {"text": text.decode("utf-8", "replace"), "offset": offset + len(text),
            "finished": job.state.terminal, "state": str(job.state)}
