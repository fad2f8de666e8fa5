"""Settlement that cannot be blocked, and capacity that is never lost, through the service layer on
both backends: a dispute claims at most what its record reported; a lease that cannot settle is
reported and skipped while the rest settle; every release of capacity re-matches waiting demands;
a demand whose lease failed returns to open (or is cancelled with its tenant's lease)."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from runyard.market import deadlines, leases, orders, settlement, usage
from runyard.market import disputes as dispute_ops
from runyard.market.errors import BadRequest, EscrowShort
from runyard.market.models import AcceptIn, DisputeIn, EndIn, ListingIn, MeasurementIn, ResolveIn
from runyard.market.payloads import lease_terms, measurement
from runyard.market.schema import usage_records
from runyard.market.signing import sign

from .helpers import FAR, HOUR, assert_audit_ok
from .test_lifecycle import World


@pytest.fixture
def world(store_url):
    w = World(store_url)
    yield w
    w.market.store.dispose()


def test_a_dispute_claims_at_most_what_the_record_reported(world):
    m = world.market
    lease = world.running_lease()
    t0 = lease["started_at"]
    m.advance_clock(600, world.ops.actor)
    record = world.report(lease, 1, t0, t0 + 600, 600)
    # The tenant says it saw far more than reported: that is no dispute (it is billed what was reported).
    huge = 2**40
    body = MeasurementIn(interval_start=t0, interval_end=t0 + 600, device_seconds=huge,
                         signature=sign(world.keys["t"], measurement(lease["id"], t0, t0 + 600, huge)))  # fmt: skip
    assert usage.submit_measurement(m, world.who("t"), lease["id"], body, "m1")["dispute_id"] is None
    with pytest.raises(BadRequest, match="fewer device-seconds"):
        dispute_ops.dispute(m, world.who("t"), record["id"], DisputeIn(reason="x", claimed_device_seconds=10**9), "d0")
    dispute = dispute_ops.dispute(m, world.who("t"), record["id"], DisputeIn(reason="idle", claimed_device_seconds=100), "d1")
    dispute_ops.resolve(m, world.ops, dispute["id"], ResolveIn(outcome="upheld", reason="logs"), "r1")
    m.advance_clock(HOUR + 700, world.ops.actor)
    assert deadlines.sweep(m)["failed"] == []
    done = leases.get_lease(m, world.who("t"), lease["id"])
    assert (done["state"], done["paid_provider"]) == ("settled", 100)
    assert_audit_ok(m)


def test_a_lease_that_cannot_settle_is_reported_and_the_rest_settle(world):
    m = world.market
    bad, good = world.running_lease(), world.running_lease()
    m.advance_clock(600, world.ops.actor)
    for lease in (bad, good):
        world.report(lease, 1, lease["started_at"], lease["started_at"] + 600, 600)
    # Break one lease's record behind the market's back: it now claims more than its escrow holds.
    m.store.write(lambda c: c.execute(update(usage_records).where(usage_records.c.lease_id == bad["id"])
                                      .values(device_seconds=10**9)))  # fmt: skip
    m.advance_clock(HOUR + 700, world.ops.actor)
    for _ in range(2):  # and again on the next sweep: it never blocks the others
        result = deadlines.sweep(m)
        assert [(f["lease_id"], f["error"]) for f in result["failed"]] == [(bad["id"], "escrow_short")]
    assert leases.get_lease(m, world.who("t"), good["id"])["state"] == "settled"
    assert leases.get_lease(m, world.who("t"), bad["id"])["state"] == "window_closed"
    with pytest.raises(EscrowShort, match="escrow"):
        settlement.settle(m, world.who("t"), bad["id"], "s")


def test_every_release_of_capacity_rematches_waiting_demands(world):
    m = world.market  # the listing has 4 devices
    first = world.running_lease(devices=4)
    waiting = world.demand(devices=4)
    assert waiting["state"] == "open"
    leases.terminate(m, world.who("p"), first["id"], EndIn(reason_code="hardware_failure"), "t1")
    second = orders.get_demand(m, world.who("t"), waiting["id"])
    assert second["state"] == "matched"  # the terminated lease's devices went to the waiting demand
    third = world.demand(devices=4)
    assert third["state"] == "open"
    lease = leases.get_lease(m, world.who("p"), second["lease_id"])
    leases.cancel(m, world.who("t"), lease["id"], EndIn(reason_code="tenant_request"), "c1")
    assert orders.get_demand(m, world.who("t"), second["id"])["state"] == "cancelled"  # the tenant's choice
    assert orders.get_demand(m, world.who("t"), third["id"])["state"] == "matched"
    # A window that closes frees its devices too.
    lease = leases.get_lease(m, world.who("p"), orders.get_demand(m, world.who("t"), third["id"])["lease_id"])
    accept_and_start(world, lease)
    fourth = world.demand(devices=4)
    m.advance_clock(HOUR + 1, world.ops.actor)
    deadlines.sweep(m)
    assert orders.get_demand(m, world.who("t"), fourth["id"])["state"] == "matched"
    assert_audit_ok(m)


def test_a_demand_whose_lease_was_rejected_reopens_and_matches_elsewhere(world):
    m = world.market
    demand = world.demand(devices=2)
    leases.reject(m, world.who("p"), demand["lease_id"], EndIn(reason_code="capacity_unavailable"), "r1")
    again = orders.get_demand(m, world.who("t"), demand["id"])
    assert (again["state"], again["lease_id"]) == ("open", None)  # not offered the same listing again
    other = orders.create_listing(m, world.who("p"), ListingIn(
        accelerator_kind="a100-80gb", devices_per_node=2, node_count=1, region="us", jurisdiction="us",
        price_per_device_hour=3000, available_until=FAR,
    ))  # fmt: skip
    matched = orders.get_demand(m, world.who("t"), demand["id"])
    lease = leases.get_lease(m, world.who("t"), matched["lease_id"])
    assert matched["state"] == "matched" and lease["listing_id"] == other["id"] and lease["escrow_amount"] == 6000
    assert_audit_ok(m)


def accept_and_start(world, lease):
    signature = sign(world.keys["p"], lease_terms(lease, "USD"))
    leases.accept(world.market, world.who("p"), lease["id"], AcceptIn(signature=signature), f"a{lease['id']}")
    leases.start(world.market, world.who("p"), lease["id"], f"s{lease['id']}")
