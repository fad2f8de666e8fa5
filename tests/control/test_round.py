"""A scheduling round commits every decision, in one transaction, before anything acts on it; a daemon
that dies between deciding and acting leaves intents that a restart queues again (nothing launched here:
the real store and loop, the death staged by never calling `act`)."""

import sqlite3
import time

from runyard.control import procs, scheduler
from runyard.control.backends.local import LocalBackend
from runyard.control.jobs import add_jobs
from runyard.control.loop import ControlConfig, ControlLoop
from runyard.control.states import JobState
from runyard.control.store import JobStore


def test_a_round_commits_all_its_decisions_before_acting_and_a_restart_requeues_them(tmp_path):
    config = ControlConfig(state_dir=tmp_path, inventory=["cpu:0", "cpu:1"])
    store = JobStore(tmp_path / "control.db")
    loop = ControlLoop(config, store, LocalBackend(procs.instance_id(tmp_path)))
    low, high, huge, later = add_jobs(store, [
        {"name": "low", "argv": ["true"], "priority": 1},
        {"name": "high", "argv": ["true"], "priority": 5},
        {"name": "huge", "argv": ["true"], "devices": 3},
        {"name": "later", "argv": ["true"]},
    ], config, "test")

    decided = loop.decide(time.time())

    assert [(type(a), j.id, j.state, j.allocation) for a, j in decided] == [
        (scheduler.Start, high.id, JobState.STARTING, ["cpu:0"]), (scheduler.Start, low.id, JobState.STARTING, ["cpu:1"])]
    other = sqlite3.connect(tmp_path / "control.db")  # what a restarted daemon would read
    assert other.execute("SELECT id, state, allocation, pid FROM jobs ORDER BY id").fetchall() == [
        (low.id, "starting", '["cpu:1"]', None), (high.id, "starting", '["cpu:0"]', None),
        (huge.id, "failed", "[]", None), (later.id, "pending", "[]", None)]
    assert store.get(huge.id).failure == "no_capacity"

    # The daemon dies here, before `act` launched anything: a restart queues the intents again.
    restarted = ControlLoop(config, JobStore(tmp_path / "control.db"), LocalBackend(procs.instance_id(tmp_path)))
    restarted.reconcile()
    for job_id in (low.id, high.id):
        job = restarted.store.get(job_id)
        assert (job.state, job.allocation, job.attempt) == (JobState.PENDING, [], 0)
        assert restarted.store.history(job_id)[-1]["reason"] == "the daemon stopped before launching it; queued again"
    assert restarted.decide(time.time())[0][1].id == high.id  # and the next round decides the same again
