"""The market's store: SQLAlchemy engines for SQLite (WAL, the embedded default) and PostgreSQL,
transactions with retry on contention, and schema migration with Alembic.

Isolation. On SQLite every write transaction starts with BEGIN IMMEDIATE, so writers queue on the
database lock instead of failing half-way when they upgrade a read lock. On PostgreSQL transactions
run at READ COMMITTED and take row locks (SELECT ... FOR UPDATE) on what they change, always in the
same order (lease or demand row, then ledger accounts by id), so they serialise where they touch the
same money and run in parallel otherwise. Deadlocks, serialisation failures, lock timeouts and a
locked SQLite are retried from the start: every transaction is a pure function of the database, so
running it again is safe. Nothing else is retried: a unique-key violation is a conflict (409) that
retrying could not cure (the one expected race, two requests with one idempotency key, is handled
where it happens, in `Market.idempotent`).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from runyard.market.errors import BadRequest, Conflict, StoreBusy

T = TypeVar("T")

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
RETRYABLE_PG_STATES = {
    "40001",
    "40P01",
    "55P03",
}  # serialization_failure, deadlock_detected, lock_not_available
MAX_ATTEMPTS = 12


def normalise_url(url: str) -> str:
    """Accept a bare path for SQLite and plain postgresql:// URLs (use psycopg 3)."""
    if "://" not in url:
        return f"sqlite:///{Path(url).expanduser().resolve()}"
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_engine(url: str, pool_size: int = 10) -> Engine:
    url = normalise_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise BadRequest("an in-memory SQLite market would vanish with its connection; give a file path")
        engine = create_engine(
            url,
            connect_args={"timeout": 60, "check_same_thread": False},
            pool_size=pool_size,
            max_overflow=pool_size,
        )
        _configure_sqlite(engine)
        return engine
    if parsed.get_backend_name() == "postgresql":
        return create_engine(url, pool_size=pool_size, max_overflow=2 * pool_size, pool_pre_ping=True)
    raise BadRequest(f"unsupported store URL {url!r}: use a SQLite path or a postgresql:// URL")


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        # Take transaction control from the sqlite3 module so that BEGIN IMMEDIATE is ours to issue.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # type: ignore[no-untyped-def]
        readonly = conn.get_execution_options().get("runyard_readonly", False)
        conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")


def _retryable(exc: DBAPIError) -> bool:
    """Contention only: a serialisation failure, a deadlock, a lock timeout or a busy SQLite."""
    if isinstance(exc, IntegrityError):
        return False
    if isinstance(exc, OperationalError):
        text = str(exc.orig).lower()
        if "database is locked" in text or "database is busy" in text:
            return True
    state = getattr(exc.orig, "sqlstate", None)
    return state in RETRYABLE_PG_STATES


class Store:
    """One market database. `write` and `read` run a function inside one transaction."""

    def __init__(self, url: str, pool_size: int = 10):
        self.url = normalise_url(url)
        self.engine = make_engine(self.url, pool_size=pool_size)
        self.dialect = self.engine.dialect.name
        self._writer_lock = threading.Lock() if self.dialect == "sqlite" else None

    def write(self, fn: Callable[[Connection], T]) -> T:
        """Run `fn(conn)` in a write transaction, retrying it whole on contention."""
        if self._writer_lock is not None:
            # SQLite has one writer at a time anyway. Queueing this process's writers on a lock
            # hands the database over at once, where SQLite's busy handler would sleep and poll.
            with self._writer_lock:
                return self._write(fn)
        return self._write(fn)

    def _write(self, fn: Callable[[Connection], T]) -> T:
        for attempt in range(MAX_ATTEMPTS):
            try:
                with self.engine.begin() as conn:
                    return fn(conn)
            except IntegrityError as exc:
                raise Conflict(
                    "the request conflicts with a concurrent change (a name, key or id already taken)"
                ) from exc
            except DBAPIError as exc:
                if not _retryable(exc) or attempt == MAX_ATTEMPTS - 1:
                    if _retryable(exc):
                        raise StoreBusy(f"the store stayed contended after {MAX_ATTEMPTS} attempts") from exc
                    raise
                # Jittered backoff so that retried transactions do not collide again in lock-step.
                time.sleep(min(0.2, 0.002 * (2**attempt)) * random.random())
        raise AssertionError("unreachable")

    def read(self, fn: Callable[[Connection], T]) -> T:
        """Run `fn(conn)` in a read-only transaction (a consistent snapshot on both backends)."""
        for attempt in range(MAX_ATTEMPTS):
            try:
                with self.engine.connect() as conn:
                    # PostgreSQL's default gives each statement its own snapshot; a report that
                    # reads several tables (the audit, a statement) needs one for all of them.
                    options = {"isolation_level": "REPEATABLE READ"} if self.dialect == "postgresql" else {}
                    conn = conn.execution_options(runyard_readonly=True, **options)
                    with conn.begin():
                        return fn(conn)
            except OperationalError as exc:
                if not _retryable(exc) or attempt == MAX_ATTEMPTS - 1:
                    raise
                time.sleep(0.01 * random.random())
        raise AssertionError("unreachable")

    def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision (creating it on an empty database)."""
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        with self.engine.begin() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, "head")

    def dispose(self) -> None:
        self.engine.dispose()
