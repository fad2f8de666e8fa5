import sqlite3

import pytest

from runyard.control.states import IllegalTransition, JobState
from runyard.control.store import QUEUE_QUERY, Change, JobNotFound, JobStore, QueuedJob


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


def test_apply_commits_every_change_or_none(tmp_path):
    store = JobStore(tmp_path / "c.db")
    a, b, c = _add(store), _add(store), _add(store)
    store.transition(c.id, JobState.CANCELLED, actor="t", reason="gone")
    batch = [Change(a.id, JobState.STARTING, "scheduler", "allocated cpu:0", [JobState.PENDING], {"allocation": ["cpu:0"]}),
             Change(b.id, JobState.STARTING, "scheduler", "allocated cpu:1", [JobState.PENDING], {"allocation": ["cpu:1"]}),
             Change(c.id, JobState.STARTING, "scheduler", "allocated cpu:2", [JobState.PENDING], {"allocation": ["cpu:2"]})]
    with pytest.raises(IllegalTransition):  # c is no longer pending: the whole round is refused
        store.apply(batch)
    other = sqlite3.connect(tmp_path / "c.db")
    assert other.execute("SELECT id, state, allocation FROM jobs ORDER BY id").fetchall() == [
        (a.id, "pending", "[]"), (b.id, "pending", "[]"), (c.id, "cancelled", "[]")]
    assert other.execute("SELECT count(*) FROM transitions WHERE to_state = 'starting'").fetchone() == (0,)

    after = store.apply(batch[:2])
    assert [(j.id, j.state, j.allocation) for j in after] == [
        (a.id, JobState.STARTING, ["cpu:0"]), (b.id, JobState.STARTING, ["cpu:1"])]
    # Committed before apply returned: another connection sees both, each with its logged transition.
    assert other.execute("SELECT id, state FROM jobs WHERE state = 'starting' ORDER BY id").fetchall() == [
        (a.id, "starting"), (b.id, "starting")]
    assert [h["reason"] for h in store.history(b.id)] == ["submitted", "allocated cpu:1"]


def test_the_queue_is_read_in_scheduling_order_from_its_covering_index(tmp_path):
    store = JobStore(tmp_path / "c.db")
    low = _add(store, priority=0, devices=2, time_limit_s=60.0, tenant="a")
    high = _add(store, priority=5)
    high2 = _add(store, priority=5, depends_on=high.id)
    running = _add(store, priority=9)
    store.transition(running.id, JobState.STARTING, actor="t", reason="x", allocation=["cpu:0"])
    queue = store.queue()
    assert [q.id for q in queue] == [high.id, high2.id, low.id]
    assert queue[2] == QueuedJob(low.id, "a", 0, 2, 60.0, None, 0, None)
    assert queue[1].depends_on == high.id
    # Every column the scheduler reads is in the index: a round never touches the table's rows.
    plan_rows = store._db.execute("EXPLAIN QUERY PLAN " + QUEUE_QUERY).fetchall()
    assert any("USING COVERING INDEX jobs_queue" in row[-1] for row in plan_rows), plan_rows
