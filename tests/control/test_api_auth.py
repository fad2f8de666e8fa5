"""The control plane's HTTP API against a real daemon: every call needs the token from the state
directory, a loopback Host and (for a POST) a JSON body that says so; raw commands need the
operator's --allow-argv; numbers JSON cannot hold and ids beyond 64 bits get a 4xx, never a 500."""

from __future__ import annotations

import http.client
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runyard.control.auth import TOKEN_FILE, bearer_ok, host_ok, json_content_type

from .helpers import job


class Raw:
    """Hand-made requests to the daemon, to send what the client never would."""

    def __init__(self, d):
        info = json.loads((d.state_dir / "daemon.json").read_text())
        self.port = info["port"]
        self.token = (d.state_dir / TOKEN_FILE).read_text().strip()

    def __call__(self, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None,
                 token: str | None = "ok", host: str | None = None) -> tuple[int, dict, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.putrequest(method, path, skip_host=True)
        conn.putheader("Host", host or f"127.0.0.1:{self.port}")
        sent = {"Content-Type": "application/json"} if body is not None else {}
        if token is not None:
            sent["Authorization"] = f"Bearer {self.token if token == 'ok' else token}"
        sent.update(headers or {})
        data = body.encode() if isinstance(body, str) else body
        if data is not None:
            sent.setdefault("Content-Length", str(len(data)))
        for name, value in sent.items():
            if value is not None:
                conn.putheader(name, value)
        conn.endheaders(data)
        resp = conn.getresponse()
        payload = json.loads(resp.read() or b"{}")
        conn.close()
        return resp.status, payload, dict(resp.getheaders())


@pytest.fixture
def spec_daemon(daemon_factory):
    """A daemon as an operator starts it: job specs only (no --allow-argv)."""
    d = daemon_factory("--cpu-slots", "1", argv=False)
    return d, Raw(d)


def test_the_token_is_made_once_and_only_its_owner_can_read_it(spec_daemon, daemon_factory):
    d, _ = spec_daemon
    path = d.state_dir / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert len(token) >= 40
    d.stop()
    d.start()  # a restart keeps the token: clients holding it go on working
    assert path.read_text().strip() == token and d.client.health()["ok"]


def test_a_token_file_open_to_others_stops_the_daemon_from_starting(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / TOKEN_FILE).write_text("guessable\n")
    os.chmod(state / TOKEN_FILE, 0o644)
    out = subprocess.run([sys.executable, "-m", "runyard", "control", "start", "--foreground", "--state-dir",
                          str(state), "--cpu-slots", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "readable by others (mode 644)" in out.stderr and "0600" in out.stderr
    assert not (state / "daemon.json").exists()


ROUTES = [("GET", "/health"), ("GET", "/capacity"), ("GET", "/jobs"), ("GET", "/jobs/1"), ("GET", "/jobs/1/logs"),
          ("POST", "/jobs"), ("POST", "/jobs/1/cancel"), ("POST", "/jobs/1/requeue"), ("POST", "/shutdown")]


def test_every_call_needs_the_token(spec_daemon):
    d, raw = spec_daemon
    for method, path in ROUTES:
        body = "{}" if method == "POST" else None
        for token in (None, "wrong", raw.token + "x", ""):
            status, payload, headers = raw(method, path, body, token=token)
            assert status == 401 and "bearer token" in payload["error"], (method, path, token)
            assert headers["WWW-Authenticate"].startswith("Bearer")
    assert d.proc.poll() is None  # the shutdown without a token did not stop it
    assert raw("GET", "/health")[0] == 200


def test_a_browser_cannot_be_made_to_call_it(spec_daemon):
    d, raw = spec_daemon
    # DNS rebinding: a page on evil.example whose name now points at 127.0.0.1.
    status, payload, _ = raw("GET", "/jobs", host=f"evil.example:{raw.port}")
    assert status == 403 and "loopback" in payload["error"]
    for host in (f"localhost:{raw.port}", f"127.0.0.1:{raw.port}", "[::1]:1"):
        assert raw("GET", "/health", host=host)[0] == 200
    # A cross-site request names its origin.
    status, payload, _ = raw("POST", "/shutdown", "{}", headers={"Origin": "https://evil.example"})
    assert status == 403 and "origin" in payload["error"]
    # A form or text post is not JSON, whatever its body.
    for content_type in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data", None):
        status, payload, _ = raw("POST", "/shutdown", "{}", headers={"Content-Type": content_type})
        assert status == 415 and "application/json" in payload["error"]
    assert d.proc.poll() is None


def test_submit_takes_a_spec_and_commands_only_when_the_operator_allows(spec_daemon, daemon_factory, tmp_path):
    d, raw = spec_daemon
    status, payload, _ = raw("POST", "/jobs", json.dumps({"jobs": [job("x")]}))
    assert status == 403 and "--allow-argv" in payload["error"]
    assert d.client.health()["allow_argv"] is False and d.client.jobs() == []

    spec = {"name": "tiny", "data": {"sources": [{"path": str(tmp_path / "none.txt")}]}, "train": {"steps": 2}}
    status, payload, _ = raw("POST", "/jobs", json.dumps({"spec": yaml.safe_dump(spec), "priority": 5}))
    assert status == 201, payload
    queued = payload["jobs"][0]
    assert queued["priority"] == 5 and queued["argv"][1:4] == ["-m", "runyard", "run"]
    kept = queued["argv"][4]
    assert kept.startswith(str(d.state_dir / "specs")) and yaml.safe_load(Path(kept).read_text()) == spec
    bad = {"name": "tiny", "data": {"sources": []}, "trian": {}}
    status, payload, _ = raw("POST", "/jobs", json.dumps({"spec": yaml.safe_dump(bad)}))
    assert status == 400 and "trian" in payload["error"] and "data.sources" in payload["error"]
    status, payload, _ = raw("POST", "/jobs", json.dumps({"spec": "name: x", "argv": ["sh"]}))
    assert status == 400 and "argv" in payload["error"]
    assert len(d.client.jobs(["pending", "starting", "running", "succeeded", "failed"])) == 1

    allowing = daemon_factory("--cpu-slots", "1")  # started with --allow-argv
    assert allowing.client.health()["allow_argv"] is True
    assert allowing.client.submit([job("x", "--steps", "1")])[0]["state"] == "pending"


NON_FINITE = ['{"spec": "name: x", "priority": NaN}', '{"spec": "name: x", "priority": Infinity}',
              '{"spec": "name: x", "priority": -Infinity}', '{"spec": "name: x", "priority": 1e400}',
              '{"jobs": [{"name": "x", "argv": ["true"], "time_limit_s": 1e999}]}']


def test_numbers_json_cannot_hold_are_refused(spec_daemon):
    d, raw = spec_daemon
    for body in NON_FINITE:
        status, payload, _ = raw("POST", "/jobs", body)
        assert status == 400 and "finite number" in payload["error"], (body, payload)
    assert d.client.jobs() == []


def test_out_of_range_ids_and_bad_bodies_get_a_4xx(spec_daemon, daemon_factory):
    d, raw = spec_daemon
    for path in (f"/jobs/{2**63}", f"/jobs/{2**63}/logs", "/jobs/" + "9" * 30, "/jobs/-1", "/jobs/1"):
        assert raw("GET", path)[0] == 404, path
    for path in (f"/jobs/{2**63}/cancel", f"/jobs/{2**64}/requeue"):
        assert raw("POST", path, "{}")[0] == 404, path
    assert raw("GET", f"/jobs/1/logs?offset={2**63}")[0] == 400
    assert raw("GET", "/jobs/1/logs?offset=-5")[0] == 400
    assert raw("POST", "/jobs", "[1, 2]")[0] == 400
    assert raw("POST", "/jobs", "{not json")[0] == 400
    assert raw("POST", "/jobs", "{}", headers={"Content-Length": "-1"})[0] == 400
    assert raw("POST", "/jobs", "{}", headers={"Content-Length": str(3 << 20)})[0] == 413
    assert raw("DELETE", "/jobs")[0] == 405 and raw("GET", "/nothing")[0] == 404
    allowing = Raw(daemon_factory("--cpu-slots", "1"))
    huge_dependency = json.dumps({"jobs": [{"name": "x", "argv": ["true"], "depends_on": 2**70}]})
    assert allowing("POST", "/jobs", huge_dependency)[0] == 400
    assert d.proc.poll() is None


def test_the_header_checks():
    assert bearer_ok("Bearer abc", "abc") and not bearer_ok("Bearer abd", "abc") and not bearer_ok("abc", "abc")
    assert not bearer_ok(None, "abc") and not bearer_ok("Basic abc", "abc")
    assert all(host_ok(h) for h in ("127.0.0.1", "127.0.0.1:80", "localhost:9", "[::1]:8080", "LOCALHOST"))
    assert not any(host_ok(h) for h in (None, "", "evil.example", "127.0.0.1.evil.example:80", "[::2]:1", "0.0.0.0"))
    assert json_content_type("application/json; charset=utf-8") and not json_content_type("text/json")
