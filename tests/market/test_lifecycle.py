"""Lease, demand and usage life cycles through the service layer, on both backends: timeouts,
cancellation, early termination, measurement mismatches, contested acknowledgements, and the
transition log that records who did what, when and why."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from runyard.market import deadlines, funds, identity, leases, orders, settlement, usage
from runyard.market import disputes as dispute_ops
from runyard.market.errors import BadRequest, Conflict, InvalidTransition
from runyard.market.models import (
    AcceptIn,
    AckIn,
    ContestIn,
    CreditIn,
    DemandIn,
    EndIn,
    ListingIn,
    MeasurementIn,
    ResolveIn,
    UsageIn,
)
from runyard.market.payloads import lease_terms, measurement, usage_record
from runyard.market.schema import listings, transitions
from runyard.market.signing import generate_keypair, sign
from runyard.market.states import SIDES
from runyard.market.states.demand import DEMAND
from runyard.market.states.dispute import DISPUTE
from runyard.market.states.identity import IDENTITY
from runyard.market.states.lease import CLOSED, LEASE
from runyard.market.states.record import RECORD

from .helpers import FAR, HOUR, assert_audit_ok, open_market


class World:
    def __init__(self, url):
        self.market = open_market(url, fee_bps=0, tolerance_bps=500)
        self.ops = identity.authenticate(self.market, identity.create_operator(self.market, "ops")["token"])
        self.keys, self.tokens, self.count = {}, {}, 0
        for name, role in (("t", "tenant"), ("p", "provider")):
            private, public = generate_keypair()
            self.tokens[name] = identity.register(self.market, name, role, public)["token"]
            self.keys[name] = private
            identity.request_verification(self.market, self.who(name), "")
            identity.decide(self.market, self.ops.actor, name, True, "ok")
        funds.credit(self.market, self.ops, CreditIn(account="t", amount=100_000, reason="seed"), "seed")
        self.listing = orders.create_listing(self.market, self.who("p"), ListingIn(
            accelerator_kind="a100-80gb", devices_per_node=4, node_count=1, region="us", jurisdiction="us",
            price_per_device_hour=3600, available_until=FAR,
        ))  # fmt: skip

    def who(self, name):
        return identity.authenticate(self.market, self.tokens[name])

    def demand(self, devices=2, duration=HOUR, **req):
        body = DemandIn(
            requirement={
                "accelerator_kinds": ["a100-80gb"],
                "device_count": devices,
                "duration_s": duration,
                **req,
            },
            max_price_per_device_hour=3600,
        )
        self.count += 1
        return orders.place_demand(self.market, self.who("t"), body, f"demand-{self.count}")

    def running_lease(self, devices=2):
        lease = leases.get_lease(self.market, self.who("p"), self.demand(devices)["lease_id"])
        leases.accept(
            self.market,
            self.who("p"),
            lease["id"],
            AcceptIn(signature=sign(self.keys["p"], lease_terms(lease, "USD"))),
            f"a{lease['id']}",
        )
        return leases.start(self.market, self.who("p"), lease["id"], f"s{lease['id']}")

    def report(self, lease, seq, start, end, used):
        body = UsageIn(seq=seq, interval_start=start, interval_end=end, device_seconds=used,
                       signature=sign(self.keys["p"], usage_record(lease["id"], seq, start, end, used)))  # fmt: skip
        return usage.report(self.market, self.who("p"), lease["id"], body, f"u{lease['id']}-{seq}")

    def log(self, entity, entity_id):
        def read(conn, now):
            q = select(transitions).where(
                transitions.c.entity == entity, transitions.c.entity_id == entity_id
            )
            return [dict(r) for r in conn.execute(q.order_by(transitions.c.id)).mappings()]

        return self.market.read(read)


@pytest.fixture
def world(store_url):
    w = World(store_url)
    yield w
    assert_audit_ok(w.market)
    w.market.store.dispose()


def test_state_tables_are_closed_and_name_only_known_sides():
    for machine in (LEASE, DEMAND, DISPUTE, RECORD, IDENTITY):
        for (a, b), who in machine.table_of_transitions.items():
            assert a != b and who and who <= set(SIDES)
    assert LEASE.terminal == {"settled", "rejected", "expired", "cancelled"}
    assert set(CLOSED) == LEASE.terminal


def test_an_unaccepted_lease_expires_and_returns_its_escrow(world):
    m = world.market
    lease_id = world.demand()["lease_id"]
    assert world.market.read(lambda c, n: c.execute(select(listings.c.reserved)).scalar()) == 2
    m.advance_clock(901, world.ops.actor)
    with pytest.raises(Conflict, match="accepted by"):
        leases.accept(m, world.who("p"), lease_id, AcceptIn(signature="A" * 86), "late")
    assert deadlines.sweep(m)["expired"] == 1
    lease = leases.get_lease(m, world.who("t"), lease_id)
    assert (
        lease["state"] == "expired" and lease["end_reason"] == "accept_timeout" and lease["refunded"] == 7200
    )
    row = m.read(lambda c, n: dict(c.execute(select(listings)).mappings().one()))
    assert row["reserved"] == 0 and row["leases_expired"] == 1
    assert [(t["from_state"], t["to_state"], t["actor"]) for t in world.log("lease", lease_id)] == [
        (None, "offered", "system"), ("offered", "expired", "system"),
    ]  # fmt: skip
    # The demand is open again with a fresh hold, and is not offered the listing that let it expire.
    demand = orders.get_demand(m, world.who("t"), lease["demand_id"])
    assert (demand["state"], demand["lease_id"]) == ("open", None)
    assert funds.balances(m, world.who("t"))["accounts"][0]["available"] == 100_000 - 7200
    orders.cancel_demand(m, world.who("t"), demand["id"], "give up")
    assert funds.balances(m, world.who("t"))["accounts"][0]["available"] == 100_000


def test_cancel_before_start_and_terminate_after(world):
    m = world.market
    lease_id = world.demand()["lease_id"]
    leases.cancel(
        m, world.who("t"), lease_id, EndIn(reason_code="tenant_request", note="plans changed"), "c1"
    )
    assert leases.get_lease(m, world.who("t"), lease_id)["refunded"] == 7200
    running = world.running_lease()
    with pytest.raises(InvalidTransition):
        leases.cancel(m, world.who("t"), running["id"], EndIn(reason_code="tenant_request"), "c2")
    m.advance_clock(600, world.ops.actor)
    world.report(running, 1, running["started_at"], running["started_at"] + 600, 1200)
    ended = leases.terminate(
        m, world.who("p"), running["id"], EndIn(reason_code="hardware_failure", note="PSU"), "x"
    )
    # The test clock is the real clock plus an offset, so a loaded machine may add a second or two.
    assert ended["state"] == "terminated"
    assert running["started_at"] + 600 <= ended["window_end"] <= running["started_at"] + 610
    log = world.log("lease", running["id"])[-1]
    assert (log["to_state"], log["actor"], log["reason"]) == (
        "terminated",
        f"provider:{world.who('p').id}",
        "hardware_failure: PSU",
    )
    m.advance_clock(601, world.ops.actor)
    deadlines.sweep(m)
    done = leases.get_lease(m, world.who("t"), running["id"])
    # 1200 device-seconds at 3600 per device-hour = 1200; the rest of 7200 comes back.
    assert (done["state"], done["paid_provider"], done["refunded"]) == ("settled", 1200, 6000)


def test_a_demand_expires_when_its_latest_start_passes(world):
    m = world.market
    # The only listing is an a100; this demand wants an l40s, so it waits, and then expires.
    body = DemandIn(
        requirement={"accelerator_kinds": ["l40s"], "latest_start": m.now() + 100},
        max_price_per_device_hour=100,
    )
    demand = orders.place_demand(m, world.who("t"), body, "late")
    assert demand["state"] == "open"
    m.advance_clock(101, world.ops.actor)
    assert deadlines.sweep(m)["demands_expired"] == 1
    assert orders.get_demand(m, world.who("t"), demand["id"])["state"] == "expired"
    assert funds.balances(m, world.who("t"))["accounts"][0]["available"] == 100_000


def test_measurement_mismatch_opens_a_dispute_by_itself(world):
    m = world.market
    lease = world.running_lease()
    t0 = lease["started_at"]
    m.advance_clock(1200, world.ops.actor)

    def measure(start, end, used, key):
        body = MeasurementIn(interval_start=start, interval_end=end, device_seconds=used,
                             signature=sign(world.keys["t"], measurement(lease["id"], start, end, used)))  # fmt: skip
        return usage.submit_measurement(m, world.who("t"), lease["id"], body, key)

    close = world.report(lease, 1, t0, t0 + 600, 1200)
    assert measure(t0, t0 + 600, 1150, "m1")["dispute_id"] is None  # 4% off: within 5%
    assert measure(t0 + 600, t0 + 1200, 600, "m2")["record_id"] is None  # before the provider's record
    far = world.report(lease, 2, t0 + 600, t0 + 1200, 1200)  # the tenant saw half: a dispute opens
    assert far["state"] == "disputed" and close["state"] == "reported"
    opened = dispute_ops.open_disputes(m, world.who("p"))
    assert [(d["record_id"], d["opened_by"], d["claimed_device_seconds"]) for d in opened] == [
        (far["id"], "system", 600)
    ]
    dispute_ops.resolve(m, world.ops, opened[0]["id"], ResolveIn(outcome="upheld", reason="tenant logs agree"), "r")
    assert usage.lease_usage(m, world.who("t"), lease["id"])["disputes"][0]["resolved_device_seconds"] == 600
    # The decided dispute takes its record out of `disputed`, holding the outcome.
    record = usage.lease_usage(m, world.who("t"), lease["id"])["records"][1]
    assert (record["state"], record["acked_device_seconds"]) == ("resolved", 600)
    # A measurement that arrives after a record's dispute window is refused: the record stands.
    m.advance_clock(400, world.ops.actor)
    late = world.report(lease, 3, t0 + 1200, t0 + 1500, 600)
    m.advance_clock(601, world.ops.actor)
    with pytest.raises(Conflict, match="too late"):
        measure(t0 + 1200, t0 + 1500, 10, "m3")
    assert (
        usage.lease_usage(m, world.who("t"), lease["id"])["records"][2]["state"]
        == late["state"]
        == "reported"
    )


def test_provider_contests_a_partial_acknowledgement(world):
    m = world.market
    lease = world.running_lease()
    m.advance_clock(HOUR, world.ops.actor)
    record = world.report(lease, 1, lease["started_at"], lease["started_at"] + HOUR, 2 * HOUR)
    usage.acknowledge(m, world.who("t"), record["id"], AckIn(accepted_device_seconds=HOUR), "ack")
    dispute = dispute_ops.contest(
        m, world.who("p"), record["id"], ContestIn(reason="both devices were busy"), "contest"
    )
    assert (dispute["opener_side"], dispute["claimed_device_seconds"], dispute["counter_device_seconds"]) == (
        "provider",
        2 * HOUR,
        HOUR,
    )
    m.advance_clock(700, world.ops.actor)
    assert settlement.settle(m, world.who("t"), lease["id"], "s1")["held_device_seconds"] == 2 * HOUR
    with pytest.raises(BadRequest, match="between 3600 and 7200"):
        dispute_ops.resolve(
            m, world.ops, dispute["id"], ResolveIn(outcome="partial", device_seconds=1, reason="x"), "r0"
        )
    dispute_ops.resolve(m, world.ops, dispute["id"], ResolveIn(outcome="rejected", reason="ack stands"), "r1")
    done = leases.get_lease(m, world.who("t"), lease["id"])
    assert (done["state"], done["paid_provider"], done["refunded"]) == ("settled", 3600, 3600)
    kinds = [t["to_state"] for t in world.log("dispute", dispute["id"])]
    assert kinds == ["open", "rejected"]


def test_usage_sequence_numbers_are_consecutive(world):
    w = world
    lease = w.running_lease()
    start = lease["started_at"]
    w.market.advance_clock(600, w.ops.actor)
    w.report(lease, 1, start, start + 60, 60)
    for seq, needle in ((3, "skips seq 2"), (7, "skips seq 2"), (1, "not above")):
        body = UsageIn(seq=seq, interval_start=start + 60, interval_end=start + 120, device_seconds=60,
                       signature=sign(w.keys["p"], usage_record(lease["id"], seq, start + 60, start + 120, 60)))
        with pytest.raises(Conflict) as err:
            usage.report(w.market, w.who("p"), lease["id"], body, f"gap-{seq}")
        assert err.value.code == "usage_rejected" and needle in err.value.message, err.value.message
        assert err.value.detail == {"expected_seq": 2}
    w.report(lease, 2, start + 60, start + 120, 60)
    assert [r["seq"] for r in usage.lease_usage(w.market, w.who("t"), lease["id"])["records"]] == [1, 2]
