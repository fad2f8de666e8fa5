"""The control plane's durable state: jobs and their transition log in one SQLite file (WAL).

Every state change goes through `JobStore.transition` (or `JobStore.apply`, several changes in one
transaction), which checks the table in `states.py` and commits the new state with its actor, time
and reason before returning. Callers act only after it returns, so a daemon killed at any instant
leaves a state it can reconcile on restart.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from runyard.control.states import IllegalTransition, JobState, check_transition
from runyard.errors import RunyardError

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    tenant TEXT NOT NULL DEFAULT 'default',
    priority INTEGER NOT NULL DEFAULT 0,
    devices INTEGER NOT NULL DEFAULT 1,
    argv TEXT NOT NULL,
    env TEXT NOT NULL DEFAULT '{}',
    run_dir TEXT NOT NULL,
    log_path TEXT NOT NULL,
    depends_on INTEGER REFERENCES jobs(id),
    time_limit_s REAL,
    retry_policy TEXT NOT NULL DEFAULT '{}',
    lease_id TEXT,
    state TEXT NOT NULL,
    failure TEXT,
    detail TEXT,
    restart_count INTEGER NOT NULL DEFAULT 0,
    attempt INTEGER NOT NULL DEFAULT 0,
    allocation TEXT NOT NULL DEFAULT '[]',
    pid INTEGER,
    pid_start_time INTEGER,
    backend_id TEXT,
    exit_code INTEGER,
    failures TEXT NOT NULL DEFAULT '[]',
    next_start_at REAL,
    signalled_at REAL,
    attempt_started_at REAL,
    submitted_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    device_seconds REAL NOT NULL DEFAULT 0
);
DROP INDEX IF EXISTS jobs_state;
-- The queue in scheduling order, holding every column the scheduler reads (a covering index: a
-- round reads the waiting jobs from the index alone, already sorted). Its prefix serves state lookups.
CREATE INDEX IF NOT EXISTS jobs_queue
    ON jobs(state, priority DESC, id, tenant, devices, time_limit_s, depends_on, attempt, started_at);
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL REFERENCES jobs(id),
    from_state TEXT,
    to_state TEXT NOT NULL,
    actor TEXT NOT NULL,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS transitions_job ON transitions(job_id);
"""

_JSON_FIELDS = ("argv", "env", "retry_policy", "allocation", "failures")


class JobNotFound(RunyardError):
    """No job with that id in this control plane's state."""


@dataclass
class Job:
    """One row of the jobs table, decoded."""

    id: int
    name: str
    tenant: str
    priority: int
    devices: int
    argv: list[str]
    env: dict[str, str]
    run_dir: str
    log_path: str
    depends_on: int | None
    time_limit_s: float | None
    retry_policy: dict[str, Any]
    lease_id: str | None
    state: JobState
    failure: str | None  # a FailureReason once failed
    detail: str | None
    restart_count: int
    attempt: int
    allocation: list[str]
    pid: int | None
    pid_start_time: int | None
    backend_id: str | None
    exit_code: int | None
    failures: list[list[Any]]
    next_start_at: float | None
    signalled_at: float | None
    attempt_started_at: float | None
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    device_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d["state"] = str(self.state)
        return d


class QueuedJob(NamedTuple):
    """A pending job as the scheduler sees it: the columns of the `jobs_queue` index, nothing decoded."""

    id: int
    tenant: str
    priority: int
    devices: int
    time_limit_s: float | None
    depends_on: int | None
    attempt: int
    started_at: float | None


QUEUE_QUERY = (
    "SELECT id, tenant, priority, devices, time_limit_s, depends_on, attempt, started_at FROM jobs "
    "INDEXED BY jobs_queue WHERE state = 'pending' ORDER BY priority DESC, id"
)


@dataclass
class Change:
    """One state change for `JobStore.apply`: move `job_id` to `to`, setting `fields` with it."""

    job_id: int
    to: JobState
    actor: str
    reason: str
    expect: Iterable[JobState] | None = None  # the states the caller believes it is in
    fields: dict[str, Any] = field(default_factory=dict)


def _decode(row: sqlite3.Row) -> Job:
    values = dict(row)
    for name in _JSON_FIELDS:
        raw = values[name]
        # Most rows hold empty defaults; skipping the parser for them halves a 1,000-job tick.
        values[name] = [] if raw == "[]" else {} if raw == "{}" else json.loads(raw)
    values["state"] = JobState(values["state"])
    return Job(**values)


class JobStore:
    """Jobs and transitions in SQLite. Thread-safe: one connection guarded by a lock."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Private whatever the umask: jobs' commands, tenants and run directories are the provider's
        # business. Made empty and 0600 before SQLite opens it (its -wal/-shm files copy that mode).
        os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))
        os.chmod(self.path, 0o600)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a committed transition survives power loss
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writes ---------------------------------------------------------------------------------

    def add(self, *, actor: str, reason: str = "submitted", **fields: Any) -> Job:
        """Insert a new pending job and its first transition (None -> pending)."""
        now = time.time()
        fields.setdefault("env", {})
        fields.setdefault("retry_policy", {})
        for name in _JSON_FIELDS:
            if name in fields:
                fields[name] = json.dumps(fields[name])
        fields.update(state=str(JobState.PENDING), submitted_at=now)
        cols = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute(f"INSERT INTO jobs ({cols}) VALUES ({marks})", list(fields.values()))
                job_id = cur.lastrowid
                self._db.execute(
                    "INSERT INTO transitions (job_id, from_state, to_state, actor, reason, at) "
                    "VALUES (?, NULL, 'pending', ?, ?, ?)",
                    (job_id, actor, reason, now),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return self.get(job_id)

    def transition(
        self, job_id: int, to: JobState, *, actor: str, reason: str, expect: Iterable[JobState] | None = None,
        **fields: Any,
    ) -> Job:
        """Move a job to `to`, updating `fields` in the same transaction, and log who and why.

        `expect` (optional) names the states the caller believes the job is in; if it is elsewhere
        (another thread moved it), IllegalTransition is raised and nothing changes.
        """
        return self.apply([Change(job_id, to, actor, reason, expect, fields)])[0]

    def apply(self, changes: Sequence[Change]) -> list[Job]:
        """Commit several state changes in one transaction: all of them or, if any is refused
        (IllegalTransition, JobNotFound), none. Returns the jobs as they are after it, in order.

        A scheduling round commits all its decisions here at once (one write to disk) before it
        starts or stops anything.
        """
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                after = [self._change(change, now) for change in changes]
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return after

    def _change(self, change: Change, now: float) -> Job:
        """One change inside `apply`'s transaction."""
        row = self._db.execute("SELECT state FROM jobs WHERE id = ?", (change.job_id,)).fetchone()
        if row is None:
            raise JobNotFound(f"no job {change.job_id}")
        current = JobState(row["state"])
        if change.expect is not None and current not in set(change.expect):
            raise IllegalTransition(change.job_id, current, change.to)
        check_transition(change.job_id, current, change.to)
        sets = {"state": str(change.to)}
        for name, value in change.fields.items():
            sets[name] = json.dumps(value) if name in _JSON_FIELDS else value
        assign = ", ".join(f"{k} = ?" for k in sets)
        self._db.execute(f"UPDATE jobs SET {assign} WHERE id = ?", [*sets.values(), change.job_id])
        self._db.execute(
            "INSERT INTO transitions (job_id, from_state, to_state, actor, reason, at) VALUES (?, ?, ?, ?, ?, ?)",
            (change.job_id, str(current), str(change.to), change.actor, change.reason, now),
        )
        return _decode(self._db.execute("SELECT * FROM jobs WHERE id = ?", (change.job_id,)).fetchone())

    def update(self, job_id: int, **fields: Any) -> Job:
        """Change bookkeeping fields (pid, usage...) that are not a state change."""
        for name in _JSON_FIELDS:
            if name in fields:
                fields[name] = json.dumps(fields[name])
        assign = ", ".join(f"{k} = ?" for k in fields)
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {assign} WHERE id = ?", [*fields.values(), job_id])
            return self.get(job_id)

    # -- reads ----------------------------------------------------------------------------------

    def get(self, job_id: int) -> Job:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(f"no job {job_id} in {self.path}")
        return _decode(row)

    def jobs(self, states: Iterable[JobState] | None = None, lease_id: str | None = None) -> list[Job]:
        """Jobs in submission order (id), optionally only those in `states` or of one lease."""
        query, args = "SELECT * FROM jobs", []
        clauses = []
        if states is not None:
            states = list(states)
            clauses.append(f"state IN ({', '.join('?' for _ in states)})")
            args += [str(s) for s in states]
        if lease_id is not None:
            clauses.append("lease_id = ?")
            args.append(lease_id)
        if clauses:
            query += " WHERE " + " AND ".join(clauses)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY id", args).fetchall()
        return [_decode(r) for r in rows]

    def queue(self) -> list[QueuedJob]:
        """The pending jobs in queue order (priority, then submission), read from the queue index."""
        with self._lock:
            cur = self._db.cursor()
            cur.row_factory = None  # plain tuples: no sqlite3.Row per job
            return list(map(QueuedJob._make, cur.execute(QUEUE_QUERY)))

    def ids_in(self, states: Iterable[JobState]) -> set[int]:
        """Ids of the jobs in `states` (cheap: no rows decoded)."""
        states = [str(s) for s in states]
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM jobs WHERE state IN ({', '.join('?' for _ in states)})", states
            ).fetchall()
        return {r[0] for r in rows}

    def history(self, job_id: int) -> list[dict[str, Any]]:
        """The job's transitions, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT from_state, to_state, actor, reason, at FROM transitions WHERE job_id = ? ORDER BY id",
                (job_id,),
            ).fetchall()
        return [dict(r) for r in rows]

    def all_transitions(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM transitions ORDER BY id").fetchall()
        return [dict(r) for r in rows]
