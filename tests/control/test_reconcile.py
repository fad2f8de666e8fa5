"""A daemon that died between recording a launch intent and recording the launched process: on
restart the attempt is adopted if it is running, or queued again if it never started. Real
processes, the real store and backend; only the daemon's death is staged (by not recording)."""

import sys
import time

import pytest

from runyard.control import procs
from runyard.control.backends.local import LocalBackend
from runyard.control.jobs import add_jobs
from runyard.control.loop import ControlConfig, ControlLoop
from runyard.control.states import JobState
from runyard.control.store import JobStore

from .helpers import JOBSCRIPT


@pytest.mark.slow
def test_launch_intents_are_adopted_or_requeued_never_doubled(tmp_path):
    config = ControlConfig(state_dir=tmp_path, inventory=["cpu:0", "cpu:1"])
    store = JobStore(tmp_path / "control.db")
    loop = ControlLoop(config, store, LocalBackend(procs.instance_id(tmp_path)))
    launched, lost = add_jobs(store, [
        {"name": "launched", "argv": [sys.executable, JOBSCRIPT, "--steps", "20", "--step-s", "0.05"]},
        {"name": "never", "argv": [sys.executable, JOBSCRIPT]},
    ], config, "test")
    for job, device in ((launched, "cpu:0"), (lost, "cpu:1")):
        store.transition(job.id, JobState.STARTING, actor="scheduler", reason="test", allocation=[device], attempt=1)
    # The first launch happened; the daemon died before writing its pid.
    job = store.get(launched.id)
    loop.backend.launch(job, loop.job_env(job))
    time.sleep(0.3)

    restarted = ControlLoop(config, JobStore(tmp_path / "control.db"), LocalBackend(procs.instance_id(tmp_path)))
    restarted.reconcile()
    adopted, requeued = restarted.store.get(launched.id), restarted.store.get(lost.id)
    assert adopted.state == JobState.RUNNING and adopted.pid is not None and adopted.attempt == 1
    assert requeued.state == JobState.PENDING and requeued.allocation == []
    deadline = time.monotonic() + 30
    while not (restarted.store.get(launched.id).state.terminal and restarted.store.get(lost.id).state.terminal):
        assert time.monotonic() < deadline
        restarted.tick()
        time.sleep(0.05)
    assert restarted.store.get(launched.id).state == JobState.SUCCEEDED
    assert restarted.store.get(launched.id).attempt == 1  # adopted, not launched a second time
    assert restarted.store.get(lost.id).attempt == 1  # the intent that never ran does not count
    assert len(procs.processes_of_job(procs.instance_id(tmp_path), launched.id)) == 0
