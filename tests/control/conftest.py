"""Fixtures for control-plane tests: a real daemon process on loopback, real job processes."""

from __future__ import annotations

import pytest

from runyard.control import procs

from .helpers import Daemon


@pytest.fixture
def daemon_factory(tmp_path):
    """daemon_factory(flags...) -> a started Daemon; every daemon and job process is stopped after."""
    made: list[Daemon] = []

    def make(*flags: str) -> Daemon:
        d = Daemon(tmp_path / f"state{len(made)}", tmp_path / f"events{len(made)}.jsonl", list(flags))
        made.append(d)
        return d.start()

    yield make
    for d in made:
        d.stop()
        ids = []
        try:
            from runyard.control.store import JobStore

            ids = [j.id for j in JobStore(d.state_dir / "control.db").jobs()]
        except Exception:
            pass
        for job_id in ids:
            procs.kill_job_processes(procs.instance_id(d.state_dir), job_id)
