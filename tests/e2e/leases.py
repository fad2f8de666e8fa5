"""What the end-to-end lease tests share: a market with verified parties, a provider's control plane
started as a real daemon, a tenant's data served over real HTTP, and waiting without timing
thresholds (a generous deadline, then a failure that says what was awaited)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from runyard.control import disk_quota, procs
from runyard.control.client import ControlClient
from runyard.control.store import JobStore
from runyard.market import identity
from runyard.market.client import MarketClient
from runyard.market.schema import transitions
from runyard.market.service import Market


def runyard(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runyard", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def until(what, timeout_s: float = 240, poll_s: float = 0.2):
    """Poll `what()` until it is truthy (its value is returned), failing with its docstring after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what.__doc__ or what}")
        time.sleep(poll_s)


def reason(market: Market, lease_id: int, state: str) -> str:
    """Why lease `lease_id` moved to `state` (the transition log's reason), or ''."""
    def read(conn, now):
        rows = conn.execute(transitions.select().where(transitions.c.entity == "lease",
                                                       transitions.c.entity_id == lease_id,
                                                       transitions.c.to_state == state)).mappings().all()
        return rows[0]["reason"] if rows else ""
    return market.read(read)


def parties(market: Market, url: str, providers: tuple[str, ...] = ("farm",), tenant: str = "lab"):
    """An operator, verified providers and a verified tenant, over HTTP."""
    ops = MarketClient(url, token=identity.create_operator(market, "ops")["token"])
    made = {}
    for name, role in [*((p, "provider") for p in providers), (tenant, "tenant")]:
        client = MarketClient(url)
        client.register(name, role)
        client.request_verification("papers")
        ops.decide(name, True, "checked")
        made[name] = client
    return ops, made


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class FileServer:
    """A real HTTP server over a folder (the tenant's data and exports); loopback only."""

    def __init__(self, folder: str | Path):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(folder)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


class ControlPlane:
    """`runyard control start` for a provider, stopped (with its jobs) by `stop`."""

    def __init__(self, state: Path, market_url: str, identity_file: Path, *flags: str):
        self.state = state
        started = runyard("control", "start", "--state-dir", str(state), "--market", market_url,
                          "--provider-key", str(identity_file), *flags)
        assert started.returncode == 0, started.stderr + self.log()

    def log(self) -> str:
        path = self.state / "daemon.log"
        return path.read_text()[-5000:] if path.exists() else ""

    def client(self) -> ControlClient:
        return ControlClient.for_state_dir(self.state)

    def stop(self) -> None:
        """Stop the daemon and every process of its jobs (a daemon's stop leaves jobs running)."""
        runyard("control", "stop", "--state-dir", str(self.state))
        with contextlib.suppress(Exception):
            for job in JobStore(self.state / "control.db").jobs():
                procs.kill_job_processes(procs.instance_id(self.state), job.id)
        # A lease still live when the test ends keeps its work folder's filesystem mounted (an agent that
        # restarts finds it so); nothing restarts here, and a mount would outlive the test's tmp folder.
        for lease_root in self.state.glob("agent/lease-*"):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                disk_quota.release(lease_root, remove_image=False)  # unmounts only what is mounted


def serve_processes() -> list[tuple[int, str]]:
    """The `runyard serve` processes of this machine (seen from outside any sandbox): (pid, the export it
    serves). The server itself, not the launcher, bwrap or the relay whose command lines name it too."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[1:4] == [b"-m", b"runyard", b"serve"] and len(argv) > 4:
                found.append((int(entry.name), argv[4].decode(errors="replace")))
    return found
