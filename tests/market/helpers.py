"""Builders shared by the market tests: markets, verified and funded parties, listings, demands."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from runyard.market import identity, invariants
from runyard.market.client import MarketClient
from runyard.market.rails import TestRail
from runyard.market.service import Market, Settings
from runyard.market.verifiers import OperatorVerifier

HOUR = 3600
DAY = 86400
FAR = 4_000_000_000  # a Unix time well after any test's clock
RAIL = TestRail(b"test-rail-secret-of-the-market-tests")


def open_market(url: str, clock=time.time, **settings) -> Market:
    defaults = {"test_clock": True, "dispute_window_s": 600, "accept_timeout_s": 900, "start_timeout_s": 900}
    return Market.open(
        url, Settings(**{**defaults, **settings}), verifier=OperatorVerifier(), rails={"test": RAIL}, clock=clock
    )


def assert_audit_ok(market: Market) -> dict:
    result = invariants.audit_market(market)
    assert result["ok"], "\n".join(result["violations"])
    return result


@dataclass
class Party:
    client: MarketClient
    name: str
    role: str
    id: int = 0
    extra: dict = field(default_factory=dict)


def new_party(url: str, name: str, role: str, operator: MarketClient | None = None) -> Party:
    """Register over HTTP; with `operator`, also request and approve verification."""
    client = MarketClient(url)
    result = client.register(name, role)
    party = Party(client, name, role, result["id"])
    if operator is not None:
        client.request_verification(f"{name} papers")
        operator.decide(name, True, "documents checked")
    return party


def operator_client(market: Market, url: str) -> MarketClient:
    token = identity.create_operator(market, "ops")["token"]
    return MarketClient(url, token=token)


def payout_method(client: MarketClient) -> int:
    """Register a test-rail payout method for `client`'s account; its id."""
    return client.add_payout_method(rail="test", destination=f"acct-{client.me()['id']}")["id"]


def listing(**overrides) -> dict:
    body = {
        "accelerator_kind": "h100-80gb",
        "devices_per_node": 8,
        "node_count": 1,
        "interconnect": "nvlink",
        "interconnect_gbps": 900,
        "region": "eu-west",
        "jurisdiction": "eu",
        "price_per_device_hour": 300,
        "available_until": FAR,
        "start_class": "immediate",
        "scheduler_kind": "slurm",
    }
    return {**body, **overrides}


def requirement(**overrides) -> dict:
    body = {"accelerator_kinds": ["h100-80gb"], "device_count": 4, "duration_s": 2 * HOUR}
    return {**body, **overrides}


def fingerprint(market: Market) -> dict:
    """Row counts of every table and every ledger counter: equal before and after = nothing changed."""
    from sqlalchemy import func, select

    from runyard.market.schema import ledger_accounts, metadata

    def read(conn, now):
        counts = {
            t.name: conn.execute(select(func.count()).select_from(t)).scalar_one()
            for t in metadata.sorted_tables
        }
        counters = [
            tuple(r) for r in conn.execute(select(ledger_accounts).order_by(ledger_accounts.c.id)).all()
        ]
        return {"counts": counts, "ledger": counters}

    return market.read(read)
