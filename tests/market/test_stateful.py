"""A hypothesis state machine drives the market's service layer with random operations (money in
through the rail and out, listings and escrow-backed demands of both forms, every lease transition,
usage, standing leases' availability records, tenant probes, notice and renewal, tenant
measurements, acknowledgements, disputes and their resolution, settlement, clock jumps, idempotent
retries, an operator revoking any party's verification -- and later restoring it, a suspension --
and deciding a revoked provider's held earnings) and checks every invariant (runyard.market.invariants) after every step, on SQLite and on
PostgreSQL.

Each rule names the refusals it may meet (a lease in the wrong state, a closed window, a tenant
short of funds): any other market error fails the run. Afterwards the walk must have reached
settled leases, resolved disputes, expired leases, disputes opened by a tenant's measurement,
standing leases renewed and settled period by period, so that a run which stalls early cannot pass. The examples are derandomized: the same walk every run."""

from __future__ import annotations

import functools
import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import select

from runyard.market import availability as standing_ops
from runyard.market import (
    deadlines,
    funds,
    identity,
    invariants,
    leases,
    orders,
    revocation,
    settlement,
    statements,
    usage,
)
from runyard.market import disputes as dispute_ops
from runyard.market.errors import (
    BadRequest,
    Conflict,
    InsufficientFunds,
    InvalidTransition,
    NotVerified,
    UsageRejected,
)
from runyard.market.models import (
    AcceptIn,
    AckIn,
    ContestIn,
    DemandIn,
    DisputeIn,
    EndIn,
    HeldDecisionIn,
    ListingIn,
    MeasurementIn,
    PayoutMethodIn,
    RailEventIn,
    ResolveIn,
    UsageIn,
    WithdrawIn,
)
from runyard.market.payloads import availability_record, lease_terms, measurement, tenant_probes, usage_record
from runyard.market.schema import accounts, disputes, lease_periods, usage_records
from runyard.market.schema import demands as demands_table
from runyard.market.schema import leases as leases_table
from runyard.market.signing import generate_keypair, sign
from runyard.market.standing import AvailabilityIn, NoticeIn, ProbesIn
from tests.tiers import examples

from .helpers import FAR, open_market

KINDS = ["h100-80gb", "l40s"]
START = 1_800_000_000  # the market's clock at the start of every example
REACHED: Counter = Counter()
FAST_EXAMPLES = 10  # the fast tier's walks (derandomized: the same walks every run) still reach MUST_REACH
SETTINGS = settings(
    max_examples=examples(20, fast=FAST_EXAMPLES),
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# What a random walk must have reached, summed over the examples (see the module docstring).
MUST_REACH = ("lease settled", "lease expired", "dispute resolved", "dispute from a measurement",
              "standing lease settled", "period settled", "period renewal", "provider revoked", "tenant revoked",
              "earnings held", "held earnings decided")
# A revocation ends every lease of the party: more than this many per walk and the walks spend their steps
# rebuilding what it ended instead of reaching the states after it.
MAX_SUSPENSIONS = 2
EXTRA_BUDGETS = 6  # random budgets after the derandomized one, run only while a MUST_REACH state is missed
STANDING_KIND = "l4"
STANDING_PERIOD = 600


def machine_for(url_factory, backend: str):
    class MarketMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            # A fixed clock (moved only by the advance rule), so that a replayed example sees the
            # same deadlines: hypothesis requires the walk to be a function of its draws.
            self.market = open_market(
                url_factory(backend),
                clock=lambda: START,
                fee_bps=150,
                dispute_window_s=900,
                accept_timeout_s=5000,
                start_timeout_s=5000,
            )
            self.operator = identity.authenticate(
                self.market, identity.create_operator(self.market, "ops")["token"]
            )
            self.tokens, self.keys, self.deposited, self.used_keys = {}, {}, {}, {}
            for name, role in (("t1", "tenant"), ("t2", "tenant"), ("p1", "provider"), ("p2", "provider")):
                private, public = generate_keypair()
                account = identity.register(self.market, name, role, public)
                self.tokens[name], self.keys[name] = account["token"], private
                identity.request_verification(self.market, self.who(name), "")
                identity.decide(self.market, self.operator.actor, name, True, "ok")
            # Start funded, so that the random walk reaches leases and settlement quickly.
            self.deposited = {"t1": 200_000, "t2": 200_000}
            for tenant, amount in self.deposited.items():
                funds.rail_deposit(self.market, "test", self.event(tenant, "opening", amount))
            self.payout = {
                name: funds.add_payout_method(
                    self.market, self.who(name), PayoutMethodIn(rail="test", destination=name), f"pm-{name}"
                )["id"]
                for name in self.tokens
            }
            self.last_money: tuple | None = None
            self.keys_made = itertools.count()
            self.suspensions = 0

        def teardown(self):
            # Reported by --hypothesis-show-statistics: how far the random walks got.
            for state in self.market.read(
                lambda c, n: c.execute(select(leases_table.c.state)).scalars().all()
            ):
                event(f"lease reached {state}")
                REACHED[f"lease {state}"] += 1
            for state, why in self.market.read(
                lambda c, n: c.execute(select(leases_table.c.state, leases_table.c.end_reason)
                                       .where(leases_table.c.form == "standing")).all()
            ):
                REACHED[f"standing lease {state}"] += 1
                REACHED[f"standing lease ended: {why}"] += why is not None
            for state, funding in self.market.read(
                lambda c, n: c.execute(select(lease_periods.c.state, lease_periods.c.funding)).all()
            ):
                event(f"period {state}")
                REACHED[f"period {state}"] += 1
                REACHED[f"period {funding}"] += 1
            for state in self.market.read(
                lambda c, n: c.execute(select(usage_records.c.state)).scalars().all()
            ):
                event(f"record {state}")
                REACHED[f"record {state}"] += 1
            for state, opened_by in self.market.read(
                lambda c, n: c.execute(select(disputes.c.state, disputes.c.opened_by)).all()
            ):
                event(f"dispute {state}")
                REACHED[f"dispute {state}"] += 1
                REACHED["dispute resolved"] += state in ("upheld", "partial", "rejected")
                REACHED["dispute from a measurement"] += opened_by == "system"
            self.market.store.dispose()

        def event(self, tenant, key, amount):
            """A rail's deposit event for `tenant` (its id names the tenant and `key`)."""
            return RailEventIn(
                id=f"{tenant}-{key}", type="deposit.succeeded", account_id=self.who(tenant).id, amount=amount,
                currency="USD",
            )  # fmt: skip

        def who(self, name):
            return identity.authenticate(self.market, self.tokens[name])

        def ids(self, table, **where):
            def read(conn, now):
                query = select(table.c.id).order_by(table.c.id)
                for column, values in where.items():
                    query = query.where(table.c[column].in_(values))
                return conn.execute(query).scalars().all()

            return self.market.read(read)

        def row(self, table, row_id):
            return self.market.read(
                lambda c, n: dict(c.execute(select(table).where(table.c.id == row_id)).mappings().one())
            )

        def attempt(self, refusals, fn, *args):
            """Run `fn`; a refusal of one of the `refusals` types is counted and answered None, any
            other error fails the run."""
            try:
                return fn(*args)
            except refusals as exc:
                REACHED[f"refused {exc.code}"] += 1
                return None

        @initialize(price=st.integers(50, 300), queued=st.booleans())
        def opening_listings(self, price, queued):
            # Generous capacity from the start, so that most demands match and leases get going.
            for provider, kind in (("p1", "h100-80gb"), ("p2", "l40s")):
                self.list_capacity(provider, kind, 8, price, queued, nodes=4)
            self.list_standing("p2", price)

        def list_standing(self, provider, price):
            body = ListingIn(
                accelerator_kind=STANDING_KIND, devices_per_node=4, node_count=2, region="eu", jurisdiction="eu",
                price_per_device_hour=price, available_until=FAR, form="standing", memory_gib=24,
                standing={"period_s": STANDING_PERIOD, "availability_bps": 9950, "notice_s": 300,
                          "credits": [{"below_bps": 9950, "credit_bps": 1000}, {"below_bps": 9000, "credit_bps": 3000}],
                          "reserved": [{"periods": 2, "discount_bps": 1500}]},
            )  # fmt: skip
            orders.create_listing(self.market, self.who(provider), body)

        @rule(tenant=st.sampled_from(["t1", "t2"]), devices=st.integers(1, 4), term=st.integers(1, 3),
              price=st.integers(50, 600))
        def standing_demand(self, tenant, devices, term, price):
            body = DemandIn(
                requirement={"accelerator_kinds": [STANDING_KIND], "device_count": devices},
                max_price_per_device_hour=price, form="standing",
                standing={"period_s": STANDING_PERIOD, "term_periods": term},
            )
            self.attempt((InsufficientFunds, NotVerified), orders.place_demand, self.market, self.who(tenant), body,
                         f"sdem-{next(self.keys_made)}")

        @rule(data=st.data(), side=st.sampled_from(["tenant", "provider"]))
        def notice(self, data, side):
            ids = self.ids(leases_table, state=["running"], form=["standing"])
            if not ids:
                return
            lease = self.row(leases_table, data.draw(st.sampled_from(ids)))
            who = self.who(self.party(lease, side))
            result = standing_ops.give_notice(self.market, who, lease["id"], NoticeIn(), f"notice-{next(self.keys_made)}")
            assert result["ends_at"] is not None and result["ends_at"] >= lease["started_at"] + \
                lease["period_s"] * lease["term_periods"]

        @rule(data=st.data(), how=st.sampled_from(["notice", "nonpayment", "provider_ends", "renew"]))
        def finish_standing(self, data, how):
            """Drive a standing lease through periods to its settlement: the tenant's notice, a renewal it
            cannot fund (its balance withdrawn), a provider that ends it inside a period, or renewals past
            its term (each period reported) until a period without a record ends it (no_availability)."""
            ids = self.ids(leases_table, state=["offered", "accepted", "running"], form=["standing"])
            if not ids:
                self.standing_demand("t1", 1, 1, 600)
                ids = self.ids(leases_table, state=["offered", "accepted", "running"], form=["standing"])
                if not ids:
                    return
            lease = self.row(leases_table, ids[0])
            for action in {"offered": ["accept", "start"], "accepted": ["start"], "running": []}[lease["state"]]:
                self.lease_action(data, action, lease_id=lease["id"])
            lease = self.row(leases_table, lease["id"])
            if lease["state"] != "running":
                return
            tenant, provider = self.party(lease, "tenant"), self.party(lease, "provider")
            if how == "provider_ends":
                self.advance(60)
                self.report(data, data.draw(st.integers(50, 100)), False, lease_id=lease["id"])
                self.attempt((InvalidTransition, Conflict), leases.terminate, self.market, self.who(provider),
                             lease["id"], EndIn(reason_code="hardware_failure"), f"pend-{next(self.keys_made)}")
            else:
                if how == "renew":
                    pass  # no notice: it renews after its term, while the periods have records
                elif how == "notice":
                    standing_ops.give_notice(self.market, self.who(tenant), lease["id"], NoticeIn(),
                                             f"notice-{next(self.keys_made)}")
                else:
                    available = funds.balances(self.market, self.who(tenant))["accounts"][0]["available"]
                    if available:
                        self.attempt((InsufficientFunds, NotVerified), funds.withdraw, self.market, self.who(tenant),
                                     WithdrawIn(amount=available, payout_method_id=self.payout[tenant]),
                                     f"wd-all-{next(self.keys_made)}")
                for _ in range(lease["term_periods"] + 1):
                    lease = self.row(leases_table, lease["id"])
                    if lease["state"] != "running":
                        break
                    self.advance(max(1, lease["window_end"] - self.market.now()))
                    self.report(data, data.draw(st.integers(50, 100)), False, lease_id=lease["id"])
                    self.sweep()
            self.advance(901)  # past the dispute window
            self.sweep()

        @rule(data=st.data(), steps=st.integers(1, 4))
        def progress(self, data, steps):
            """Move random leases along the happy path (accept, start, report usage, let time pass),
            or place a demand; the other rules then hit them from every side."""
            for _ in range(steps):
                self._progress_one(data)

        def _progress_one(self, data):
            stage = data.draw(st.sampled_from(["lease", "lease", "lease", "usage", "dispute"]))
            if stage == "usage" and self.ids(usage_records, state=["reported"]):
                # A tenant who doubts a fresh record: it disputes it, or measures (and may dispute).
                if data.draw(st.booleans()):
                    self.respond(data, "dispute")
                else:
                    self.measure(data, data.draw(st.sampled_from([0, 50, 100])))
                return
            if stage == "dispute" and self.ids(disputes, state=["open"]):
                self.resolve(data, data.draw(st.sampled_from(["upheld", "partial", "rejected"])))
                return
            ids = self.ids(leases_table, state=["offered", "accepted", "running"])
            if len(ids) < 2 and data.draw(st.booleans()):
                tenant = data.draw(st.sampled_from(["t1", "t2"]))
                kinds = data.draw(st.sets(st.sampled_from(KINDS), min_size=1).map(sorted))
                self.demand(
                    tenant, kinds, data.draw(st.integers(1, 8)), data.draw(st.integers(600, 7200)), 400, False
                )
                return
            if not ids:
                return
            lease = self.row(leases_table, data.draw(st.sampled_from(ids[:2])))  # the oldest: finish them
            action = {"offered": "accept", "accepted": "start", "running": "report"}[lease["state"]]
            if action == "report" and data.draw(st.integers(0, 2)) == 0:
                self.advance(data.draw(st.sampled_from([600, 1800])))
                self.sweep()
            elif action == "report":
                self.advance(data.draw(st.sampled_from([60, 600])))  # some time to report on
                self.report(data, data.draw(st.integers(0, 100)), False, lease_id=lease["id"])
            else:
                self.lease_action(data, action, lease_id=lease["id"])

        @rule(data=st.data(), how=st.sampled_from(["settle", "settle_disputed", "settle_measured", "expire"]))
        def finish(self, data, how):
            """Drive one lease to an end: settled (with a disputed record resolved on the way, or not),
            or expired by its provider's silence. The other rules interleave with these walks."""
            # Block leases only: a standing lease reports availability, is not measured, and ends by its own rules.
            ids = self.ids(leases_table, state=["offered"] if how == "expire" else ["offered", "accepted", "running"],
                           form=["block"])
            if not ids:
                return
            lease = self.row(leases_table, ids[0])
            if how == "expire":
                self.advance(max(0, lease["accept_by"] - self.market.now()) + 1)  # past already, not yet swept
                self.sweep()
                assert self.row(leases_table, lease["id"])["state"] == "expired"
                return
            for action in {"offered": ["accept", "start"], "accepted": ["start"], "running": []}[lease["state"]]:
                self.lease_action(data, action, lease_id=lease["id"])
            lease = self.row(leases_table, lease["id"])
            if lease["state"] != "running":
                return  # refused on the way (a deadline passed): the sweep will end it
            self.advance(max(1, lease["window_end"] - self.market.now()))
            self.report(data, data.draw(st.integers(20, 100)), False, lease_id=lease["id"])
            last = self.ids(usage_records, lease_id=[lease["id"]])
            if how == "settle_disputed" and last:
                self.respond(data, "dispute", record_id=last[-1])
            if how == "settle_measured" and last:
                self.measure(data, 50, record_id=last[-1])
            if how != "settle":
                self.resolve(data, data.draw(st.sampled_from(["upheld", "partial", "rejected"])))
            self.advance(901)  # past every dispute window
            self.sweep()

        # -- money ----------------------------------------------------------------------------------

        @rule(tenant=st.sampled_from(["t1", "t2"]), amount=st.integers(1, 60_000), key=st.integers(0, 5))
        def deposit(self, tenant, amount, key):
            """A rail delivers a deposit event; an event id seen before with other values is refused."""
            k = f"dep-{key}"
            try:
                funds.rail_deposit(self.market, "test", self.event(tenant, k, amount))
            except Conflict:
                assert self.used_keys[(tenant, k)] != ("deposit", amount)
                return
            if (tenant, k) not in self.used_keys:
                self.deposited[tenant] += amount
                self.used_keys[(tenant, k)] = ("deposit", amount)
            self.last_money = (tenant, k, amount)

        @rule()
        def retry_last_deposit(self):
            """A retry with the key of an earlier deposit returns that deposit and moves nothing."""
            if self.last_money:
                tenant, k, amount = self.last_money
                first = funds.rail_deposit(self.market, "test", self.event(tenant, k, amount))
                again = funds.rail_deposit(self.market, "test", self.event(tenant, k, amount))
                assert again["transfer_id"] == first["transfer_id"] and again["duplicate"]

        @rule(name=st.sampled_from(["t1", "t2", "p1", "p2"]), amount=st.integers(1, 80_000))
        def withdraw(self, name, amount):
            body = WithdrawIn(amount=amount, payout_method_id=self.payout[name])
            self.attempt((InsufficientFunds, NotVerified), funds.withdraw, self.market, self.who(name), body,
                         f"wd-{name}-{amount}")

        # -- orders ---------------------------------------------------------------------------------

        @rule(
            provider=st.sampled_from(["p1", "p2"]), kind=st.sampled_from(KINDS), devices=st.integers(1, 8),
            price=st.integers(50, 500), queued=st.booleans(),
        )  # fmt: skip
        def list_capacity(self, provider, kind, devices, price, queued, nodes=1):
            body = ListingIn(
                accelerator_kind=kind, devices_per_node=devices, node_count=nodes, region="eu", jurisdiction="eu",
                price_per_device_hour=price, available_until=FAR, start_class="queued" if queued else "immediate",
                max_queue_s=600 if queued else 0,
            )  # fmt: skip
            self.attempt(NotVerified, orders.create_listing, self.market, self.who(provider), body)

        @rule(
            tenant=st.sampled_from(["t1", "t2"]), kinds=st.sets(st.sampled_from(KINDS), min_size=1).map(sorted),
            devices=st.integers(1, 8), duration=st.integers(600, 7200), price=st.integers(50, 600),
            immediate_only=st.booleans(),
        )  # fmt: skip
        def demand(self, tenant, kinds, devices, duration, price, immediate_only):
            body = DemandIn(
                requirement={
                    "accelerator_kinds": sorted(kinds), "device_count": devices, "duration_s": duration,
                    "start_classes": ["immediate"] if immediate_only else ["immediate", "queued"],
                },
                max_price_per_device_hour=price,
            )  # fmt: skip
            self.attempt(
                (InsufficientFunds, NotVerified),
                orders.place_demand,
                self.market,
                self.who(tenant),
                body,
                f"dem-{next(self.keys_made)}",
            )

        @rule(data=st.data())
        def cancel_demand(self, data):
            open_ids = self.ids(demands_table, state=["open"])
            if open_ids:
                demand = self.row(demands_table, data.draw(st.sampled_from(open_ids)))
                owner = "t1" if self.who("t1").id == demand["tenant_id"] else "t2"
                orders.cancel_demand(self.market, self.who(owner), demand["id"], f"cancel-{demand['id']}")

        # -- leases ---------------------------------------------------------------------------------

        def party(self, lease, side):
            account_id = lease[f"{side}_id"]
            return next(n for n in self.tokens if self.who(n).id == account_id)

        @rule(
            data=st.data(),
            action=st.sampled_from(["accept", "reject", "start", "cancel", "terminate", "close"]),
        )
        def lease_action(self, data, action, lease_id=None):
            ids = [lease_id] if lease_id else self.ids(leases_table)
            if not ids:
                return
            lease = self.row(leases_table, data.draw(st.sampled_from(ids)))
            provider, tenant = self.party(lease, "provider"), self.party(lease, "tenant")
            key = f"{action}-{lease['id']}-{self.market.now()}"
            end = EndIn(reason_code="other")
            # Wrong state, a deadline passed, or a provider whose verification is revoked.
            refusals = (InvalidTransition, Conflict, NotVerified)
            if action == "accept":
                signature = sign(self.keys[provider], lease_terms(lease, "USD"))
                self.attempt(
                    refusals,
                    leases.accept,
                    self.market,
                    self.who(provider),
                    lease["id"],
                    AcceptIn(signature=signature),
                    key,
                )
            elif action == "reject":
                self.attempt(refusals, leases.reject, self.market, self.who(provider), lease["id"], end, key)
            elif action == "start":
                self.attempt(refusals, leases.start, self.market, self.who(provider), lease["id"], key)
            elif action == "cancel":
                self.attempt(refusals, leases.cancel, self.market, self.who(tenant), lease["id"], end, key)
            elif action == "terminate":
                side = data.draw(st.sampled_from([provider, tenant]))
                self.attempt(refusals, leases.terminate, self.market, self.who(side), lease["id"], end, key)
            else:
                self.attempt(refusals, leases.close_window, self.market, self.who(provider), lease["id"], key)

        @rule(seconds=st.sampled_from([30, 300, 1000, 4000]))
        def advance(self, seconds):
            self.market.advance_clock(seconds, self.operator.actor)

        @rule()
        def sweep(self):
            deadlines.sweep(self.market)

        @rule(data=st.data())
        def settle(self, data):
            ids = self.ids(leases_table)
            if ids:
                lease_id = data.draw(st.sampled_from(ids))
                key = f"settle-{lease_id}-{self.market.now()}"
                result = self.attempt(InvalidTransition, settlement.settle, self.market, self.operator, lease_id, key)
                if result is not None:
                    assert (
                        settlement.settle(self.market, self.operator, lease_id, key + "b")["moved_now"] == 0
                    )

        # -- usage ----------------------------------------------------------------------------------

        @rule(data=st.data(), fraction=st.integers(0, 100), replay=st.booleans())
        def report(self, data, fraction, replay, lease_id=None):
            ids = (
                [lease_id]
                if lease_id
                else self.ids(leases_table, state=["running", "window_closed", "terminated"])
            )
            if not ids:
                return
            lease = self.row(leases_table, data.draw(st.sampled_from(ids)))
            provider = self.party(lease, "provider")
            start = lease["last_interval_end"] or lease["started_at"]
            end = min(self.market.now(), lease["window_end"])
            if end <= start:
                return
            if lease["form"] == "standing":
                self.report_availability(lease, provider, start, end, fraction, replay)
                return
            seq = lease["last_seq"] if replay and lease["last_seq"] else lease["last_seq"] + 1
            used = lease["devices"] * (end - start) * fraction // 100
            signature = sign(self.keys[provider], usage_record(lease["id"], seq, start, end, used))
            body = UsageIn(
                seq=seq, interval_start=start, interval_end=end, device_seconds=used, signature=signature
            )
            result = self.attempt(
                (UsageRejected, NotVerified),
                usage.report,
                self.market,
                self.who(provider),
                lease["id"],
                body,
                f"use-{lease['id']}-{seq}-{end}",
            )
            if replay and lease["last_seq"]:
                assert result is None, "a replayed sequence number was accepted"

        def report_availability(self, lease, provider, start, end, fraction, replay):
            """A standing lease's availability over [start, end), cut at the close of start's period (a
            record never spans two); replayed, it must be refused."""
            period = lease["period_s"]
            end = min(end, lease["started_at"] + period * ((start - lease["started_at"]) // period + 1))
            seq = lease["last_seq"] if replay and lease["last_seq"] else lease["last_seq"] + 1
            probes = max(1, (end - start) // 10)
            ok = probes * fraction // 100
            available = (end - start) * ok // probes
            payload = availability_record(lease["id"], seq, start, end, available, probes, ok, 3)
            body = AvailabilityIn(seq=seq, interval_start=start, interval_end=end, available_seconds=available,
                                  probes=probes, probes_ok=ok, requests=3,
                                  signature=sign(self.keys[provider], payload))
            result = self.attempt((UsageRejected, NotVerified), standing_ops.report_availability, self.market, self.who(provider),
                                  lease["id"], body, f"avail-{lease['id']}-{seq}-{end}")
            if replay and lease["last_seq"]:
                assert result is None, "a replayed sequence number was accepted"

        @rule(data=st.data(), percent=st.sampled_from([0, 50, 100]))
        def probes(self, data, percent):
            """The tenant's probes of a standing lease's record: below the tolerance a dispute opens."""
            ids = self.ids(usage_records, kind=["availability"])
            if not ids:
                return
            record = self.row(usage_records, data.draw(st.sampled_from(ids)))
            lease = self.row(leases_table, record["lease_id"])
            tenant = self.party(lease, "tenant")
            start, end = record["interval_start"], record["interval_end"]
            seen = record["available_seconds"] * percent // 100
            ok = 1 if seen else 0
            body = ProbesIn(interval_start=start, interval_end=end, available_seconds=seen, probes=1, probes_ok=ok,
                            signature=sign(self.keys[tenant], tenant_probes(lease["id"], start, end, seen, 1, ok)))
            self.attempt((Conflict, BadRequest), standing_ops.submit_probes, self.market, self.who(tenant), lease["id"],
                         body, f"probe-{next(self.keys_made)}")

        @rule(data=st.data(), action=st.sampled_from(["ack", "part", "dispute", "contest"]))
        def respond(self, data, action, record_id=None):
            ids = [record_id] if record_id else self.ids(usage_records)
            if not ids:
                return
            record = self.row(usage_records, data.draw(st.sampled_from(ids)))
            lease = self.row(leases_table, record["lease_id"])
            tenant, provider = self.party(lease, "tenant"), self.party(lease, "provider")
            key, half = f"{action}-{record['id']}", record["device_seconds"] // 2
            # A record no longer `reported` (or past its window) refuses a response: that is all.
            refusals = (Conflict, InvalidTransition)
            if action == "ack":
                self.attempt(refusals, usage.acknowledge, self.market, self.who(tenant), record["id"], AckIn(), key)
            elif action == "part":
                body = AckIn(accepted_device_seconds=half)
                self.attempt(refusals, usage.acknowledge, self.market, self.who(tenant), record["id"], body, key)
            elif action == "dispute" and record["device_seconds"] > 0:
                body = DisputeIn(reason="too much", claimed_device_seconds=half)
                self.attempt(refusals, dispute_ops.dispute, self.market, self.who(tenant), record["id"], body, key)
            elif action == "contest":
                body = ContestIn(reason="no")
                self.attempt(refusals, dispute_ops.contest, self.market, self.who(provider), record["id"], body, key)

        @rule(data=st.data(), percent=st.sampled_from([0, 50, 97, 100, 150]))
        def measure(self, data, percent, record_id=None):
            """The tenant signs what its job saw over a reported interval: a share of what the provider
            reported. Below the tolerance (5%) a dispute opens by itself; above 100% nothing does."""
            ids = [record_id] if record_id else self.ids(usage_records)
            if not ids:
                return
            record = self.row(usage_records, data.draw(st.sampled_from(ids)))
            lease = self.row(leases_table, record["lease_id"])
            tenant = self.party(lease, "tenant")
            start, end = record["interval_start"], record["interval_end"]
            seen = record["device_seconds"] * percent // 100
            body = MeasurementIn(
                interval_start=start, interval_end=end, device_seconds=seen,
                signature=sign(self.keys[tenant], measurement(lease["id"], start, end, seen)),
            )  # fmt: skip
            before = record["state"]
            # Refused when measured already, or when the record's window or the lease's period is over.
            result = self.attempt(
                Conflict, usage.submit_measurement, self.market, self.who(tenant), lease["id"], body,
                f"measure-{next(self.keys_made)}",
            )  # fmt: skip
            if result is not None and result["dispute_id"] is not None:
                assert before == "reported" and percent < 95, (before, percent)
                dispute = self.row(disputes, result["dispute_id"])
                assert dispute["claimed_device_seconds"] == seen <= record["device_seconds"]

        @precondition(lambda self: bool(self.fresh_block_records()))
        @rule(data=st.data(), percent=st.sampled_from([0, 50, 90]))
        def doubt_a_fresh_record(self, data, percent):
            """A tenant measures a block lease's record it has not answered yet and finds less than the
            tolerance: a dispute opens by itself (enabled only while such a record exists, so that the walk
            reaches this state whichever rules came before)."""
            self.measure(data, percent, record_id=data.draw(st.sampled_from(self.fresh_block_records())))

        def fresh_block_records(self) -> list[int]:
            """Records still `reported` of block leases (a standing lease's availability is not measured so)."""
            def read(conn, now):
                return conn.execute(
                    select(usage_records.c.id).order_by(usage_records.c.id)
                    .join(leases_table, leases_table.c.id == usage_records.c.lease_id)
                    .where(usage_records.c.state == "reported", leases_table.c.form == "block")).scalars().all()

            return self.market.read(read)

        @precondition(lambda self: bool(self.ids(disputes, state=["open"])))
        @rule(data=st.data(), outcome=st.sampled_from(["upheld", "partial", "rejected"]))
        def resolve(self, data, outcome):
            ids = self.ids(disputes, state=["open"])
            if ids:
                d = self.row(disputes, data.draw(st.sampled_from(ids)))
                value = (
                    (d["claimed_device_seconds"] + d["counter_device_seconds"]) // 2
                    if outcome == "partial"
                    else None
                )
                body = ResolveIn(outcome=outcome, device_seconds=value, reason="decided")
                dispute_ops.resolve(self.market, self.operator, d["id"], body, f"res-{d['id']}")

        # -- revocation -------------------------------------------------------------------------------

        @precondition(lambda self: self.suspensions < MAX_SUSPENSIONS)
        @rule(name=st.sampled_from(["t1", "t2", "p1", "p2"]), wait=st.booleans(),
              decision=st.sampled_from(["release", "refund"]))
        def suspend(self, name, wait, decision):
            """The operator revokes a party (its trading ends at once: revocation.py), then -- after the
            revoked provider's leases settled and their held earnings were released or refunded, when
            `wait` -- verifies it again: a suspension lifted, so the walk goes on trading."""
            self._suspend(name, wait, decision)

        @precondition(lambda self: self.suspensions < MAX_SUSPENSIONS and bool(self.leases_at_work()))
        @rule(decision=st.sampled_from(["release", "refund"]))
        def suspend_a_provider_at_work(self, decision):
            """The same for the provider of the oldest lease not yet settled: its earnings are held, and
            decided once its leases have settled."""
            self._suspend(self.party(self.row(leases_table, self.leases_at_work()[0]), "provider"), True, decision)

        def leases_at_work(self) -> list[int]:
            """Leases not yet settled whose earnings are not held: revoking their provider holds them."""
            def read(conn, now):
                return conn.execute(select(leases_table.c.id).order_by(leases_table.c.id).where(
                    leases_table.c.state.in_(("running", "window_closed", "terminated")),
                    leases_table.c.earnings_hold.is_(None))).scalars().all()

            return self.market.read(read)

        def _suspend(self, name, wait, decision):
            who = self.who(name)
            self.suspensions += 1
            identity.decide(self.market, self.operator.actor, name, False, "suspended by the walk")
            REACHED[f"{who.role} revoked"] += 1
            self.revoked_parties_do_not_trade()
            if wait:
                # The held leases settle: their open disputes decided, past every window and dispute window.
                for dispute_id in self.ids(disputes, state=["open"]):
                    body = ResolveIn(outcome="upheld", device_seconds=None, reason="decided")
                    dispute_ops.resolve(self.market, self.operator, dispute_id, body, f"res-{dispute_id}")
                self.advance(901 + 4000)
                self.sweep()
            for lease_id in self.ids(leases_table, earnings_hold=["held"]):
                REACHED["earnings held"] += 1
                body = HeldDecisionIn(decision=decision, reason="the walk decides")
                # Refused (409) while the lease has not settled: more may still be paid into the hold.
                if self.attempt(Conflict, revocation.decide_held, self.market, self.operator, lease_id, body,
                                f"held-{lease_id}-{self.market.now()}") is not None:
                    REACHED["held earnings decided"] += 1
            identity.request_verification(self.market, self.who(name), "again")
            identity.decide(self.market, self.operator.actor, name, True, "reinstated")

        @invariant()
        def revoked_parties_do_not_trade(self):
            """A party that is not verified has no open demand and no lease waiting to start; a provider
            none running either."""
            def read(conn, now):
                out = []
                for account_id, role in conn.execute(select(accounts.c.id, accounts.c.role).where(
                        accounts.c.state != "verified", accounts.c.role.in_(("tenant", "provider")))).all():
                    side = leases_table.c.provider_id if role == "provider" else leases_table.c.tenant_id
                    live = ("offered", "accepted", "running") if role == "provider" else ("offered", "accepted")
                    out += [f"lease {i} of {role} {account_id}" for i in conn.execute(select(leases_table.c.id).where(
                        side == account_id, leases_table.c.state.in_(live))).scalars()]
                    out += [f"demand {i} of {account_id}" for i in conn.execute(select(demands_table.c.id).where(
                        demands_table.c.tenant_id == account_id, demands_table.c.state == "open")).scalars()]
                return out

            trading = self.market.read(read)
            assert trading == [], trading

        # -- the invariants, after every step --------------------------------------------------------

        @invariant()
        def market_invariants_hold(self):
            problems = self.market.read(lambda conn, now: invariants.check(conn))
            assert problems == [], problems

        @invariant()
        def statements_reconcile(self):
            # One party per step, in turn (a statement reads every entry; all four each step is slow).
            self.turn = getattr(self, "turn", -1) + 1
            for name in [("t1", "t2", "p1", "p2")[self.turn % 4]]:
                totals = statements.statement(self.market, self.who(name))["totals"]
                assert totals["reconciles"], (name, totals)
                if name in self.deposited:
                    assert totals["deposited"] == self.deposited[name]

    return MarketMachine


@pytest.mark.slow
# On PostgreSQL in the full tier (the fast tier's concurrency and API tests run the market there).
@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.full)])
def test_random_operations_keep_every_invariant(backend, url_factory):
    REACHED.clear()
    # Each example's store is a copy of the session's migrated template (SQLite), not migrated afresh.
    migrated = functools.partial(url_factory, migrated=True)
    run_state_machine_as_test(machine_for(migrated, backend), settings=SETTINGS)
    missed = [what for what in MUST_REACH if REACHED[what] == 0]
    # The derandomized walks are the same in every process (what they draw as sets is drawn as sorted lists:
    # a set's order followed the process's hash seed), yet inside the whole suite they have missed states
    # they reach alone, for a reason not found; and Hypothesis turns a random subset of rules off in each walk,
    # so one budget of ten walks misses a rare state about half the time. Coverage is a property of the walk
    # budget: further budgets of random walks (invariants checked in them too) until every state was reached.
    for extra in range(1, EXTRA_BUDGETS + 1):
        if not missed:
            break
        print(f"after {extra} budget(s) of walks, not yet reached: {missed}; another budget of random walks")
        run_state_machine_as_test(machine_for(migrated, backend),
                                  settings=settings(SETTINGS, derandomize=False, database=None))
        missed = [what for what in MUST_REACH if REACHED[what] == 0]
    print(dict(REACHED))
    assert not missed, f"the random walk never reached {missed}; it reached {dict(REACHED)}"
