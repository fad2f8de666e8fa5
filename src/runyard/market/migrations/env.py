"""Alembic environment for the market's store. `Store.migrate` hands in a live connection; the
command-line form (alembic -c alembic.ini) reads the URL from RUNYARD_MARKET_DB."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine

from runyard.market.schema import metadata
from runyard.market.store import normalise_url

config = context.config


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = os.environ.get("RUNYARD_MARKET_DB")
    if not url:
        raise SystemExit("set RUNYARD_MARKET_DB to the market's store URL")
    engine = create_engine(normalise_url(url))
    with engine.begin() as conn:
        _run(conn)
