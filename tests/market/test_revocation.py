"""Revocation ends trading (runyard.market.revocation), on SQLite and PostgreSQL, with the audit (every
ledger invariant, to the minor unit) after each step: a revoked provider's offered and accepted leases
are cancelled with their escrow back, its running lease stops at the revocation, only usage received
before it is billable, and its earnings wait in a held account for the operator, who releases or
refunds them; a revoked tenant's demands and unstarted leases end with every hold released. A revoked
party can no longer act (403 `not_verified`, read inside the write transaction, not from its token),
over HTTP in the documented envelope too."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from runyard.market import (
    deadlines,
    funds,
    identity,
    leases,
    orders,
    revocation,
    settlement,
    statements,
    usage,
)
from runyard.market.client import MarketClientError
from runyard.market.errors import Conflict, NotVerified
from runyard.market.models import (
    AcceptIn,
    CreditIn,
    DemandIn,
    EndIn,
    HeldDecisionIn,
    ListingIn,
    PayoutMethodIn,
    UsageIn,
    WithdrawIn,
)
from runyard.market.payloads import lease_terms, usage_record
from runyard.market.schema import demands, ledger_accounts, transitions
from runyard.market.server import ServerThread
from runyard.market.signing import generate_keypair, sign

from .helpers import FAR, HOUR, assert_audit_ok, listing, new_party, open_market, operator_client, requirement

PRICE = 3600  # per device-hour: one minor unit per device-second
FEE_BPS = 1000


class World:
    def __init__(self, url):
        self.market = open_market(url, fee_bps=FEE_BPS, dispute_window_s=600)
        self.ops = identity.authenticate(self.market, identity.create_operator(self.market, "ops")["token"])
        self.keys, self.tokens, self.count = {}, {}, 0
        for name, role in (("t", "tenant"), ("p", "provider")):
            private, public = generate_keypair()
            self.tokens[name] = identity.register(self.market, name, role, public)["token"]
            self.keys[name] = private
            identity.request_verification(self.market, self.who(name), "")
            identity.decide(self.market, self.ops.actor, name, True, "ok")
        funds.credit(self.market, self.ops, CreditIn(account="t", amount=1_000_000, reason="seed"), "seed")
        orders.create_listing(self.market, self.who("p"), ListingIn(
            accelerator_kind="a100-80gb", devices_per_node=8, node_count=1, region="us", jurisdiction="us",
            price_per_device_hour=PRICE, available_until=FAR,
        ))  # fmt: skip

    def who(self, name):
        return identity.authenticate(self.market, self.tokens[name])

    def demand(self, kind="a100-80gb", devices=1):
        body = DemandIn(requirement={"accelerator_kinds": [kind], "device_count": devices, "duration_s": HOUR},
                        max_price_per_device_hour=PRICE)
        self.count += 1
        return orders.place_demand(self.market, self.who("t"), body, f"demand-{self.count}")

    def accept(self, lease_id):
        lease = leases.get_lease(self.market, self.who("p"), lease_id)
        body = AcceptIn(signature=sign(self.keys["p"], lease_terms(lease, "USD")))
        return leases.accept(self.market, self.who("p"), lease_id, body, f"a{lease_id}")

    def lease_in(self, state):
        """A lease of `p` in `state` ("offered", "accepted" or "running")."""
        lease_id = self.demand()["lease_id"]
        if state in ("accepted", "running"):
            self.accept(lease_id)
        if state == "running":
            leases.start(self.market, self.who("p"), lease_id, f"s{lease_id}")
        return self.lease(lease_id)

    def lease(self, lease_id):
        return leases.get_lease(self.market, self.ops, lease_id)

    def report(self, lease, seq, start, end, used, principal=None):
        body = UsageIn(seq=seq, interval_start=start, interval_end=end, device_seconds=used,
                       signature=sign(self.keys["p"], usage_record(lease["id"], seq, start, end, used)))  # fmt: skip
        return usage.report(self.market, principal or self.who("p"), lease["id"], body, f"u{lease['id']}-{seq}")

    def revoke(self, name, why="fraud reported"):
        return identity.decide(self.market, self.ops.actor, name, False, why)

    def available(self, name, code=None):
        principal = self.who(name)
        code = code or funds.own_account_code(principal.id, principal.role)
        return next(a for a in funds.balances(self.market, principal)["accounts"] if a["code"] == code)["available"]

    def log(self, entity, entity_id):
        def read(conn, now):
            q = select(transitions).where(transitions.c.entity == entity, transitions.c.entity_id == entity_id)
            return [dict(r) for r in conn.execute(q.order_by(transitions.c.id)).mappings()]

        return self.market.read(read)

    def reconciles(self):
        for name in ("t", "p"):
            assert statements.statement(self.market, self.who(name))["totals"]["reconciles"], name
        assert statements.statement(self.market, self.ops)["totals"]["reconciles"]


@pytest.fixture
def world(store_url):
    w = World(store_url)
    yield w
    assert_audit_ok(w.market)
    w.market.store.dispose()


@pytest.mark.parametrize("decision", ["release", "refund"])
def test_revoking_a_provider_ends_its_trading_and_holds_its_earnings(world, decision):
    w, m = world, world.market
    offered, accepted, running = w.lease_in("offered"), w.lease_in("accepted"), w.lease_in("running")
    start = running["started_at"]
    m.advance_clock(600, w.ops.actor)
    w.report(running, 1, start, start + 300, 300)  # received before the revocation: billable
    assert_audit_ok(m)
    before = w.available("t")
    stale_provider = w.who("p")  # authenticated while verified
    revoked_at = m.now()
    w.revoke("p", "fraud reported")
    assert_audit_ok(m)

    for lease in (offered, accepted):
        after = w.lease(lease["id"])
        assert (after["state"], after["end_reason"], after["refunded"]) == ("cancelled", "provider_revoked",
                                                                              lease["escrow_amount"])
        last = w.log("lease", lease["id"])[-1]
        assert (last["actor"], last["at"]) == (str(w.ops.actor), revoked_at) and "fraud reported" in last["reason"]
        # The demand is open again with a fresh hold, for a verified provider to take.
        assert orders.get_demand(m, w.who("t"), lease["demand_id"])["state"] == "open"
    stopped = w.lease(running["id"])
    assert (stopped["state"], stopped["end_reason"], stopped["window_end"]) == ("terminated", "provider_revoked",
                                                                                 revoked_at)
    assert stopped["earnings_hold"] == "held"
    hold_log = w.log(revocation.HOLD_ENTITY, running["id"])
    assert [(h["from_state"], h["to_state"], h["actor"]) for h in hold_log] == [(None, "held", str(w.ops.actor))]
    # The escrow of the two unstarted leases went back and is held again by their reopened demands.
    assert w.available("t") == before

    # The provider can no longer act, whatever its token said when it was checked.
    for call in (
        lambda: w.accept(offered["id"]),
        lambda: leases.start(m, stale_provider, accepted["id"], "late-start"),
        lambda: w.report(stopped, 2, start + 300, revoked_at, 10, principal=stale_provider),
        lambda: orders.create_listing(m, stale_provider, ListingIn(
            accelerator_kind="l4", devices_per_node=1, node_count=1, region="us", jurisdiction="us",
            price_per_device_hour=1, available_until=FAR)),
    ):  # fmt: skip
        with pytest.raises(NotVerified) as err:
            call()
        assert err.value.status == 403 and err.value.code == "not_verified"
    assert_audit_ok(m)

    # A decision before the lease settles is refused: more may still be paid into the hold.
    with pytest.raises(Conflict, match="settled"):
        revocation.decide_held(m, w.ops, running["id"], HeldDecisionIn(decision=decision, reason="early"), "h0")
    m.advance_clock(601, w.ops.actor)
    deadlines.sweep(m)
    assert_audit_ok(m)
    done = settlement.settle(m, w.ops, running["id"], "settle-after")
    charge = 300 * PRICE // 3600
    fee = charge * FEE_BPS // 10_000
    assert (done["state"], done["paid_provider"], done["paid_fee"]) == ("settled", charge - fee, fee)
    assert w.available("p") == 0  # nothing reached the provider's earnings
    held_code = f"held:lease:{running['id']}"
    held = m.read(lambda c, n: c.execute(select(ledger_accounts).where(ledger_accounts.c.code == held_code))
                  .mappings().one())
    assert held["credits_posted"] - held["debits_posted"] == charge - fee
    w.reconciles()
    t_before = w.available("t")

    result = revocation.decide_held(m, w.ops, running["id"], HeldDecisionIn(decision=decision, reason="reviewed"),
                                    "h1")
    assert result["amount"] == charge - fee
    assert w.lease(running["id"])["earnings_hold"] == {"release": "released", "refund": "refunded"}[decision]
    if decision == "release":
        assert (w.available("p"), w.available("t")) == (charge - fee, t_before)
    else:
        assert (w.available("p"), w.available("t")) == (0, t_before + charge - fee)
    assert [h["to_state"] for h in w.log(revocation.HOLD_ENTITY, running["id"])][-1] in ("released", "refunded")
    with pytest.raises(Conflict, match="only held earnings"):
        revocation.decide_held(m, w.ops, running["id"], HeldDecisionIn(decision="release", reason="again"), "h2")
    # The same key answers the first decision again and moves nothing.
    again = revocation.decide_held(m, w.ops, running["id"], HeldDecisionIn(decision=decision, reason="reviewed"),
                                   "h1")
    assert again == result
    assert_audit_ok(m)
    w.reconciles()


def test_a_revoked_provider_is_paid_nothing_for_usage_it_reports_later(world):
    """The rule: only records received before the revocation are billable; with none, the lease settles
    to the tenant in full and nothing is held."""
    w, m = world, world.market
    running = w.lease_in("running")
    m.advance_clock(1200, w.ops.actor)
    w.revoke("p")
    with pytest.raises(NotVerified):
        w.report(running, 1, running["started_at"], running["started_at"] + 600, 600)
    m.advance_clock(601, w.ops.actor)
    deadlines.sweep(m)
    done = w.lease(running["id"])
    assert (done["state"], done["paid_provider"], done["paid_fee"], done["refunded"]) == (
        "settled", 0, 0, running["escrow_amount"])
    result = revocation.decide_held(m, w.ops, running["id"], HeldDecisionIn(decision="refund", reason="nothing"), "k")
    assert result["amount"] == 0
    w.reconciles()


def test_revoking_a_tenant_cancels_its_demands_and_unstarted_leases(world):
    w, m = world, world.market
    waiting = w.demand(kind="h100-80gb")  # no listing of that kind: stays open with its hold
    assert waiting["state"] == "open"
    offered, accepted, running = w.lease_in("offered"), w.lease_in("accepted"), w.lease_in("running")
    stale_tenant = w.who("t")
    w.revoke("t", "chargeback")
    assert_audit_ok(m)
    assert orders.get_demand(m, w.ops, waiting["id"])["state"] == "cancelled"
    for lease in (offered, accepted):
        after = w.lease(lease["id"])
        assert (after["state"], after["end_reason"]) == ("cancelled", "tenant_revoked")
        # Its demand is not reopened for a tenant that may no longer trade.
        assert orders.get_demand(m, w.ops, lease["demand_id"])["state"] == "cancelled"
    # The running lease runs on (its provider serves it in good faith) and nothing is held.
    assert (w.lease(running["id"])["state"], w.lease(running["id"])["earnings_hold"]) == ("running", None)
    # Every hold is back: the available balance is the seed less the running lease's escrow.
    assert w.available("t") == 1_000_000 - running["escrow_amount"]
    open_holds = m.read(lambda c, n: c.execute(select(demands.c.id).where(demands.c.state == "open")).all())
    assert open_holds == []
    with pytest.raises(NotVerified):
        orders.place_demand(m, stale_tenant, DemandIn(requirement={"accelerator_kinds": ["a100-80gb"],
                            "device_count": 1, "duration_s": HOUR}, max_price_per_device_hour=PRICE), "late")
    method = funds.add_payout_method(m, stale_tenant, PayoutMethodIn(rail="test", destination="x"), "pm")
    with pytest.raises(NotVerified):
        funds.withdraw(m, stale_tenant, WithdrawIn(amount=1, payout_method_id=method["id"]), "wd")
    # The lease's provider still ends and is paid for it as usual.
    leases.terminate(m, w.who("p"), running["id"], EndIn(reason_code="other"), "end")
    w.reconciles()


def test_over_http_a_revoked_provider_is_refused_in_the_error_envelope(store_url):
    market = open_market(store_url)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        provider = new_party(server.url, "farm", "provider", ops)
        tenant = new_party(server.url, "lab", "tenant", ops)
        ops.credit("lab", 100_000, "seed")
        provider.client.create_listing(**listing())
        lease_id = tenant.client.place_demand(requirement(), 300)["lease_id"]
        ops.decide("farm", False, "revoked")
        for call in (lambda: provider.client.accept_lease(lease_id), lambda: provider.client.create_listing(**listing())):
            with pytest.raises(MarketClientError) as err:
                call()
            assert (err.value.status, err.value.code) == (403, "not_verified")
            assert "farm is rejected" in err.value.message
        assert tenant.client.lease(lease_id)["end_reason"] == "provider_revoked"
        with pytest.raises(MarketClientError) as err:
            ops.decide_held_earnings(lease_id, decision="refund", reason="x")
        assert (err.value.status, err.value.code) == (409, "conflict")
        assert_audit_ok(market)
    market.store.dispose()


def test_a_revoked_operator_is_refused_inside_the_transaction(world):
    """An operator authenticated before another operator revoked it can credit, decide or resolve
    nothing: each operation reads its state again in its own transaction."""
    w, m = world, world.market
    second = identity.authenticate(m, identity.create_operator(m, "ops2")["token"])
    identity.decide(m, w.ops.actor, "ops2", False, "left the company")
    with pytest.raises(NotVerified):
        funds.credit(m, second, CreditIn(account="t", amount=5, reason="x"), "c")
    with pytest.raises(NotVerified):
        identity.decide(m, second.actor, "p", False, "revenge")
    running = w.lease_in("running")
    with pytest.raises(NotVerified):
        revocation.decide_held(m, second, running["id"], HeldDecisionIn(decision="refund", reason="x"), "h")
    assert w.who("p").state == "verified" and w.lease(running["id"])["state"] == "running"
