"""The store on both backends: migrations build exactly the declared schema; history is append-only."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from runyard.market import funds, identity
from runyard.market.errors import BadRequest
from runyard.market.models import CreditIn
from runyard.market.schema import metadata
from runyard.market.signing import generate_keypair
from runyard.market.store import Store

from .helpers import open_market


def test_migrations_create_the_declared_schema(empty_store_url):
    market = open_market(empty_store_url)
    with market.store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []
    market.store.migrate()  # a second run is a no-op
    with market.store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), metadata) == []


def test_history_tables_refuse_update_and_delete(empty_store_url):
    market = open_market(empty_store_url)
    t = identity.register(market, "t", "tenant", generate_keypair()[1])
    identity.request_verification(market, identity.authenticate(market, t["token"]), "")
    ops = identity.authenticate(market, identity.create_operator(market, "ops")["token"])
    funds.credit(market, ops, CreditIn(account=str(t["id"]), amount=100, reason="seed"), "k")
    for statement in (
        "UPDATE transfers SET amount = 1",
        "DELETE FROM transfers",
        "UPDATE audit_log SET actor = 'x'",
        "DELETE FROM transitions",
    ):
        with pytest.raises(DBAPIError, match="append-only"), market.store.engine.begin() as conn:
            conn.execute(text(statement))


def test_in_memory_sqlite_is_refused():
    with pytest.raises(BadRequest, match="in-memory"):
        Store("sqlite://")
