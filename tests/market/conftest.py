"""Fixtures for the market's tests: a real store on SQLite and on PostgreSQL, and a real HTTP server.

PostgreSQL comes from RUNYARD_TEST_PG_URL (.ci/setup_postgres.sh writes it). Each test gets its own
schema there, so tests never see each other's rows. Without the variable the PostgreSQL cases are
skipped with a reason, except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from sqlalchemy import create_engine, text

from runyard.market.store import Store

BACKENDS = ["sqlite", "postgres"]


def pg_base_url() -> str | None:
    url = os.environ.get("RUNYARD_TEST_PG_URL")
    if url:
        return url
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(
            "RUNYARD_TEST_PG_URL is not set, and CI=true: run .ci/setup_postgres.sh and source .ci/env"
        )
    pytest.skip("RUNYARD_TEST_PG_URL is not set (run .ci/setup_postgres.sh, then `source .ci/env`)")
    return None


class PgSchemas:
    """Creates throwaway schemas in the test database and drops them afterwards."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.engine = create_engine(base_url, isolation_level="AUTOCOMMIT")
        self.created: list[str] = []

    def new_url(self) -> str:
        schema = f"t_{uuid.uuid4().hex[:12]}"
        with self.engine.connect() as conn:
            conn.execute(text(f"CREATE SCHEMA {schema}"))
        self.created.append(schema)
        sep = "&" if "?" in self.base_url else "?"
        # synchronous_commit=off: a test database need not wait for fsync on every commit; it
        # changes durability only, never what a transaction sees, so the tests still test the same.
        options = f"-csearch_path={schema} -csynchronous_commit=off"
        return f"{self.base_url}{sep}options={quote(options)}"

    def drop_all(self) -> None:
        with self.engine.connect() as conn:
            for schema in self.created:
                conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        self.engine.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> Path:
    """An SQLite store migrated to the newest revision once per session (per xdist worker), for tests that
    open many fresh markets (a hypothesis example each) and are not about creating the schema."""
    path = tmp_path_factory.mktemp("market-template") / "market.db"
    store = Store(str(path))
    store.migrate()
    store.dispose()
    return path


@pytest.fixture
def url_factory(request, tmp_path, sqlite_template) -> Iterator:
    """`url_factory(backend)` makes a fresh, empty store URL on that backend; `url_factory(backend,
    migrated=True)` one whose schema is already at the newest revision (on SQLite a copy of the session's
    template, so each hypothesis example skips the migrations; PostgreSQL's fresh schema is migrated when
    the market opens it, as before)."""
    schemas: list[PgSchemas] = []
    counter = iter(range(10**6))

    def make(backend: str, migrated: bool = False) -> str:
        if backend == "sqlite":
            path = tmp_path / f"market-{next(counter)}.db"
            if migrated:
                shutil.copyfile(sqlite_template, path)
            return str(path)
        if not schemas:
            schemas.append(PgSchemas(pg_base_url()))
        return schemas[0].new_url()

    yield make
    for s in schemas:
        s.drop_all()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def store_url(backend, url_factory) -> str:
    """A fresh store on each backend (the test runs once per backend), its schema at the newest revision:
    on SQLite a copy of the session's migrated template (SQLite's migrations rebuild tables and take about
    a second; tests/market/test_store.py proves them on an empty store), on PostgreSQL a new schema that
    the market migrates when it opens it."""
    return url_factory(backend, migrated=True)


@pytest.fixture
def empty_store_url(backend, url_factory) -> str:
    """A fresh, empty store on each backend: for tests of the migrations themselves."""
    return url_factory(backend)
