"""Fixtures for control-plane tests: a real daemon process on loopback, real job processes."""

from __future__ import annotations

import contextlib

import pytest

from runyard.control import procs
from runyard.control.store import JobStore

from .helpers import Daemon, require_sandbox


@pytest.fixture
def daemon_factory(tmp_path):
    """daemon_factory(flags...) -> a started Daemon; every daemon and job process is stopped after.
    These daemons run the test job script as a raw command, so they accept commands (--allow-argv)
    unless `argv=False`."""
    made: list[Daemon] = []

    def make(*flags: str, argv: bool = True) -> Daemon:
        flags = (*flags, "--allow-argv") if argv else flags
        d = Daemon(tmp_path / f"state{len(made)}", tmp_path / f"events{len(made)}.jsonl", list(flags))
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.stop()
        ids = []
        with contextlib.suppress(Exception):
            ids = [j.id for j in JobStore(d.state_dir / "control.db").jobs()]
        for job_id in ids:
            procs.kill_job_processes(procs.instance_id(d.state_dir), job_id)


@pytest.fixture
def sandboxed():
    """Skip (fail under CI=true) unless bubblewrap runs here."""
    require_sandbox()
