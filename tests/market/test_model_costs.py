"""`model_costs` over real HTTP, on SQLite and PostgreSQL: two training leases (block, job spec named
`tiny`) and a standing lease serving `tiny` for three settled periods; the report equals the sum of
the leases' settlements to the minor unit, per period and per lineage, says when cumulative serving
passed training, and another tenant sees none of it."""

from __future__ import annotations

import pytest

from runyard.market.client import MarketClientError
from runyard.market.server import ServerThread
from runyard.market.serving import deployment_body

from .helpers import assert_audit_ok, listing, new_party, open_market, operator_client

HOUR = 3600
PERIOD = 600
PRICE = 3600  # per device-hour: one minor unit per device-second
JOB = {"spec": "name: tiny\nseed: 7\ntrain:\n  steps: 3\n", "results_to": "/srv/results/tiny"}


@pytest.fixture
def world(store_url):
    market = open_market(store_url, fee_bps=200, dispute_window_s=100)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        provider = new_party(server.url, "farm", "provider", ops)
        tenant = new_party(server.url, "lab", "tenant", ops)
        other = new_party(server.url, "rival", "tenant", ops)
        ops.credit("lab", 1_000_000, "seed")
        ops.credit("rival", 1_000_000, "seed")
        yield {"market": market, "ops": ops, "p": provider.client, "t": tenant.client, "o": other.client}
    market.store.dispose()


def _train(world, device_seconds: int) -> int:
    """One block lease of 1 device for 300 s running JOB, `device_seconds` reported, settled."""
    p, t, ops = world["p"], world["t"], world["ops"]
    demand = t.place_demand({"accelerator_kinds": ["h100-80gb"], "device_count": 1, "duration_s": 300},
                            PRICE, job=JOB)
    lid = demand["lease_id"]
    p.accept_lease(lid)
    start = p.start_lease(lid)["started_at"]
    ops.advance_clock(300)
    p.report_usage(lid, 1, start, start + 300, device_seconds)
    ops.sweep()  # the window closes
    ops.advance_clock(101)  # past the dispute window
    ops.sweep()
    settled = t.settle(lid)
    assert settled["state"] == "settled", settled
    return lid


def test_costs_per_model_equal_the_settlements_and_stay_private(world):
    p, t, o, ops, market = world["p"], world["t"], world["o"], world["ops"], world["market"]
    p.create_listing(**listing(accelerator_kind="h100-80gb", devices_per_node=1, price_per_device_hour=PRICE))
    p.create_listing(**listing(form="standing", accelerator_kind="l4", price_per_device_hour=PRICE, memory_gib=24,
                               standing={"period_s": PERIOD, "availability_bps": 9950, "notice_s": 300,
                                         "credits": [{"below_bps": 9950, "credit_bps": 1000}]}))
    train_ids = [_train(world, 300), _train(world, 200)]
    # The rival trains too (an unnamed job): it must not appear in lab's report.
    o.place_demand({"accelerator_kinds": ["h100-80gb"], "device_count": 1, "duration_s": 300}, PRICE)

    deployment, _ = deployment_body(files={"model.pt": "AAAA"}, serve={"model_name": "tiny"})
    demand = t.place_demand({"accelerator_kinds": ["l4"], "device_count": 1}, PRICE, form="standing",
                            standing={"period_s": PERIOD, "term_periods": 1}, deployment=deployment)
    sid = demand["lease_id"]
    p.accept_lease(sid)
    s0 = p.start_lease(sid)["started_at"]
    # Three periods: fully up, 540 of 600 s (a credit), fully up; each renews and then settles.
    for seq, up in enumerate((PERIOD, 540, PERIOD), start=1):
        start = s0 + (seq - 1) * PERIOD
        ops.advance_clock(PERIOD)
        p.report_availability(sid, seq, start, start + PERIOD, up, probes=10, probes_ok=10)
        ops.sweep()
    ops.advance_clock(101)
    ops.sweep()

    report = t.model_costs()
    assert [m["model"] for m in report["models"]] == ["tiny"]
    tiny = report["models"][0]
    # Training: each lease's settlement, to the minor unit.
    assert [line["lease_id"] for line in tiny["training"]] == train_ids
    for line in tiny["training"]:
        lease = t.lease(line["lease_id"])
        assert line["charged"] == lease["paid_provider"] + lease["paid_fee"] > 0
        assert (line["paid_provider"], line["fee"], line["refunded"]) == \
            (lease["paid_provider"], lease["paid_fee"], lease["refunded"])
    training = sum(t.lease(i)["paid_provider"] + t.lease(i)["paid_fee"] for i in train_ids)
    assert tiny["training_charged"] == training == 500  # 300 + 200 device-seconds at 1 per second
    # Serving: per period, equal to the periods the market settled.
    (serving,) = tiny["serving"]
    periods = t.lease_periods(sid)
    settled = [q for q in periods if q["state"] == "settled"]
    assert len(settled) == 3
    assert [(q["seq"], q["charged"], q["credit"]) for q in serving["periods"]] == \
        [(q["seq"], q["paid_provider"] + q["paid_fee"], q["credit"] or 0) for q in periods]
    lease = t.lease(sid)
    assert serving["charged"] == lease["paid_provider"] + lease["paid_fee"] == \
        sum(q["paid_provider"] + q["paid_fee"] for q in periods) == tiny["serving_charged"]
    assert serving["credited"] == lease["credited"] > 0
    assert tiny["charged"] == training + serving["charged"] == report["charged"]
    # The report agrees with the statement: everything lab was charged.
    assert report["charged"] == t.statement()["totals"]["charged"]
    # Serving (600 + 540 - credit + 600 per period) passed training (500) at the first period's end.
    assert serving["periods"][0]["charged"] > training
    assert tiny["serving_passed_training_at"] == serving["periods"][0]["period_end"] == s0 + PERIOD

    # The other tenant sees nothing of lab's; a provider has no model costs.
    rival = o.model_costs()
    assert rival["tenant_id"] != report["tenant_id"]
    assert all(line["lease_id"] not in train_ids + [sid] for m in rival["models"]
               for line in m["training"] + m["serving"])
    assert rival["charged"] == 0
    with pytest.raises(MarketClientError) as refused:
        p.model_costs()
    assert refused.value.status == 403
    assert_audit_ok(market)
