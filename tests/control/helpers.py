"""Helpers for control-plane tests: a real daemon process on loopback, real job processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runyard.control import sandbox
from runyard.control.client import ControlClient
from runyard.system.processes import popen_dying_with_me

JOBSCRIPT = str(Path(__file__).with_name("jobscript.py"))
REPO = Path(__file__).resolve().parents[2]


def job(name: str, *args: str, **fields) -> dict:
    """A job request running tests/control/jobscript.py with `args`."""
    return {"name": name, "argv": [sys.executable, JOBSCRIPT, *args], **fields}


class Daemon:
    """A control-plane daemon run as a real process, in the foreground, killable at will."""

    def __init__(self, state_dir: Path, events: Path, flags: list[str]):
        self.state_dir, self.events, self.flags = state_dir, events, flags
        self.proc: subprocess.Popen | None = None
        self.client: ControlClient | None = None

    def start(self) -> Daemon:
        (self.state_dir / "daemon.json").unlink(missing_ok=True)
        env = {**os.environ, "RUNYARD_TEST_EVENTS": str(self.events), "PYTHONPATH": str(REPO / "src")}
        self.log = open(self.state_dir.parent / "daemon.log", "ab")  # noqa: SIM115
        self.proc = popen_dying_with_me(
            [sys.executable, "-m", "runyard", "control", "start", "--foreground", "--state-dir", str(self.state_dir),
             *self.flags],
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while not (self.state_dir / "daemon.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start: {(self.state_dir.parent / 'daemon.log').read_text()}")
            time.sleep(0.05)
        self.client = ControlClient.for_state_dir(self.state_dir)
        return self

    def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def wait_event(self, job_id: int, kind: str = "start", count: int = 1, timeout_s: float = 30) -> list[dict]:
        """Wait until job `job_id` wrote `count` events of `kind` (the job's code really ran)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [e for e in self.events_of(kind) if int(e["job"]) == job_id]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} wrote {len(found)} {kind!r} events, expected {count}")
            time.sleep(0.02)

    def events_of(self, kind: str | None = None) -> list[dict]:
        if not self.events.exists():
            return []
        records = [json.loads(line) for line in self.events.read_text().splitlines() if line.strip()]
        return [r for r in records if kind is None or r["kind"] == kind]


def require_sandbox() -> None:
    """Skip (fail under CI=true) unless bubblewrap runs lease jobs here (.ci/setup_sandbox.sh)."""
    if not os.environ.get("RUNYARD_TEST_BWRAP"):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("RUNYARD_TEST_BWRAP is not set, and CI=true: run .ci/setup_sandbox.sh and source .ci/env")
        pytest.skip("RUNYARD_TEST_BWRAP is not set (run .ci/setup_sandbox.sh, then `source .ci/env`)")
    try:
        sandbox.probe()
    except sandbox.SandboxUnavailable as exc:
        pytest.fail(f"RUNYARD_TEST_BWRAP is set but the sandbox does not run: {exc}")
