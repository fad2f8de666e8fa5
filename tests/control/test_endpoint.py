"""A deployment's plumbing with real processes and real sockets: the serving relay runs a server and
relays its port to a Unix socket, exiting with the code the control plane needs; the tenant-facing
endpoint admits only the lease's token, never passes the token on, streams answers as they come,
answers 502 while the server is down, and counts probes, healthy probes and requests for the
availability records."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from runyard.control.endpoint import Endpoint, percentile
from runyard.control.serve_relay import STOPPED, exit_code
from runyard.market.serving import token_digest
from runyard.system.http_thread import free_port
from runyard.system.processes import popen_dying_with_me

ECHO = str(Path(__file__).with_name("echo_server.py"))
TOKEN = "rye_the-tenants-own-token"


def _until(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check}")
        time.sleep(0.05)
    return value


class Relay:
    """`python -m runyard.control.serve_relay` running the echo server, as a deployment runs serve."""

    def __init__(self, folder: Path, extra: tuple[str, ...] = ()):
        port = free_port()
        self.socket = folder / f"{port}.sock"
        self.proc = popen_dying_with_me(
            [sys.executable, "-m", "runyard.control.serve_relay", str(self.socket), str(port), "--",
             sys.executable, ECHO, "--port", str(port), *extra])
        _until(self.socket.exists)

    def child_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        return int(out[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def relay(tmp_path):
    made = []

    def make(*extra: str) -> Relay:
        made.append(Relay(tmp_path, extra=extra))
        return made[-1]

    yield make
    for r in made:
        r.stop()  # its server dies with it (a parent-death signal)


def test_the_server_dies_with_the_relay(relay):
    r = relay()
    _until(lambda: subprocess.run(["pgrep", "-P", str(r.proc.pid)], capture_output=True).returncode == 0)
    child = r.child_pid()
    r.stop()  # SIGKILL: no clean-up code runs
    _until(lambda: not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2])


def _healthy(endpoint: Endpoint) -> bool:
    return endpoint.probe_once()


def test_the_endpoint_admits_only_the_leases_token_and_streams(relay, tmp_path):
    r = relay()
    endpoint = Endpoint(r.socket, token_digest(TOKEN), probe_interval_s=0.1)
    _until(lambda: _healthy(endpoint))  # before the prober starts: its probes all find the server up
    endpoint.start()
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            refused = httpx.post(f"{endpoint.url}/echo", json={"a": 1}, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        answer = httpx.post(f"{endpoint.url}/echo?x=1", json={"prompt": "hi"}, headers=auth)
        assert answer.status_code == 200
        echoed = answer.json()
        assert echoed["path"] == "/echo?x=1" and echoed["body"] == '{"prompt":"hi"}'
        assert "authorization" not in echoed["headers"]  # the token stays with the endpoint
        with httpx.stream("GET", f"{endpoint.url}/stream", headers=auth) as streamed:
            assert streamed.headers["content-type"].startswith("text/event-stream")
            events = [line for line in streamed.iter_lines() if line.startswith("data:")]
        assert events == ["data: 0", "data: 1", "data: 2"]
        time.sleep(0.3)
        seen = endpoint.take()
        assert seen.requests == 2 and seen.latency_p50_ms is not None and seen.latency_p99_ms >= seen.latency_p50_ms
        assert seen.probes >= 2 and seen.probes_ok == seen.probes
        assert endpoint.take().requests == 0  # taken: counting starts afresh
    finally:
        endpoint.stop()


def test_a_killed_server_fails_probes_answers_502_and_the_relay_says_killed(relay, tmp_path):
    r = relay()
    endpoint = Endpoint(r.socket, token_digest(TOKEN), probe_interval_s=0.1).start()
    try:
        _until(lambda: _healthy(endpoint))
        endpoint.take()
        subprocess.run(["kill", "-9", str(r.child_pid())], check=True)
        assert r.proc.wait(timeout=30) == 128 + signal.SIGKILL  # infra: the control plane restarts it
        _until(lambda: endpoint.consecutive_failures >= 2)
        down = httpx.post(f"{endpoint.url}/echo", json={}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert down.status_code == 502 and "not answering" in down.json()["error"]["message"]
        seen = endpoint.take()
        assert seen.probes > seen.probes_ok  # the dip shows
        assert not r.socket.exists()
    finally:
        endpoint.stop()


def test_an_unhealthy_server_fails_its_probes(relay, tmp_path):
    sick = tmp_path / "sick"
    r = relay("--unhealthy-if", str(sick))
    endpoint = Endpoint(r.socket, token_digest(TOKEN), probe_interval_s=0.1).start()
    try:
        _until(lambda: endpoint.ever_healthy)
        sick.touch()
        _until(lambda: endpoint.consecutive_failures >= 3)
        sick.unlink()
        _until(lambda: endpoint.consecutive_failures == 0)
    finally:
        endpoint.stop()


def test_the_relay_exits_with_what_the_control_plane_needs(relay):
    stopped = relay()
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(stopped.socket))) as client:
        _until(lambda c=client: _answers(c))  # up, its handlers installed (a start-up kill is another test)
    stopped.proc.send_signal(signal.SIGTERM)  # asked to stop: never read as "finished"
    assert stopped.proc.wait(timeout=30) == STOPPED
    for code, expect in ((0, 1), (2, 2), (5, 5)):
        r = relay()
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(r.socket))) as client:
            _until(lambda c=client: _answers(c))
            with contextlib.suppress(httpx.HTTPError):  # the server may exit before it answers
                client.get(f"http://x/exit/{code}")
        assert r.proc.wait(timeout=30) == expect
    assert exit_code(-9, False) == 137 and exit_code(0, True) == STOPPED


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("http://x/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def test_percentiles_by_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([5], 0.99) == 5
    values = list(range(1, 101))
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 1.0)) == (50, 99, 100)


def test_a_socket_path_too_long_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="longer than"):
        Endpoint(tmp_path / ("x" * 120) / "s.sock", token_digest(TOKEN))
