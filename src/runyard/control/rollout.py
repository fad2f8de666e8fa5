"""Replacing the model a deployment's endpoint serves, without failing a request.

A roll-out (and a roll-back, which is a roll-out to the export served before) goes:

1. the candidate server is started beside the one serving (its own relay socket, its own port);
2. it is health-checked through its socket: `GET /healthz` answers 200, then one real request
   answers (a one-token completion for a language model; `/v1/schema` for a table or image model,
   which has no completions route) -- a server that loads but cannot answer is not switched to;
3. the endpoint's upstream is switched to the candidate (`Endpoint.switch`: atomic, each request is
   bound to the socket current when it arrived);
4. the old server is drained: the roll-out waits until no request bound to it is in flight, or
   `drain_timeout_s` passes;
5. the old server is stopped.

A roll-back is a roll-out to `roll_back_target`: the export served before the one serving now.

A candidate that fails its check (the export does not load, the server exits, no healthy answer
before `health_timeout_s`) is stopped, the endpoint is never switched, and the old server keeps
serving; the result says why, and `record()` appends it to the deployment's roll-out log, which is
what the tenant is told.

`RelayServer` is a server as the deployment runs it (`serve_relay` + `runyard serve`) started as a
plain process; the agent's sandboxed deployments run the same command as a control-plane job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import httpx

from runyard.control.deployment import log_reason
from runyard.control.endpoint import Endpoint
from runyard.system.files import sha256_file

log = logging.getLogger("runyard.control.rollout")
PROVENANCE = "runyard.json"  # an export's manifest: the sha256 of every other file in it


def export_digest(export: Path) -> str:
    """An export's identity: the sha256 of its manifest, which records the sha256 of every other file."""
    manifest = Path(export) / PROVENANCE
    if not manifest.is_file():
        raise ValueError(f"{export} is not a runyard export: it has no {PROVENANCE}")
    return "sha256:" + sha256_file(manifest)


class Server(Protocol):
    """A model server behind a relay socket, as a roll-out sees it."""

    socket: Path

    def running(self) -> bool: ...

    def stop(self) -> None: ...

    def reason(self) -> str: ...


class RelayServer:
    """`python -m runyard.control.serve_relay SOCKET PORT -- runyard serve EXPORT ...` as a process of its
    own (`argv` from `runyard.control.deployment.serve_command`), its output in `log_path`."""

    def __init__(self, argv: list[str], socket: Path, log_path: Path):
        self.socket, self.log_path = Path(socket), Path(log_path)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the relay passes it on to the server and exits 143
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def reason(self) -> str:
        """What the server said last (its last `runyard:` line, else its last line)."""
        return log_reason(str(self.log_path))


@dataclass
class RollOut:
    """What a roll-out did: whether the endpoint now serves `export`, and if not, why."""

    ok: bool
    export: str
    digest: str | None
    detail: str
    switched_at: float | None = None
    drained: bool = False
    left_in_flight: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Look:
    """One look at a new server: ready to take traffic, failed for good, or not yet answering."""

    ready: bool
    failed: bool
    why: str


def look_at_candidate(socket: Path, timeout_s: float = 30.0) -> Look:
    """Ask the server behind `socket` for `/healthz` and, once that answers 200, one real request."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://candidate",
                      timeout=max(1.0, timeout_s)) as client:
        try:
            health = client.get("/healthz")
        except (httpx.HTTPError, OSError) as exc:
            return Look(False, False, f"/healthz: {type(exc).__name__}")
        if health.status_code != 200:
            return Look(False, False, f"/healthz answered {health.status_code}: {health.text[:200]}")
        try:
            answer = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "temperature": 0})
            if answer.status_code == 404:  # a table or image model: no completions; its schema must answer
                answer = client.get("/v1/schema")
        except (httpx.HTTPError, OSError) as exc:
            return Look(False, True, f"the new server's first request failed: {type(exc).__name__}: {exc}")
        if answer.status_code != 200:
            return Look(False, True, f"the new server's first request answered {answer.status_code}: "
                                     f"{answer.text[:300]}")
    return Look(True, False, "")


def check_candidate(server: Server, timeout_s: float, poll_s: float = 0.2) -> str | None:
    """None when `server` answers healthy and answers one real request before `timeout_s`; else why not."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        if not server.running():
            return f"the new server exited before it served: {server.reason()}"
        if time.monotonic() > deadline:
            return f"the new server was not healthy within {timeout_s:g} s ({last})"
        seen = look_at_candidate(server.socket, min(30.0, timeout_s))
        if seen.ready:
            return None
        if seen.failed:
            return seen.why
        last = seen.why
        time.sleep(poll_s)


def wait_drained(endpoint: Endpoint, socket: Path, timeout_s: float, poll_s: float = 0.05) -> int:
    """Wait until no request bound to `socket` is in flight, or `timeout_s` passes; returns how many are left."""
    deadline = time.monotonic() + timeout_s
    while (left := endpoint.in_flight(socket)) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return left


def roll_out(endpoint: Endpoint, export: Path, start: Callable[[], Server], old: Server | None,
             health_timeout_s: float = 120.0, drain_timeout_s: float = 60.0) -> tuple[RollOut, Server | None]:
    """Replace the server behind `endpoint` (`old`) with one serving `export`, made by `start()`.
    Returns what happened and the server now serving: the new one, or `old` when the new one failed
    its check (then the endpoint was never switched)."""
    began = time.monotonic()
    try:
        digest = export_digest(export)
    except ValueError as exc:
        return RollOut(False, str(export), None, str(exc)), old
    candidate = start()
    why = check_candidate(candidate, health_timeout_s)
    if why is not None:
        candidate.stop()
        log.warning("roll-out to %s refused, the old server keeps serving: %s", export, why)
        return RollOut(False, str(export), digest, why, seconds=time.monotonic() - began), old
    previous = endpoint.switch(candidate.socket, digest)
    switched_at = time.time()
    left = wait_drained(endpoint, previous, drain_timeout_s)
    if old is not None:
        old.stop()
    detail = "switched; the old server drained" if not left else (
        f"switched; {left} request(s) still in flight on the old server after {drain_timeout_s:g} s were cut")
    log.info("roll-out to %s (%s): %s", export, digest, detail)
    return RollOut(True, str(export), digest, detail, switched_at, not left, left, time.monotonic() - began), candidate


def record(log_path: Path, result: RollOut) -> None:
    """Append a roll-out's result to the deployment's roll-out log (one JSON object a line)."""
    with open(log_path, "a", encoding="utf-8") as out:
        out.write(json.dumps({"at": time.time(), **asdict(result)}) + "\n")
        out.flush()
        with contextlib.suppress(OSError):
            os.fsync(out.fileno())


def roll_back_target(first_export: str, past: list[dict]) -> str:
    """The export a roll-back returns to: the one served before the one serving now (the deployment's
    first export, then every roll-out that switched, in order). ValueError when there is none."""
    served = [str(first_export)] + [entry["export"] for entry in past if entry.get("ok")]
    # A roll-back is itself a roll-out that switched: a second roll-back returns to what the first undid.
    if len(served) < 2:
        raise ValueError(f"nothing to roll back to: the deployment still serves its first export {first_export}")
    return served[-2]


def history(log_path: Path) -> list[dict]:
    """The deployment's roll-outs, oldest first."""
    if not Path(log_path).is_file():
        return []
    return [json.loads(line) for line in Path(log_path).read_text(encoding="utf-8").splitlines() if line.strip()]
