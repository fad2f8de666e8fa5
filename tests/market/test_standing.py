"""Standing allocations over real HTTP, on SQLite and PostgreSQL: the two forms never meet, a standing
lease escrows its committed term (at the reserved discount), runs billing period after period, and each
period settles to the minor unit from its availability records -- paid for the time available, the
tenant credited under the listing's rule, the rest returned -- with renewal funded from the tenant's
balance or the lease ended at the period's close (nonpayment, notice), and the audit holding after
every step. Bad input is refused with the reason and changes nothing."""

from __future__ import annotations

import pytest

from runyard.market.client import MarketClientError
from runyard.market.server import ServerThread
from runyard.market.serving import deployment_body
from runyard.market.standing import period_figures

from .helpers import assert_audit_ok, fingerprint, listing, new_party, open_market, operator_client

PERIOD = 600
PRICE = 3600  # per device-hour: one minor unit per device-second
CREDITS = [{"below_bps": 9950, "credit_bps": 1000}, {"below_bps": 9500, "credit_bps": 3000}]


def standing_listing(**overrides) -> dict:
    terms = {"period_s": PERIOD, "availability_bps": 9950, "credits": CREDITS, "notice_s": 300,
             "reserved": [{"periods": 3, "discount_bps": 2000}]}
    terms.update(overrides.pop("standing", {}))
    return listing(form="standing", standing=terms, accelerator_kind="l4", price_per_device_hour=PRICE,
                   memory_gib=24, **overrides)


def standing_need(devices: int = 2, **overrides) -> dict:
    return {"accelerator_kinds": ["l4"], "device_count": devices, **overrides}


@pytest.fixture
def world(store_url):
    market = open_market(store_url, fee_bps=200, dispute_window_s=100)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        provider = new_party(server.url, "farm", "provider", ops)
        tenant = new_party(server.url, "lab", "tenant", ops)
        ops.credit("lab", 100_000, "seed")
        yield {"market": market, "ops": ops, "p": provider.client, "t": tenant.client}
    market.store.dispose()


def _running(world, term: int = 1, devices: int = 2) -> dict:
    p, t = world["p"], world["t"]
    demand = t.place_demand(standing_need(devices), PRICE, form="standing",
                            standing={"period_s": PERIOD, "term_periods": term})
    assert demand["state"] == "matched", demand
    p.accept_lease(demand["lease_id"])
    return p.start_lease(demand["lease_id"])


def test_the_two_forms_never_meet(world):
    p, t = world["p"], world["t"]
    p.create_listing(**listing(accelerator_kind="l4", price_per_device_hour=PRICE))  # a block listing
    standing = t.place_demand(standing_need(), PRICE, form="standing", standing={"period_s": PERIOD})
    assert standing["state"] == "open" and standing["form"] == "standing"  # the block listing is not for it
    block = t.place_demand({"accelerator_kinds": ["l4"], "device_count": 2, "duration_s": 3600}, PRICE)
    assert block["state"] == "matched" and t.lease(block["lease_id"])["form"] == "block"
    made = p.create_listing(**standing_listing())
    assert made["form"] == "standing" and made["standing"]["credits"] == CREDITS
    standing = t.demand(standing["id"])
    lease = t.lease(standing["lease_id"])
    assert (lease["form"], lease["listing_id"], lease["period_s"]) == ("standing", made["id"], PERIOD)
    assert lease["terms"]["type"] == "runyard.market.standing_lease_acceptance.v1"
    # A standing demand for another period, more memory or a stronger commitment waits.
    for extra in ({"period_s": 3600}, {"period_s": PERIOD, "min_memory_gib": 80},
                  {"period_s": PERIOD, "min_availability_bps": 9990}):
        assert t.place_demand(standing_need(), PRICE, form="standing", standing=extra)["state"] == "open"
    assert_audit_ok(world["market"])


def test_the_committed_term_is_escrowed_at_the_reserved_discount(world):
    p, t = world["p"], world["t"]
    p.create_listing(**standing_listing())
    before = t.balances()["accounts"][0]["available"]
    lease = _running(world, term=3)
    base = PRICE * 2 * PERIOD // 3600  # two devices for one period
    assert (lease["renewal_price"], lease["discount_bps"], lease["period_price"]) == (base, 2000, base * 8 // 10)
    assert lease["escrow_amount"] == 3 * lease["period_price"]
    assert t.balances()["accounts"][0]["available"] == before - lease["escrow_amount"]
    # A one-period commitment earns no discount.
    short = t.place_demand(standing_need(1), PRICE, form="standing", standing={"period_s": PERIOD})
    assert t.lease(short["lease_id"])["discount_bps"] == 0
    assert_audit_ok(world["market"])


def test_a_period_settles_to_the_minor_unit_and_the_lease_renews(world):
    p, t, ops, market = world["p"], world["t"], world["ops"], world["market"]
    p.create_listing(**standing_listing())
    lease = _running(world, term=1)
    lid, s0 = lease["id"], lease["started_at"]
    ops.advance_clock(PERIOD)
    # Two records in the period: up for all of the first half, 240 of 300 s of the second.
    p.report_availability(lid, 1, s0, s0 + 300, 300, probes=30, probes_ok=30, requests=120, latency_p50_ms=12,
                          latency_p99_ms=40)
    p.report_availability(lid, 2, s0 + 300, s0 + PERIOD, 240, probes=30, probes_ok=24, requests=90)
    before = t.balances()["accounts"][0]["available"]
    ops.sweep()  # the period's end passed: it closes and the lease renews (funded from the balance)
    lease = t.lease(lid)
    assert lease["state"] == "running" and lease["window_end"] == s0 + 2 * PERIOD
    assert lease["escrow_amount"] == 2 * lease["period_price"]
    assert t.balances()["accounts"][0]["available"] == before - lease["renewal_price"]
    first, second = t.lease_periods(lid)
    assert (first["state"], first["funding"], second["state"], second["funding"]) == \
        ("closed", "prepaid", "running", "renewal")
    ops.advance_clock(101)  # past the dispute window: silence is consent
    ops.sweep()
    first = t.lease_periods(lid)[0]
    want = period_figures(lease["period_price"], 2, PERIOD, PERIOD, 540 * 2, 9950, CREDITS, 200)
    assert want.availability_bps == 9000 and want.credit == want.charge * 3000 // 10_000  # the 95% tier
    assert (first["state"], first["charge"], first["credit"], first["paid_provider"], first["paid_fee"],
            first["refunded"]) == ("settled", want.charge, want.credit, want.provider, want.fee, want.refund)
    assert want.charge == lease["period_price"] * 540 // PERIOD
    lease = t.lease(lid)
    assert (lease["paid_provider"], lease["paid_fee"], lease["credited"]) == (want.provider, want.fee, want.credit)
    statement = t.statement()
    assert statement["totals"]["reconciles"]
    assert sum(e["amount"] for e in statement["entries"] if e["reason"] == "sla_credit") == want.credit
    assert_audit_ok(market)


def test_a_renewal_the_tenant_cannot_fund_ends_the_lease_at_the_close(world):
    p, t, ops, market = world["p"], world["t"], world["ops"], world["market"]
    p.create_listing(**standing_listing())
    lease = _running(world, term=1)
    method = t.add_payout_method(rail="test", destination="bank")["id"]
    t.withdraw(t.balances()["accounts"][0]["available"], method)  # nothing left for the next period
    ops.advance_clock(PERIOD)
    p.report_availability(lease["id"], 1, lease["started_at"], lease["started_at"] + PERIOD, PERIOD, 60, 60, 10)
    ops.sweep()
    ended = t.lease(lease["id"])
    assert (ended["state"], ended["end_reason"]) == ("window_closed", "nonpayment")
    assert p.listings(mine=True)[0]["reserved"] == 0  # its devices are free again
    ops.advance_clock(101)
    ops.sweep()
    settled = t.lease(lease["id"])
    assert settled["state"] == "settled"
    assert settled["paid_provider"] + settled["paid_fee"] == lease["period_price"]  # fully available
    assert settled["refunded"] == 0 and settled["credited"] == 0
    assert_audit_ok(market)


def test_a_period_without_any_availability_record_is_not_renewed(world):
    """The rule (periods._why_it_ends): after the committed term, a period in which the provider reported
    no availability at all ends the lease at its close (`no_availability`); no renewal is funded, so a
    silent provider never keeps the tenant's money locked period after period. Inside the term the
    periods are prepaid and run on."""
    p, t, ops, market = world["p"], world["t"], world["ops"], world["market"]
    p.create_listing(**standing_listing())
    lease = _running(world, term=2)
    before = t.balances()["accounts"][0]["available"]
    ops.advance_clock(PERIOD)
    ops.sweep()  # period 1 had no record, but period 2 is committed (prepaid): it runs
    assert t.lease(lease["id"])["state"] == "running"
    ops.advance_clock(PERIOD)
    ops.sweep()  # period 2 closes silent: no renewal
    ended = t.lease(lease["id"])
    assert (ended["state"], ended["end_reason"], ended["escrow_amount"]) == (
        "window_closed", "no_availability", lease["escrow_amount"])
    # Nothing more was locked (period 1, settled meanwhile, gave its unused price back).
    assert t.balances()["accounts"][0]["available"] >= before
    assert [e for e in t.statement()["entries"] if e["reason"] == "renewal_fund"] == []
    assert [x["funding"] for x in t.lease_periods(lease["id"])] == ["prepaid", "prepaid"]
    assert p.listings(mine=True)[0]["reserved"] == 0
    ops.advance_clock(101)
    ops.sweep()
    settled = t.lease(lease["id"])
    assert (settled["state"], settled["paid_provider"], settled["refunded"]) == ("settled", 0, lease["escrow_amount"])
    assert t.statement()["totals"]["reconciles"]
    assert_audit_ok(market)


def test_one_record_in_a_period_is_enough_to_renew(world):
    p, t, ops, market = world["p"], world["t"], world["ops"], world["market"]
    p.create_listing(**standing_listing())
    lease = _running(world, term=1)
    ops.advance_clock(PERIOD)
    p.report_availability(lease["id"], 1, lease["started_at"], lease["started_at"] + 60, 0, 6, 0, 0)  # down, but said so
    ops.sweep()
    renewed = t.lease(lease["id"])
    assert renewed["state"] == "running" and renewed["escrow_amount"] == lease["escrow_amount"] + lease["renewal_price"]
    ops.advance_clock(PERIOD)
    ops.sweep()  # the renewed period closes with no record: the lease ends there
    assert (t.lease(lease["id"])["state"], t.lease(lease["id"])["end_reason"]) == ("window_closed", "no_availability")
    assert_audit_ok(market)


def test_notice_ends_the_lease_after_the_notice_and_the_term(world):
    p, t, ops, market = world["p"], world["t"], world["ops"], world["market"]
    p.create_listing(**standing_listing())
    lease = _running(world, term=2)
    with pytest.raises(MarketClientError) as refused:  # inside the committed term the tenant cannot leave
        t.terminate_lease(lease["id"], "tenant_request")
    assert refused.value.status == 409 and "committed term" in refused.value.message
    noticed = t.give_notice(lease["id"], "moving to our own cluster")
    assert noticed["ends_at"] == lease["started_at"] + 2 * PERIOD  # the term outlasts the 300 s notice
    assert noticed["notice_by"].startswith("tenant:")
    ops.advance_clock(PERIOD)
    ops.sweep()
    assert t.lease(lease["id"])["state"] == "running"  # the committed second period runs
    ops.advance_clock(PERIOD)
    ops.sweep()
    ended = t.lease(lease["id"])
    assert (ended["state"], ended["end_reason"]) == ("window_closed", "tenant_request")
    ops.advance_clock(101)
    ops.sweep()
    settled = t.lease(lease["id"])
    assert settled["state"] == "settled" and settled["paid_provider"] == 0  # no availability was reported
    assert settled["refunded"] == settled["escrow_amount"]  # so all of it came back
    assert_audit_ok(market)


def test_a_provider_that_ends_inside_a_period_is_paid_for_the_time_available(world):
    p, t, ops, market = world["p"], world["t"], world["ops"], world["market"]
    p.create_listing(**standing_listing())
    lease = _running(world, term=3)
    s0 = lease["started_at"]
    ops.advance_clock(200)
    p.report_availability(lease["id"], 1, s0, s0 + 200, 200, 20, 20, 5)
    ended = p.terminate_lease(lease["id"], "hardware_failure", "a fan died")["window_end"]  # now (real clock)
    (period,) = t.lease_periods(lease["id"])
    assert (period["state"], period["ended_at"]) == ("closed", ended)
    ops.advance_clock(101)
    ops.sweep()
    settled = t.lease(lease["id"])
    assert settled["state"] == "settled"
    # Paid for the 200 s available of the time it ran; the rest of the committed term comes back.
    want = period_figures(lease["period_price"], 2, PERIOD, ended - s0, 400, 9950, CREDITS, 200)
    assert want.charge == lease["period_price"] * 200 // PERIOD
    assert (settled["paid_provider"], settled["paid_fee"], settled["credited"]) == (want.provider, want.fee, want.credit)
    assert settled["refunded"] == settled["escrow_amount"] - want.charge
    assert_audit_ok(market)


def test_tenant_probes_that_saw_less_dispute_a_record(world):
    p, t, ops, market = world["p"], world["t"], world["ops"], world["market"]
    p.create_listing(**standing_listing())
    lease = _running(world, term=1)
    s0 = lease["started_at"]
    t.give_notice(lease["id"])  # it ends at the first close: one period
    ops.advance_clock(300)
    record = p.report_availability(lease["id"], 1, s0, s0 + 300, 300, 30, 30, 50)
    assert (record["kind"], record["device_seconds"], record["available_seconds"]) == ("availability", 600, 300)
    seen = t.submit_probes(lease["id"], s0, s0 + 300, 150, probes=30, probes_ok=15)
    assert seen["record_id"] == record["id"] and seen["dispute_id"] is not None
    dispute = t.disputes()[0]
    assert (dispute["claimed_device_seconds"], dispute["counter_device_seconds"]) == (300, 600)
    ops.resolve_dispute(dispute["id"], "upheld", "the tenant's probes are credible")
    ops.advance_clock(PERIOD - 300)
    ops.sweep()
    assert t.lease(lease["id"])["state"] == "window_closed"
    ops.advance_clock(101)
    ops.sweep()
    (period,) = t.lease_periods(lease["id"])
    assert period["available_device_seconds"] == 300 and period["availability_bps"] == 2500
    want = period_figures(lease["period_price"], 2, PERIOD, PERIOD, 300, 9950, CREDITS, 200)
    assert (period["charge"], period["credit"]) == (want.charge, want.credit)
    assert_audit_ok(market)


def test_records_outside_a_period_and_of_the_wrong_kind_are_refused(world):
    p, t, ops, market = world["p"], world["t"], world["ops"], world["market"]
    p.create_listing(**standing_listing())
    p.create_listing(**listing(accelerator_kind="l4", price_per_device_hour=PRICE))
    lease = _running(world, term=2)
    s0 = lease["started_at"]
    ops.advance_clock(PERIOD + 60)
    ops.sweep()  # renewed into period 2
    before = fingerprint(market)
    cases = [
        (lambda: p.report_availability(lease["id"], 1, s0 + 500, s0 + 700, 200, 20, 20, 0), 409, "crosses the close"),
        (lambda: p.report_availability(lease["id"], 1, s0 - 100, s0 + 10, 10, 1, 1, 0), 409, "outside every period"),
        (lambda: p.report_availability(lease["id"], 1, s0 + 700, s0 + 900, 10, 1, 1, 0), 409, "after now"),
        (lambda: p.report_availability(lease["id"], 1, s0, s0 + 60, 61, 6, 6, 0), 422, "exceeds the interval"),
        (lambda: p.report_availability(lease["id"], 1, s0, s0 + 60, 30, 6, 0, 0), 422, "healthy probes"),
        (lambda: t.submit_probes(lease["id"], s0 + 500, s0 + 700, 10, 1, 1), 422, "crosses the close"),
        (lambda: p.report_usage(lease["id"], 1, s0, s0 + 60, 60), 409, "reports availability"),
        (lambda: p.close_lease(lease["id"]), 409, "ends by notice"),
    ]
    for call, status, words in cases:
        with pytest.raises(MarketClientError) as refused:
            call()
        assert refused.value.status == status and words in refused.value.message, refused.value
    block = t.place_demand({"accelerator_kinds": ["l4"], "device_count": 1, "duration_s": 3600}, PRICE)
    p.accept_lease(block["lease_id"])
    started = p.start_lease(block["lease_id"])["started_at"]
    ops.advance_clock(60)
    with pytest.raises(MarketClientError) as refused:
        p.report_availability(block["lease_id"], 1, started, started + 30, 30, 3, 3, 0)
    assert refused.value.status == 409 and "block lease" in refused.value.message
    assert fingerprint(market)["counts"]["usage_records"] == before["counts"]["usage_records"]
    assert_audit_ok(market)


def test_availability_sequence_numbers_are_consecutive(world):
    """An availability record's seq is the last accepted one plus 1, as a usage record's is: a gap or a
    replay is 409 usage_rejected naming the seq expected, and changes nothing."""
    p, t, ops, market = world["p"], world["t"], world["ops"], world["market"]
    p.create_listing(**standing_listing())
    lease = _running(world, term=2)
    s0 = lease["started_at"]
    ops.advance_clock(300)
    p.report_availability(lease["id"], 1, s0, s0 + 100, 100, 10, 10, 0)
    before = fingerprint(market)
    for seq, words in ((3, "skips seq 2"), (9, "skips seq 2"), (1, "not above")):
        with pytest.raises(MarketClientError) as refused:
            p.report_availability(lease["id"], seq, s0 + 100, s0 + 200, 100, 10, 10, 0)
        err = refused.value
        assert (err.status, err.code) == (409, "usage_rejected") and words in err.message, err
        assert err.detail == {"expected_seq": 2}, err.detail
    assert fingerprint(market)["counts"]["usage_records"] == before["counts"]["usage_records"]
    p.report_availability(lease["id"], 2, s0 + 100, s0 + 200, 100, 10, 10, 0)
    assert [r["seq"] for r in t.usage(lease["id"])["records"]] == [1, 2]
    assert_audit_ok(market)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"form": "standing"}, "states its period and term"),
        ({"form": "standing", "standing": {"period_s": PERIOD}, "job": {"spec": "a: 1", "results_to": "/x"}},
         "not a job"),
        ({"standing": {"period_s": PERIOD}}, "belong to a standing demand"),
        ({"form": "standing", "standing": {"period_s": 30}}, "period_s"),
        ({"form": "standing", "standing": {"period_s": PERIOD, "term_periods": 2},
          "requirement": {"accelerator_kinds": ["l4"], "device_count": 1, "duration_s": 3600}}, "committed term"),
        ({"form": "standing", "standing": {"period_s": PERIOD, "min_memory_gib": 10**6}}, "min_memory_gib"),
        ({"form": "standing", "standing": {"period_s": PERIOD},
          "deployment": {"export_files": {}, "export_urls": {}, "token_sha256": "sha256:" + "0" * 64}}, "no files"),
        ({"form": "standing", "standing": {"period_s": PERIOD},
          "deployment": {"export_urls": {"config.json": "file:///etc/passwd"}, "token_sha256": "sha256:" + "0" * 64}},
         "http"),
        ({"form": "standing", "standing": {"period_s": PERIOD},
          "deployment": {"export_files": {"../x": "AA=="}, "token_sha256": "sha256:" + "0" * 64}}, "relative path"),
        ({"form": "standing", "standing": {"period_s": PERIOD},
          "deployment": {"export_files": {"a": "AA=="}, "token_sha256": "plain-token"}}, "token_sha256"),
    ],
)
def test_bad_standing_demands_are_refused_and_change_nothing(world, body, words):
    t, market = world["t"], world["market"]
    before = fingerprint(market)
    full = {"requirement": standing_need(), "max_price_per_device_hour": PRICE, **body}
    with pytest.raises(MarketClientError) as refused:
        t.call("place_demand", body=full)
    assert refused.value.status == 422 and words in refused.value.message, refused.value.message
    assert fingerprint(market) == before


def test_a_standing_demand_no_listing_meets_expires_with_its_escrow_returned(world):
    p, t, ops, market = world["p"], world["t"], world["ops"], world["market"]
    p.create_listing(**standing_listing())
    before = t.balances()["accounts"][0]
    now = ops.market_info()["now"]
    body, token = deployment_body(files={"config.json": "e30="})
    waiting = t.place_demand(standing_need(64, latest_start=now + 60), PRICE, form="standing",
                             standing={"period_s": PERIOD}, deployment=body)
    assert waiting["state"] == "open" and waiting["deployment"]["token_sha256"] == body["token_sha256"]
    assert token not in str(waiting)  # the token itself never travels
    assert t.balances()["accounts"][0]["pending_out"] == waiting["escrow_amount"] > 0
    ops.advance_clock(61)
    ops.sweep()
    assert t.demand(waiting["id"])["state"] == "expired"
    assert t.balances()["accounts"][0] == before
    assert_audit_ok(market)


def test_bad_standing_listings_are_refused(world):
    p, market = world["p"], world["market"]
    before = fingerprint(market)
    for overrides, words in (
        ({"standing": {"credits": [{"below_bps": 9990, "credit_bps": 100}]}}, "cannot exceed"),
        ({"standing": {"credits": [{"below_bps": 9950, "credit_bps": 500}, {"below_bps": 9000, "credit_bps": 100}]}},
         "at least as much"),
        ({"standing": {"reserved": [{"periods": 2, "discount_bps": 100}], "min_term_periods": 3}}, "min_term_periods"),
        ({"start_class": "queued", "max_queue_s": 60}, "immediate"),
    ):
        with pytest.raises(MarketClientError) as refused:
            p.create_listing(**standing_listing(**overrides))
        assert refused.value.status == 422 and words in refused.value.message, refused.value.message
    with pytest.raises(MarketClientError):
        p.create_listing(**listing(standing={"period_s": PERIOD, "availability_bps": 9000}))
    assert fingerprint(market) == before


def test_endpoint_is_published_for_the_parties_only(world):
    p, t, ops = world["p"], world["t"], world["ops"]
    p.create_listing(**standing_listing())
    lease = _running(world)
    published = p.publish_endpoint(lease["id"], "http://10.0.0.5:8123")
    assert published["endpoint_url"] == t.lease(lease["id"])["endpoint_url"] == "http://10.0.0.5:8123"
    with pytest.raises(MarketClientError) as refused:
        t.publish_endpoint(lease["id"], "http://evil:1")
    assert refused.value.status == 403
    assert ops.lease(lease["id"]).get("deployment") is None  # operators never see a deployment


def test_a_clock_jump_renews_past_the_term_one_period_per_call(world):
    """A sweep that runs a year late catches up the prepaid term but renews past it one period per call
    (periods.renew_or_close): the sweep's settlement then judges the period the catch-up opened, which
    holds no record, so the lease ends by the no-availability rule -- in one bounded sweep, with no year of
    silent periods renewed and funded."""
    p, t, ops, market = world["p"], world["t"], world["ops"], world["market"]
    p.create_listing(**standing_listing())  # available until FAR: a year of periods could be renewed
    lease = _running(world, term=3)
    ops.advance_clock(60)
    p.report_availability(lease["id"], 1, lease["started_at"], lease["started_at"] + 60, 60, 6, 6, 0)
    ops.advance_clock(365 * 24 * PERIOD)
    ops.sweep()
    ended = t.lease(lease["id"])
    assert [x["funding"] for x in t.lease_periods(lease["id"])] == ["prepaid", "prepaid", "prepaid"]
    assert (ended["state"], ended["end_reason"]) == ("settled", "no_availability")
    assert [e for e in t.statement()["entries"] if e["reason"] == "renewal_fund"] == []
    assert t.statement()["totals"]["reconciles"]
    assert_audit_ok(market)
