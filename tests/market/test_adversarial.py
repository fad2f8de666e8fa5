"""Attacks and mistakes over real HTTP, on both backends. Each refused request must answer a clear
4xx and change nothing (the store's fingerprint is the same before and after)."""

from __future__ import annotations

import httpx
import pytest

from runyard.market.client import MarketClient, MarketClientError
from runyard.market.payloads import usage_record
from runyard.market.server import ServerThread
from runyard.market.signing import generate_keypair, sign

from .helpers import (
    HOUR,
    assert_audit_ok,
    fingerprint,
    listing,
    new_party,
    open_market,
    operator_client,
    payout_method,
    requirement,
)


@pytest.fixture
def world(store_url):
    """A server with an operator, two verified providers and two funded, verified tenants, and one
    running lease (tenant one on provider one) an hour into its window."""
    market = open_market(store_url)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        p1, p2 = (new_party(server.url, n, "provider", ops) for n in ("p-one", "p-two"))
        t1, t2 = (new_party(server.url, n, "tenant", ops) for n in ("t-one", "t-two"))
        for t in (t1, t2):
            ops.credit(t.name, 50_000, "opening balance")
        p1.client.create_listing(**listing(price_per_device_hour=300))
        lease_id = t1.client.place_demand(requirement(), 300)["lease_id"]
        p1.client.accept_lease(lease_id)
        started = p1.client.start_lease(lease_id)["started_at"]
        ops.advance_clock(HOUR)
        yield {
            "market": market, "server": server, "ops": ops, "p1": p1.client, "p2": p2.client,
            "t1": t1.client, "t2": t2.client, "lease": lease_id, "start": started,
        }  # fmt: skip
    assert_audit_ok(market)
    market.store.dispose()


def refused(world, status: int, code: str | None, call) -> MarketClientError:
    """Run `call`, expect a MarketClientError with `status` (and `code`), and no change to the store."""
    before = fingerprint(world["market"])
    with pytest.raises(MarketClientError) as err:
        call()
    assert err.value.status == status, err.value
    if code:
        assert err.value.code == code, err.value
    assert err.value.message
    assert fingerprint(world["market"]) == before
    return err.value


def test_forged_replayed_and_malformed_usage(world):
    p1, lease, t0 = world["p1"], world["lease"], world["start"]
    # Forged: signed with a key that is not the provider's.
    forger = MarketClient(world["server"].url, token=p1.token, private_key=generate_keypair()[0])
    err = refused(world, 422, "signature_invalid", lambda: forger.report_usage(lease, 1, t0, t0 + 600, 2400))
    assert "does not verify" in err.message
    # Tampered: a valid signature over other numbers.
    body = {
        "seq": 1,
        "interval_start": t0,
        "interval_end": t0 + 600,
        "device_seconds": 2400,
        "evidence": None,
    }
    body["signature"] = sign(p1.private_key, usage_record(lease, 1, t0, t0 + 600, 1200))
    refused(
        world,
        422,
        "signature_invalid",
        lambda: p1.request("POST", f"/v1/leases/{lease}/usage", body, key="k1"),
    )
    # Malformed signatures.
    for bad in ("!" * 86, "A" * 80):
        refused(
            world,
            422,
            None,
            lambda b=bad: p1.request("POST", f"/v1/leases/{lease}/usage", {**body, "signature": b}, key="k2"),
        )
    # A valid record goes in once; a retry with its key returns the same record; a replay is refused.
    first = p1.report_usage(lease, 1, t0, t0 + 600, 2400, idempotency_key="rec-1")
    assert p1.report_usage(lease, 1, t0, t0 + 600, 2400, idempotency_key="rec-1")["id"] == first["id"]
    err = refused(world, 409, "usage_rejected", lambda: p1.report_usage(lease, 1, t0, t0 + 600, 2400))
    assert "replay" in err.message
    refused(
        world, 409, "usage_rejected", lambda: p1.report_usage(lease, 2, t0 + 300, t0 + 900, 100)
    )  # overlaps
    refused(
        world, 409, "usage_rejected", lambda: p1.report_usage(lease, 2, t0 - 600, t0, 100)
    )  # before start
    refused(world, 409, "usage_rejected", lambda: p1.report_usage(lease, 2, t0 + 600, t0 + 2 * HOUR + 1, 100))
    refused(
        world, 409, "usage_rejected", lambda: p1.report_usage(lease, 2, t0 + 600, t0 + HOUR + 60, 100)
    )  # future
    refused(
        world, 422, "invalid_request", lambda: p1.report_usage(lease, 2, t0 + 600, t0 + 1200, 4 * 600 + 1)
    )
    refused(world, 422, "invalid_request", lambda: p1.report_usage(lease, 2, t0 + 1200, t0 + 600, 1))
    # Another provider's key and token cannot report on this lease.
    refused(world, 404, "not_found", lambda: world["p2"].report_usage(lease, 2, t0 + 600, t0 + 1200, 100))
    # A usage signature is not a lease acceptance (every payload carries its type).
    offered = world["t2"].place_demand(requirement(), 300)["lease_id"]
    sig = sign(p1.private_key, usage_record(offered, 9, t0, t0 + 1, 0))
    accept = f"/v1/leases/{offered}/accept"
    refused(world, 422, "signature_invalid", lambda: p1.request("POST", accept, {"signature": sig}, key="x"))
    refused(world, 409, "invalid_transition", lambda: p1.accept_lease(lease))  # already running


def test_cross_tenant_and_cross_provider_access(world):
    t1, t2, p1, p2, lease = world["t1"], world["t2"], world["p1"], world["p2"], world["lease"]
    demand_id = t1.demands()[0]["id"]
    record = p1.report_usage(lease, 1, world["start"], world["start"] + 600, 2400)
    refused(world, 404, "not_found", lambda: t2.lease(lease))
    refused(world, 404, "not_found", lambda: t2.demand(demand_id))
    refused(world, 404, "not_found", lambda: t2.usage(lease))
    refused(world, 404, "not_found", lambda: p2.lease(lease))
    refused(world, 404, "not_found", lambda: t2.cancel_demand(demand_id))
    refused(world, 404, "not_found", lambda: t2.acknowledge(record["id"]))
    refused(world, 404, "not_found", lambda: t2.dispute(record["id"], "not mine"))
    refused(world, 404, "not_found", lambda: t2.terminate_lease(lease, "tenant_request"))
    refused(world, 404, "not_found", lambda: t2.settle(lease))
    refused(world, 404, "not_found", lambda: p2.start_lease(lease))
    assert t2.leases() == [] and t2.demands() == [] and p2.leases() == []
    assert t2.statement()["entries"][0]["reason"] == "operator_credit" and len(t2.statement()["entries"]) == 1
    assert all(x["provider_id"] == p2.me()["id"] for x in p2.listings()) and p2.listings() == []
    # Roles: a provider cannot demand, a tenant cannot list, nobody but an operator credits or administers.
    refused(world, 403, "forbidden", lambda: p1.credit("p-one", 100, "money from nowhere"))
    refused(world, 403, "forbidden", lambda: t1.credit("t-one", 100, "money from nowhere"))
    refused(world, 403, "forbidden", lambda: p1.place_demand(requirement(), 300))
    refused(world, 403, "forbidden", lambda: t1.create_listing(**listing()))
    refused(world, 403, "forbidden", lambda: t1.decide("t-two", False, "spite"))
    refused(world, 403, "forbidden", lambda: p1.audit())
    refused(world, 403, "forbidden", lambda: t1.advance_clock(10))
    # No token or a wrong one.
    anon = MarketClient(world["server"].url)
    refused(world, 401, "unauthenticated", lambda: anon.leases())
    refused(
        world,
        401,
        "unauthenticated",
        lambda: MarketClient(world["server"].url, token="ryk_guess").statement(),
    )


def test_unverified_or_revoked_parties_never_match(world):
    ops, t2, p2 = world["ops"], world["t2"], world["p2"]
    p2.create_listing(**listing(accelerator_kind="l40s", price_per_device_hour=100))
    ops.decide("p-two", False, "licence withdrawn")  # verified -> rejected
    demand = t2.place_demand(requirement(accelerator_kinds=["l40s"]), 200)
    assert demand["state"] == "open"  # the only fitting listing belongs to a revoked provider
    refused(world, 403, "not_verified", lambda: p2.create_listing(**listing()))
    # An unverified newcomer cannot demand at all.
    newcomer = new_party(world["server"].url, "t-new", "tenant")
    refused(world, 403, "not_verified", lambda: newcomer.client.place_demand(requirement(), 300))
    # Verified again, the provider's listing matches the waiting demand.
    p2.request_verification("renewed licence")
    ops.decide("p-two", True, "licence renewed")
    assert t2.demand(demand["id"])["state"] == "matched"


def test_overdraft_and_double_settlement(world):
    t1, t2, p1, ops, lease, t0 = (
        world["t1"],
        world["t2"],
        world["p1"],
        world["ops"],
        world["lease"],
        world["start"],
    )
    err = refused(
        world, 409, "insufficient_funds", lambda: t2.place_demand(requirement(duration_s=100 * HOUR), 300)
    )
    assert "available" in err.message
    available = t1.balances()["accounts"][0]["available"]
    to_t1, to_p1 = payout_method(t1), payout_method(p1)
    refused(
        world, 409, "insufficient_funds", lambda: t1.withdraw(available + 1, to_t1)
    )  # escrow is not withdrawable
    refused(world, 409, "insufficient_funds", lambda: p1.withdraw(1, to_p1))  # earned nothing yet
    refused(world, 404, "not_found", lambda: p1.withdraw(1, to_t1))  # someone else's payout method
    refused(world, 409, "invalid_transition", lambda: t1.settle(lease))  # still running
    p1.report_usage(lease, 1, t0, t0 + HOUR, 4 * HOUR)
    ops.advance_clock(2 * HOUR)
    ops.sweep()
    settled = t1.lease(lease)
    assert settled["state"] == "settled" and settled["paid_provider"] == 1200 and settled["refunded"] == 1200
    before = fingerprint(world["market"])
    for _ in range(2):
        assert t1.settle(lease)["moved_now"] == 0
        assert p1.settle(lease)["moved_now"] == 0
        ops.sweep()
    after = fingerprint(world["market"])
    assert after["ledger"] == before["ledger"]  # idempotency keys were stored, but no money moved
    assert p1.statement()["totals"]["earned"] == 1200


def test_idempotency_keys(world):
    t1 = world["t1"]
    to_t1 = payout_method(t1)
    first = t1.withdraw(700, to_t1, idempotency_key="wd-1")
    again = t1.withdraw(700, to_t1, idempotency_key="wd-1")
    assert again == first
    err = refused(world, 409, "idempotency_key_reused", lambda: t1.withdraw(701, to_t1, idempotency_key="wd-1"))
    assert "wd-1" in err.message
    refused(world, 409, "idempotency_key_reused", lambda: t1.cancel_demand(1, idempotency_key="wd-1"))
    # Keys belong to an account: another tenant may use the same string.
    world["t2"].withdraw(5, payout_method(world["t2"]), idempotency_key="wd-1")
    assert t1.statement()["totals"]["withdrawn"] == 700
    # Money-moving routes refuse to run without a key.
    err = refused(
        world, 422, "invalid_request", lambda: t1.request("POST", "/v1/funds/withdraw", {"amount": 5, "payout_method_id": to_t1})
    )
    assert "Idempotency-Key" in err.message


def test_bad_input_gets_clear_4xx(world):
    t1, p1, ops, url = world["t1"], world["p1"], world["ops"], world["server"].url
    cases = [
        (lambda: ops.credit("t-one", -5, "x"), "amount"),
        (lambda: ops.credit("t-one", 0, "x"), "amount"),
        (lambda: ops.credit("t-one", 10**20, "x"), "amount"),
        (lambda: ops.request("POST", "/v1/admin/credit", {"account": "t-one", "amount": "12", "reason": "x"}, key="s"), "amount"),
        (lambda: ops.request("POST", "/v1/admin/credit", {"account": "t-one", "amount": 1.5, "reason": "x"}, key="f"), "amount"),
        (
            lambda: t1.place_demand(requirement(accelerator_kinds=["h100-8gb"]), 300),
            "unknown accelerator kind",
        ),
        (lambda: t1.place_demand(requirement(device_count=0), 300), "device_count"),
        (lambda: t1.place_demand(requirement(), -1), "max_price_per_device_hour"),
        (lambda: t1.place_demand({**requirement(), "colour": "red"}, 300), "colour"),
        (lambda: p1.create_listing(**listing(accelerator_kind="tpu-v9")), "accelerator_kind"),
        (lambda: p1.create_listing(**listing(available_from=2000, available_until=1000)), "available_until"),
        (lambda: p1.create_listing(**listing(start_class="queued")), "max_queue_s"),
        (lambda: p1.create_listing(**listing(price_per_device_hour=0)), "price_per_device_hour"),
        (lambda: p1.create_listing(**listing(interconnect="carrier-pigeon")), "interconnect"),
    ]
    for call, needle in cases:
        err = refused(world, 422, "invalid_request", call)
        assert needle in err.message, (needle, err.message)
    # Oversized bodies are refused before they are read.
    before = fingerprint(world["market"])
    big = {"evidence": "x" * 200_000}
    response = httpx.post(
        f"{url}/v1/accounts/me/verification", json=big, headers={"Authorization": f"Bearer {t1.token}"}
    )
    assert response.status_code == 413 and response.json()["error"] == "payload_too_large"
    response = httpx.post(f"{url}/v1/accounts", content=b"{" + b" " * 100_000 + b"}",
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 413
    response = httpx.post(
        f"{url}/v1/accounts", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422 and response.json()["message"]
    assert fingerprint(world["market"]) == before
    assert httpx.get(f"{url}/openapi.json").json()["info"]["title"] == "runyard market"
