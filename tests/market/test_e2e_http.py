"""The whole market over real HTTP (uvicorn on loopback), on SQLite and PostgreSQL: two providers,
two tenants, verification, listings, escrow-backed demands, matching (one demand waits for a
cheaper queued listing, one needs immediate capacity), signed usage, a dispute resolved in part,
settlement, and statements that reconcile to the minor unit."""

from __future__ import annotations

import pytest

from runyard.market.client import MarketClientError
from runyard.market.server import ServerThread

from .helpers import (
    HOUR,
    RAIL,
    assert_audit_ok,
    listing,
    new_party,
    open_market,
    operator_client,
    payout_method,
    requirement,
)


def test_full_market_flow(store_url):
    market = open_market(store_url, fee_bps=200)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        p1 = new_party(server.url, "fast-gpus", "provider")
        t1 = new_party(server.url, "lab-one", "tenant")

        # Unverified accounts can neither list nor demand.
        with pytest.raises(MarketClientError) as err:
            p1.client.create_listing(**listing())
        assert err.value.status == 403 and err.value.code == "not_verified"
        with pytest.raises(MarketClientError) as err:
            t1.client.place_demand(requirement(), 300)
        assert err.value.code == "not_verified"

        for party in (p1, t1):
            party.client.request_verification("registry extract")
            assert party.client.verify_status() == "pending"
        assert {a["name"] for a in ops.pending_accounts()} == {"fast-gpus", "lab-one"}
        ops.decide("fast-gpus", True, "registry checked")
        ops.decide(t1.id, True, "registry checked")
        p2 = new_party(server.url, "cheap-queue", "provider", operator=ops)
        t2 = new_party(server.url, "lab-two", "tenant", operator=ops)
        assert t1.client.verify_status() == "verified"

        ops.credit("lab-one", 100_000, "wire received")
        t2.client.rail_deposit(RAIL, t2.id, 100_000)  # through the (test) payment rail
        now = ops.market_info()["now"]

        # Provider 1: immediate capacity at 400 per device-hour.
        l1 = p1.client.create_listing(**listing(price_per_device_hour=400))
        # Tenant 1 will pay at most 300 and accepts queued capacity: nothing fits yet, escrow still held.
        demand_a = t1.client.place_demand(
            requirement(allowed_regions=["eu"], latest_start=now + HOUR, duration_s=2 * HOUR), 300
        )
        assert demand_a["state"] == "open" and demand_a["escrow_amount"] == 300 * 4 * 2
        assert t1.client.balances()["accounts"][0]["available"] == 100_000 - 2400
        # Tenant 2 needs immediate capacity: it matches provider 1 at the listing's price.
        demand_b = t2.client.place_demand(requirement(start_classes=["immediate"], duration_s=HOUR), 500)
        assert demand_b["state"] == "matched"
        lease_b = t2.client.lease(demand_b["lease_id"])
        assert lease_b["listing_id"] == l1["id"] and lease_b["escrow_amount"] == 400 * 4
        assert t2.client.balances()["accounts"][0]["available"] == 100_000 - 1600  # 400 over price came back

        # Provider 2 offers cheaper queued capacity: tenant 1's waiting demand matches it.
        l2 = p2.client.create_listing(
            **listing(price_per_device_hour=250, start_class="queued", max_queue_s=1800, region="eu-central")
        )
        demand_a = t1.client.demand(demand_a["id"])
        assert demand_a["state"] == "matched"
        lease_a = t1.client.lease(demand_a["lease_id"])
        assert lease_a["listing_id"] == l2["id"] and lease_a["escrow_amount"] == 250 * 4 * 2
        assert t1.client.balances()["accounts"][0]["available"] == 100_000 - 2000
        assert [x["reserved"] for x in p2.client.listings(mine=True)] == [4]

        # Providers sign the terms and start.
        for provider, lease in ((p1, lease_b), (p2, lease_a)):
            assert provider.client.leases(state="offered")[0]["id"] == lease["id"]
            assert provider.client.accept_lease(lease["id"])["state"] == "accepted"
            assert provider.client.start_lease(lease["id"])["state"] == "running"
        start_b = t2.client.lease(lease_b["id"])["started_at"]
        start_a = t1.client.lease(lease_a["id"])["started_at"]

        # An hour of work; signed usage; tenant 2 acknowledges everything.
        ops.advance_clock(HOUR)
        r1 = p1.client.report_usage(lease_b["id"], 1, start_b, start_b + 1800, 4 * 1800, evidence="sha256:aa")
        r2 = p1.client.report_usage(lease_b["id"], 2, start_b + 1800, start_b + HOUR, 4 * 1800)
        t2.client.acknowledge(r1["id"])
        t2.client.acknowledge(r2["id"])
        ra1 = p2.client.report_usage(lease_a["id"], 1, start_a, start_a + HOUR, 4 * HOUR)
        t1.client.submit_measurement(
            lease_a["id"], start_a, start_a + HOUR, 4 * HOUR - 60
        )  # within tolerance
        t1.client.acknowledge(ra1["id"])
        assert ops.sweep()["closed"] == 1  # lease B's window is over

        # The second hour; tenant 1 disputes it; the operator resolves in part.
        ops.advance_clock(HOUR)
        ra2 = p2.client.report_usage(lease_a["id"], 2, start_a + HOUR, start_a + 2 * HOUR, 4 * HOUR)
        dispute = t1.client.dispute(
            ra2["id"], "our job logged half the devices idle", claimed_device_seconds=2 * HOUR
        )
        assert [d["id"] for d in p2.client.disputes()] == [dispute["id"]]
        assert p1.client.disputes() == []
        ops.sweep()
        held = t1.client.settle(lease_a["id"])
        assert held["state"] == "window_closed" and held["held_device_seconds"] == 4 * HOUR
        resolved = ops.resolve_dispute(
            dispute["id"], "partial", "logs support 3 device-hours", device_seconds=3 * HOUR
        )
        assert resolved["state"] == "partial"

        ops.advance_clock(700)  # past every dispute window
        ops.sweep()
        a = t1.client.lease(lease_a["id"])
        b = t2.client.lease(lease_b["id"])
        assert a["state"] == b["state"] == "settled"
        # Lease B: 4 device-hours at 400 = 1600; fee 2% = 32. Lease A: 7 device-hours at 250 = 1750; fee 35.
        assert (b["paid_provider"], b["paid_fee"], b["refunded"]) == (1568, 32, 0)
        assert (a["paid_provider"], a["paid_fee"], a["refunded"]) == (1715, 35, 250)
        again = t1.client.settle(lease_a["id"])
        assert again["moved_now"] == 0

        s_t1, s_t2 = t1.client.statement(), t2.client.statement()
        s_p1, s_p2, s_ops = p1.client.statement(), p2.client.statement(), ops.statement()
        for s in (s_t1, s_t2, s_p1, s_p2, s_ops):
            assert s["totals"]["reconciles"], s["totals"]
            assert s["market_fee_bps"] == 200
        assert s_t1["totals"]["charged"] == 1750 and s_t1["totals"]["available"] == 100_000 - 1750
        assert s_t2["totals"]["charged"] == 1600 and s_t2["totals"]["available"] == 100_000 - 1600
        assert s_p1["totals"]["earned"] == 1568 and s_p2["totals"]["earned"] == 1715
        assert s_ops["totals"]["fees_collected"] == 67
        assert s_t1["totals"]["charged"] + s_t2["totals"]["charged"] == 1568 + 1715 + 67
        assert [line["fee_bps"] for line in s_t1["leases"]] == [200]

        p2.client.withdraw(1715, payout_method(p2.client))
        assert p2.client.statement()["totals"] == {
            "charged_to_tenants": 1750, "fees": 35, "earned": 1715, "withdrawn": 1715, "earnings_balance": 0,
            "held": 0, "held_refunded": 0, "reconciles": True,
        }  # fmt: skip
        assert ops.audit()["ok"]
    assert_audit_ok(market)
    market.store.dispose()
