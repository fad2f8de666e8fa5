"""Money over real HTTP, on both backends: it enters only through a payment rail's signed event
(applied once per event id) or an operator's credit, within per-account limits, and leaves only to a
registered payout method. No party can exhaust a counter another party needs."""

from __future__ import annotations

import time

import httpx
import pytest

from runyard.market.client import MarketClientError
from runyard.market.rails import SIGNATURE_HEADER, TestRail, signature_header
from runyard.market.server import ServerThread

from .helpers import (
    RAIL,
    assert_audit_ok,
    fingerprint,
    new_party,
    open_market,
    operator_client,
    payout_method,
)


@pytest.fixture
def world(store_url):
    market = open_market(store_url, deposit_limit_per_day=10_000, withdrawal_limit_per_day=3_000, balance_limit=15_000)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        t1 = new_party(server.url, "lab-one", "tenant", ops)
        t2 = new_party(server.url, "lab-two", "tenant", ops)
        p1 = new_party(server.url, "farm", "provider", ops)
        yield {"market": market, "url": server.url, "ops": ops, "t1": t1, "t2": t2, "p1": p1}
    assert_audit_ok(market)
    market.store.dispose()


def _event(world, body: bytes, headers: dict) -> httpx.Response:
    return httpx.post(world["url"] + "/v1/rails/test/events", content=body, headers=headers)


def test_a_rail_event_is_applied_once_and_only_when_signed(world):
    t1 = world["t1"]
    first = t1.client.rail_deposit(RAIL, t1.id, 2_500, "evt-1")
    again = t1.client.rail_deposit(RAIL, t1.id, 2_500, "evt-1")
    assert (first["duplicate"], again["duplicate"], again["transfer_id"]) == (False, True, first["transfer_id"])
    assert t1.client.balances()["accounts"][0]["available"] == 2_500
    before = fingerprint(world["market"])
    body, headers = RAIL.deposit_event(t1.id, 999, event_id="evt-2")
    forged = TestRail(b"not-the-market-secret-at-all").deposit_event(t1.id, 999, event_id="evt-3")
    stale = {**headers, SIGNATURE_HEADER: signature_header(RAIL.secret, body, int(time.time()) - 3600)}
    for raw, sent, status in (
        (forged[0], forged[1], 401),  # signed with another secret
        (body, {"Content-Type": "application/json"}, 401),  # not signed
        (body, stale, 401),  # an old signature replayed
        (body.replace(b"999", b"9999"), headers, 401),  # tampered after signing
    ):
        response = _event(world, raw, sent)
        assert response.status_code == status, response.text
    assert httpx.post(world["url"] + "/v1/rails/paypal/events", content=body, headers=headers).status_code == 404
    with pytest.raises(MarketClientError) as err:
        t1.client.rail_deposit(RAIL, t1.id, 2_600, "evt-1")  # the same event id, other values
    assert err.value.status == 409
    assert fingerprint(world["market"]) == before
    # No self-service deposit exists any more.
    response = httpx.post(world["url"] + "/v1/funds/deposit", json={"amount": 5},
                          headers={"Authorization": f"Bearer {t1.client.token}", "Idempotency-Key": "x"})  # fmt: skip
    assert response.status_code in (404, 405)


def test_per_account_limits_and_no_shared_counter(world):
    t1, t2, ops = world["t1"], world["t2"], world["ops"]
    t1.client.rail_deposit(RAIL, t1.id, 10_000)
    before = fingerprint(world["market"])
    with pytest.raises(MarketClientError) as err:
        t1.client.rail_deposit(RAIL, t1.id, 1)  # over 10,000 a day
    assert err.value.code == "limit_exceeded" and "24 hours" in err.value.message
    with pytest.raises(MarketClientError) as err:
        ops.credit("lab-one", 5_001, "too much")  # over the 15,000 balance limit
    assert err.value.code == "limit_exceeded"
    assert fingerprint(world["market"]) == before
    # The other tenant is untouched by the first one's counters: its own deposits go through.
    assert t2.client.rail_deposit(RAIL, t2.id, 10_000)["duplicate"] is False
    ops.advance_clock(86_401)
    assert t1.client.rail_deposit(RAIL, t1.id, 4_000)["amount"] == 4_000  # a new day
    codes = [b["code"] for b in t1.client.balances()["accounts"]]
    assert codes == [f"tenant:{t1.id}:available"]  # the outside world's side is not the tenant's money


def test_withdrawals_go_to_a_registered_payout_method_after_checks(world):
    t1, ops, url = world["t1"], world["ops"], world["url"]
    ops.credit("lab-one", 10_000, "wire")
    newcomer = new_party(url, "lab-new", "tenant")  # never verified
    ops.credit("lab-new", 100, "wire")
    pm_new = payout_method(newcomer.client)
    with pytest.raises(MarketClientError) as err:
        newcomer.client.withdraw(50, pm_new)
    assert err.value.status == 403
    with pytest.raises(MarketClientError) as err:
        t1.client.add_payout_method(rail="swift", destination="x")
    assert err.value.status == 409 and "no payment rail" in err.value.message
    pm = payout_method(t1.client)
    assert [m["id"] for m in t1.client.payout_methods()] == [pm]
    with pytest.raises(MarketClientError) as err:
        t1.client.withdraw(50, pm_new)  # someone else's method
    assert err.value.status == 404
    t1.client.withdraw(2_000, pm)
    with pytest.raises(MarketClientError) as err:
        t1.client.withdraw(1_001, pm)  # 3,000 a day
    assert err.value.code == "limit_exceeded"
    statement = t1.client.statement()["totals"]
    assert (statement["deposited"], statement["withdrawn"], statement["available"]) == (10_000, 2_000, 8_000)
