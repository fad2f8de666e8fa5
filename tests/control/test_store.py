import sqlite3

import pytest

from runyard.control.states import IllegalTransition, JobState
from runyard.control.store import JobNotFound, JobStore


def _add(store, **kw):
    return store.add(actor="test", name="j", argv=["true"], run_dir="/tmp/r", log_path="/tmp/l", **kw)


def test_transitions_are_committed_with_actor_time_and_reason(tmp_path):
    store = JobStore(tmp_path / "c.db")
    job = _add(store)
    store.transition(job.id, JobState.STARTING, actor="scheduler", reason="allocated cpu:0", allocation=["cpu:0"])
    # A second connection (another process after a crash) sees it: it was committed, not buffered.
    other = sqlite3.connect(tmp_path / "c.db")
    assert other.execute("SELECT state, allocation FROM jobs").fetchone() == ("starting", '["cpu:0"]')
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    history = store.history(job.id)
    assert [(h["from_state"], h["to_state"], h["actor"], h["reason"]) for h in history] == [
        (None, "pending", "test", "submitted"), ("pending", "starting", "scheduler", "allocated cpu:0")]
    assert all(h["at"] > 0 for h in history)


def test_a_refused_transition_changes_nothing(tmp_path):
    store = JobStore(tmp_path / "c.db")
    job = _add(store)
    with pytest.raises(IllegalTransition):
        store.transition(job.id, JobState.SUCCEEDED, actor="x", reason="y", exit_code=0)
    with pytest.raises(IllegalTransition):  # the caller believed it was running
        store.transition(job.id, JobState.CANCELLED, actor="x", reason="y", expect=[JobState.RUNNING])
    after = store.get(job.id)
    assert after.state == JobState.PENDING and after.exit_code is None
    assert len(store.history(job.id)) == 1
    with pytest.raises(JobNotFound):
        store.get(999)
