"""The market's invariants, stated once, checked by `runyard market admin audit` on a live store and
by the tests after every random step.

 1. zero_sum            the posted balances of all ledger accounts sum to zero, and pending debits
                        equal pending credits: money is never created or destroyed.
 2. counters            every account's counters equal what its transfers add up to.
 3. no_negative         no account flagged no_negative has debits (posted + pending) above its credits.
 4. pending_once        every post or void resolves a pending transfer, at most once, for no more
                        than it held (a void for exactly what it held).
 5. settled_once        each lease's payments to provider and fees and its refunds, as transfers,
                        equal what the lease records, never exceed its escrow, and a settled lease
                        paid exactly the charge for its accepted usage: nothing is settled twice.
 6. closed_returned     every closed lease (settled, rejected, expired, cancelled) and every demand
                        that ended without a lease has an empty escrow.
 7. demand_escrow       an open demand's hold is pending; a matched demand's hold was posted; a
                        cancelled or expired demand's hold was voided, or posted to a lease that
                        then closed (its escrow returned by that lease).
 8. capacity            a listing's reserved devices equal the devices of its active leases.
 9. transitions         every entity's state is the last state its transition log records.
10. idempotency         every stored idempotency key has its response.
11. periods             a standing lease's billing periods follow each other without gap or overlap
                        from its start, each as long as its period; a running lease runs exactly its
                        last period, ending where its window does; the lease's payments and credits
                        are the sums of its periods'; every settled period's figures are what its
                        accepted availability records give (standing.period_figures), and a settled
                        lease has every period settled.
12. held_earnings       a lease's held account (a revoked provider's share, revocation.py) exists only
                        for a lease whose earnings are held or were decided; it holds what settlement
                        paid into it less what the decision moved out, and is empty once decided.
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import Connection, func, select

from runyard.market.periods import figures_of, periods_of
from runyard.market.schema import (
    accounts,
    demands,
    disputes,
    idempotency_keys,
    lease_periods,
    leases,
    ledger_accounts,
    listings,
    transfers,
    transitions,
    usage_records,
)
from runyard.market.service import Market, Principal
from runyard.market.settlement import position
from runyard.market.states.demand import CANCELLED as D_CANCELLED
from runyard.market.states.demand import EXPIRED as D_EXPIRED
from runyard.market.states.demand import MATCHED, OPEN
from runyard.market.states.lease import ACTIVE, CLOSED, SETTLED
from runyard.market.states.period import RUNNING as PERIOD_RUNNING
from runyard.market.states.period import SETTLED as PERIOD_SETTLED

FAR_FUTURE = 2**62


def check(conn: Connection) -> list[str]:
    """Every violated invariant, as one line each; empty when the store is sound."""
    problems: list[str] = []
    accts = {a["id"]: dict(a) for a in conn.execute(select(ledger_accounts)).mappings()}
    xfers = [dict(t) for t in conn.execute(select(transfers).order_by(transfers.c.id)).mappings()]
    by_id = {t["id"]: t for t in xfers}
    resolution = {t["pending_id"]: t for t in xfers if t["pending_id"] is not None}

    # 1. zero_sum
    posted = sum(a["credits_posted"] - a["debits_posted"] for a in accts.values())
    pend = sum(a["credits_pending"] - a["debits_pending"] for a in accts.values())
    if posted != 0 or pend != 0:
        problems.append(f"zero_sum: posted balances sum to {posted}, pending to {pend}")

    # 2. counters
    expect: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for t in xfers:
        d, c, amount = t["debit_account_id"], t["credit_account_id"], t["amount"]
        if t["kind"] in ("single", "post"):
            expect[d]["debits_posted"] += amount
            expect[c]["credits_posted"] += amount
        if t["kind"] == "pending" and t["id"] not in resolution:
            expect[d]["debits_pending"] += amount
            expect[c]["credits_pending"] += amount
    for acc_id, acc in accts.items():
        for counter in ("debits_pending", "debits_posted", "credits_pending", "credits_posted"):
            if acc[counter] != expect[acc_id][counter]:
                problems.append(
                    f"counters: {acc['code']}.{counter} is {acc[counter]}, transfers say {expect[acc_id][counter]}"
                )

    # 3. no_negative
    for acc in accts.values():
        if acc["no_negative"] and acc["debits_posted"] + acc["debits_pending"] > acc["credits_posted"]:
            problems.append(f"no_negative: {acc['code']} is overdrawn")

    # 4. pending_once
    seen: set[int] = set()
    for t in xfers:
        if t["kind"] not in ("post", "void"):
            continue
        pending = by_id.get(t["pending_id"])
        if t["pending_id"] in seen:
            problems.append(f"pending_once: pending transfer {t['pending_id']} resolved twice")
        seen.add(t["pending_id"])
        if pending is None or pending["kind"] != "pending":
            problems.append(
                f"pending_once: transfer {t['id']} resolves {t['pending_id']}, which is not pending"
            )
        elif t["kind"] == "post" and t["amount"] > pending["amount"]:
            problems.append(f"pending_once: post {t['id']} moved {t['amount']} of a {pending['amount']} hold")
        elif t["kind"] == "void" and t["amount"] != pending["amount"]:
            problems.append(
                f"pending_once: void {t['id']} released {t['amount']} of a {pending['amount']} hold"
            )

    # 5. settled_once and 6. closed_returned (leases)
    paid: dict[tuple[int, str], int] = defaultdict(int)
    for t in xfers:
        if t["lease_id"] is not None and t["kind"] == "single":
            paid[(t["lease_id"], t["reason"])] += t["amount"]
    for lease in conn.execute(select(leases)).mappings():
        lid = lease["id"]
        for reason, column in (
            ("settle_provider", "paid_provider"),
            ("settle_fee", "paid_fee"),
            ("escrow_refund", "refunded"),
            ("sla_credit", "credited"),
        ):
            if paid[(lid, reason)] != lease[column]:
                problems.append(
                    f"settled_once: lease {lid} {column} is {lease[column]}, its transfers {paid[(lid, reason)]}"
                )
        out = lease["paid_provider"] + lease["paid_fee"] + lease["refunded"] + lease["credited"]
        if out > lease["escrow_amount"]:
            problems.append(
                f"settled_once: lease {lid} paid out {out} of an escrow of {lease['escrow_amount']}"
            )
        escrow = accts[lease["escrow_account_id"]]
        if escrow["credits_posted"] - escrow["debits_posted"] != lease["escrow_amount"] - out:
            problems.append(
                f"settled_once: lease {lid} escrow holds {escrow['credits_posted'] - escrow['debits_posted']}, expected {lease['escrow_amount'] - out}"
            )
        if lease["state"] in CLOSED and (
            escrow["credits_posted"] != escrow["debits_posted"] or escrow["credits_pending"]
        ):
            problems.append(f"closed_returned: lease {lid} is {lease['state']} but its escrow is not empty")
        if lease["form"] == "standing":
            problems += _periods(conn, dict(lease))
        elif lease["state"] == SETTLED:
            pos = position(conn, dict(lease), FAR_FUTURE)
            if pos["held_records"] or pos["charge"] != lease["paid_provider"] + lease["paid_fee"]:
                problems.append(
                    f"settled_once: settled lease {lid} paid {lease['paid_provider'] + lease['paid_fee']}, usage charges {pos['charge']}"
                )

    # 6 and 7. demands
    closed_leases = dict(
        conn.execute(select(leases.c.id, leases.c.state).where(leases.c.state.in_(CLOSED))).all()
    )
    for demand in conn.execute(select(demands)).mappings():
        did, pid = demand["id"], demand["escrow_pending_id"]
        resolved = resolution.get(pid)
        state = demand["state"]
        if state == OPEN and resolved is not None:
            problems.append(f"demand_escrow: open demand {did} has its hold {resolved['kind']}ed")
        if state == MATCHED and (resolved is None or resolved["kind"] != "post"):
            problems.append(f"demand_escrow: matched demand {did} hold was not posted")
        if state in (D_CANCELLED, D_EXPIRED) and resolved is not None and resolved["kind"] == "post":
            lease_state = closed_leases.get(resolved["lease_id"])
            if lease_state is None:
                problems.append(f"demand_escrow: {state} demand {did} hold went to lease {resolved['lease_id']}, not closed")
        elif state in (D_CANCELLED, D_EXPIRED):
            escrow = accts[demand["escrow_account_id"]]
            if resolved is None or resolved["kind"] != "void":
                problems.append(f"demand_escrow: {state} demand {did} hold was not voided")
            if escrow["credits_posted"] or escrow["credits_pending"]:
                problems.append(f"closed_returned: {state} demand {did} escrow is not empty")

    # 8. capacity
    active = dict(
        conn.execute(
            select(leases.c.listing_id, func.sum(leases.c.devices))
            .where(leases.c.state.in_(ACTIVE))
            .group_by(leases.c.listing_id)
        ).all()
    )
    for listing in conn.execute(select(listings)).mappings():
        want = int(active.get(listing["id"], 0) or 0)
        if listing["reserved"] != want or not 0 <= listing["reserved"] <= listing["capacity"]:
            problems.append(
                f"capacity: listing {listing['id']} reserves {listing['reserved']}, active leases hold {want}"
            )

    # 9. transitions
    last: dict[tuple[str, int], str] = {}
    for entity, entity_id, to_state in conn.execute(
        select(transitions.c.entity, transitions.c.entity_id, transitions.c.to_state).order_by(
            transitions.c.id
        )
    ).all():
        last[(entity, entity_id)] = to_state
    for entity, table in (
        ("identity", accounts), ("demand", demands), ("lease", leases), ("listing", listings),
        ("record", usage_records), ("dispute", disputes), ("period", lease_periods),
    ):  # fmt: skip
        for row_id, state in conn.execute(select(table.c.id, table.c.state)).all():
            if last.get((entity, row_id)) != state:
                problems.append(
                    f"transitions: {entity} {row_id} is {state}, its log ends at {last.get((entity, row_id))}"
                )

    # 12. held_earnings
    holds = dict(conn.execute(select(leases.c.id, leases.c.earnings_hold)).all())
    for acc in accts.values():
        if acc["kind"] != "held_earnings":
            continue
        lid = int(acc["code"].rsplit(":", 1)[1])
        into = sum(t["amount"] for t in xfers if t["credit_account_id"] == acc["id"] and t["reason"] == "settle_provider")
        out = sum(t["amount"] for t in xfers if t["debit_account_id"] == acc["id"])
        balance = acc["credits_posted"] - acc["debits_posted"]
        if holds.get(lid) is None:
            problems.append(f"held_earnings: {acc['code']} exists but lease {lid}'s earnings are not held")
        if balance != into - out or (holds.get(lid) in ("released", "refunded") and balance):
            problems.append(f"held_earnings: {acc['code']} holds {balance} (paid in {into}, out {out}) for a lease "
                            f"whose earnings are {holds.get(lid)}")

    # 10. idempotency
    missing = conn.execute(select(func.count()).where(idempotency_keys.c.response == "")).scalar_one()
    if missing:
        problems.append(f"idempotency: {missing} keys have no stored response")
    return problems


def _periods(conn: Connection, lease: dict) -> list[str]:
    """Invariant 11 for one standing lease."""
    problems, lid = [], lease["id"]
    rows = periods_of(conn, lid)
    if lease["started_at"] is None:
        return [f"periods: lease {lid} has periods but never started"] if rows else []
    window = Market.config(conn)["dispute_window_s"]
    for k, period in enumerate(rows, start=1):
        begin = lease["started_at"] + (k - 1) * lease["period_s"]
        if (period["seq"], period["period_start"], period["period_end"]) != (k, begin, begin + lease["period_s"]):
            problems.append(f"periods: lease {lid} period {period['seq']} is [{period['period_start']}, "
                            f"{period['period_end']}), expected period {k} [{begin}, {begin + lease['period_s']})")
        if period["state"] == PERIOD_SETTLED:
            figures, held = figures_of(conn, lease, period, FAR_FUTURE, window)
            stored = (period["charge"], period["credit"], period["paid_provider"], period["paid_fee"], period["refunded"])
            if figures is None or stored != (figures.charge, figures.credit, figures.provider, figures.fee, figures.refund):
                problems.append(f"periods: lease {lid} period {k} settled as {stored}, its records give "
                                f"{None if figures is None else figures.to_json()}")
    running = [p for p in rows if p["state"] == PERIOD_RUNNING]
    if lease["state"] == "running" and (len(running) != 1 or running[0] is not rows[-1]
                                        or rows[-1]["period_end"] != lease["window_end"]):
        problems.append(f"periods: running lease {lid} must run exactly its last period, to its window's end")
    if lease["state"] != "running" and running:
        problems.append(f"periods: lease {lid} is {lease['state']} with a period still running")
    for column, key in (("paid_provider", "paid_provider"), ("paid_fee", "paid_fee"), ("credited", "credit")):
        total = sum(p[key] or 0 for p in rows)
        if total != lease[column]:
            problems.append(f"periods: lease {lid} {column} is {lease[column]}, its periods sum to {total}")
    if lease["state"] == SETTLED and any(p["state"] != PERIOD_SETTLED for p in rows):
        problems.append(f"periods: settled lease {lid} has a period not settled")
    return problems


def audit_market(market: Market, principal: Principal | None = None) -> dict:
    """Run every check in one consistent snapshot; returns {'ok', 'violations', 'counts'}.
    `principal`: the operator asking over the API, whose verification is read in that snapshot."""

    def tx(conn: Connection, now: int) -> dict:
        if principal is not None:
            principal.require_verified("audit the market", conn, lock=False)
        problems = check(conn)
        counts = {
            name: conn.execute(select(func.count()).select_from(table)).scalar_one()
            for name, table in (
                ("accounts", accounts),
                ("transfers", transfers),
                ("leases", leases),
                ("demands", demands),
            )
        }
        return {"ok": not problems, "violations": problems, "counts": counts}

    return market.read(tx)
