"""A small client for the control plane's HTTP API (standard library only: the CLI starts fast)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runyard.control.auth import TokenError, read_token
from runyard.control.info import ControlError, read_daemon_info
from runyard.control.states import JobState

TERMINAL = tuple(str(s) for s in JobState if s.terminal)  # succeeded, failed, cancelled


class ControlClient:
    def __init__(self, base_url: str, token: str, timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    @classmethod
    def for_state_dir(cls, state_dir: str | Path) -> ControlClient:
        """A client of the daemon running on `state_dir`, with the token it keeps there."""
        info = read_daemon_info(state_dir)
        try:
            token = read_token(state_dir)
        except TokenError as exc:
            raise ControlError(str(exc)) from None
        host = f"[{info['host']}]" if ":" in info["host"] else info["host"]
        return cls(f"http://{host}:{info['port']}", token)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        if method == "POST" and body is None:
            body = {}
        data = json.dumps(body, allow_nan=False).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.token}"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except (json.JSONDecodeError, AttributeError):
                message = exc.reason
            raise ControlError(f"control plane refused {method} {path}: {message}") from None
        except urllib.error.URLError as exc:
            raise ControlError(f"cannot reach the control plane at {self.base_url}: {exc.reason}") from None

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def capacity(self) -> dict[str, Any]:
        return self._call("GET", "/capacity")

    def submit_spec(self, spec_text: str, *, priority: int = 0, devices: int | None = None,
                    tenant: str = "default", run_dir: str | None = None, staged: bool = False) -> list[dict[str, Any]]:
        """Queue a job spec (its YAML text): one job, or one per stage (`staged`); returns the new jobs."""
        body = {"spec": spec_text, "priority": priority, "devices": devices, "tenant": tenant,
                "run_dir": run_dir, "staged": staged}
        return self._call("POST", "/jobs", body)["jobs"]

    def submit(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Submit raw job requests (commands, see control/jobs.py JobRequest); returns the new jobs.
        The daemon accepts them only when started with --allow-argv."""
        return self._call("POST", "/jobs", {"jobs": requests})["jobs"]

    def jobs(self, states: list[str] | None = None, lease: str | None = None) -> list[dict[str, Any]]:
        query = []
        if states:
            query.append("state=" + ",".join(states))
        if lease:
            query.append(f"lease={lease}")
        return self._call("GET", "/jobs" + ("?" + "&".join(query) if query else ""))["jobs"]

    def job(self, job_id: int) -> dict[str, Any]:
        """{'job': {...}, 'history': [transitions]}"""
        return self._call("GET", f"/jobs/{int(job_id)}")

    def cancel(self, job_id: int) -> dict[str, Any]:
        return self._call("POST", f"/jobs/{int(job_id)}/cancel")["job"]

    def requeue(self, job_id: int) -> dict[str, Any]:
        return self._call("POST", f"/jobs/{int(job_id)}/requeue")["job"]

    def logs(self, job_id: int, offset: int = 0) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{int(job_id)}/logs?offset={int(offset)}")

    def follow_logs(self, job_id: int, poll_s: float = 0.5) -> Iterator[str]:
        """Yield log text as it is written, until the job is finished and the log read to its end."""
        offset = 0
        while True:
            chunk = self.logs(job_id, offset)
            offset = chunk["offset"]
            if chunk["text"]:
                yield chunk["text"]
            elif chunk["finished"]:
                return
            else:
                time.sleep(poll_s)

    def shutdown(self) -> None:
        self._call("POST", "/shutdown")

    def wait(self, job_id: int, states: tuple[str, ...] = TERMINAL, timeout_s: float = 120.0,
             poll_s: float = 0.1) -> dict[str, Any]:
        """Poll until the job is in one of `states`; ControlError on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)["job"]
            if job["state"] in states:
                return job
            if time.monotonic() > deadline:
                raise ControlError(f"job {job_id} still {job['state']} after {timeout_s}s (waited for {states})")
            time.sleep(poll_s)
