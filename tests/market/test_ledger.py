"""The ledger's two-phase transfers and guards, on both backends."""

from __future__ import annotations

import pytest

from runyard.market import invariants, ledger
from runyard.market.errors import BadRequest, InsufficientFunds, InvalidTransition

from .helpers import open_market


def test_two_phase_transfers_resolve_exactly_once(store_url):
    market = open_market(store_url)

    def run(conn, now):
        a = ledger.open_account(conn, "tenant:x:available", "tenant_available")
        e = ledger.open_account(conn, "escrow:x", "escrow")
        ext = ledger.open_account(conn, ledger.external_code(1, "deposits"), "external_deposits")
        deposit = ledger.transfer(conn, ext, a, 1000, reason="deposit", actor="t", now=now)
        with pytest.raises(InvalidTransition, match="is not a pending transfer"):
            ledger.void_pending(conn, deposit, reason="x", actor="t", now=now)
        held = ledger.transfer(conn, a, e, 700, reason="escrow_reserve", actor="t", now=now, pending=True)
        assert ledger.balance(conn, a).available == 300
        with pytest.raises(InsufficientFunds, match="has 300 available"):
            ledger.transfer(conn, a, e, 301, reason="x", actor="t", now=now)
        with pytest.raises(BadRequest, match="holds only 700"):
            ledger.post_pending(conn, held, 701, reason="x", actor="t", now=now)
        ledger.post_pending(conn, held, 400, reason="escrow_fund", actor="t", now=now)
        assert ledger.balance(conn, a).available == 600  # the 300 not posted came back
        assert ledger.balance(conn, e).posted == 400
        with pytest.raises(InvalidTransition, match="already posted"):
            ledger.post_pending(conn, held, 1, reason="x", actor="t", now=now)
        with pytest.raises(InvalidTransition, match="already posted"):
            ledger.void_pending(conn, held, reason="x", actor="t", now=now)
        second = ledger.transfer(conn, a, e, 600, reason="escrow_reserve", actor="t", now=now, pending=True)
        ledger.void_pending(conn, second, reason="escrow_release", actor="t", now=now)
        assert ledger.balance(conn, a).available == 600
        assert invariants.check(conn) == []

    market.write(run)


@pytest.mark.parametrize("amount", [0, -5, 10**16, True, 1.5])
def test_bad_amounts_are_refused(amount):
    with pytest.raises(BadRequest):
        ledger.check_amount(amount)


def test_the_audit_notices_tampered_counters(store_url):
    market = open_market(store_url)

    def run(conn, now):
        a = ledger.open_account(conn, "tenant:y:available", "tenant_available")
        ledger.transfer(
            conn,
            ledger.open_account(conn, ledger.external_code(1, "deposits"), "external_deposits"),
            a,
            50,
            reason="deposit",
            actor="t",
            now=now,
        )
        conn.execute(
            ledger.ledger_accounts.update().where(ledger.ledger_accounts.c.id == a).values(credits_posted=60)
        )
        problems = invariants.check(conn)
        assert any(p.startswith("zero_sum") for p in problems)
        assert any("counters: tenant:y:available.credits_posted is 60" in p for p in problems)
        raise RuntimeError("roll back")

    with pytest.raises(RuntimeError):
        market.write(run)
