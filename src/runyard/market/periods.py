"""A standing lease's billing periods in the store: opening, renewal (or the end), and settlement.

Period k of a lease runs [started_at + (k-1)·P, started_at + k·P). The first opens when the lease
starts. When a period's end passes, the market (the sweep, or a settlement that finds it so)
closes it and either renews the lease -- the next period opens; inside the committed term it was
prepaid with the lease's escrow, after it the tenant's available balance funds it at the renewal
price -- or ends it at that close (`window_closed`, with the reason: the notice given, the renewal
the tenant cannot fund, the listing that no longer offers another period, or `no_availability`: the
provider reported no availability record in the period that just closed, so that a silent provider
never locks another period's price of the tenant's money; inside the committed term the periods are
prepaid, so nothing more is locked and the lease runs on). A lease terminated inside a period ends
that period there (`ended_at`).

A closed period settles once its reports are closed (its end plus the dispute window has passed)
and none of its availability records is held: `standing.period_figures` from the accepted available
device-seconds, paid out of the lease's escrow -- the provider and the market's fee for the time
available, the tenant's credit under the listing's rule, and the rest of the period's escrow back to
the tenant. When the lease has ended and every period is settled, whatever the escrow still holds
(committed periods that never ran) returns too, and the lease is settled.
"""

from __future__ import annotations

import json

from sqlalchemy import Connection, func, select, update

from runyard.market import escrow
from runyard.market.acceptance import tally
from runyard.market.errors import InvalidTransition, UsageRejected
from runyard.market.matcher import release_capacity
from runyard.market.rows import lock_lease
from runyard.market.schema import lease_periods, leases, listings, usage_records
from runyard.market.service import Market, audit
from runyard.market.standing import PeriodFigures, period_figures
from runyard.market.states import SYSTEM, Actor, record_initial, transition
from runyard.market.states.lease import LEASE, RUNNING, SETTLEABLE, SETTLED, WINDOW_CLOSED
from runyard.market.states.period import CLOSED, PERIOD
from runyard.market.states.period import RUNNING as PERIOD_RUNNING
from runyard.market.states.period import SETTLED as PERIOD_SETTLED


def open_period(conn: Connection, lease: dict, seq: int, start: int, end: int, funding: str, now: int) -> int:
    """Create period `seq` of a standing lease, running, at its price."""
    price = lease["period_price"] if funding == "prepaid" else lease["renewal_price"]
    period_id = conn.execute(
        lease_periods.insert().values(
            lease_id=lease["id"], seq=seq, period_start=start, period_end=end, price=price, funding=funding,
            state=PERIOD_RUNNING, paid_provider=0, paid_fee=0, refunded=0,
        )
    ).inserted_primary_key[0]  # fmt: skip
    record_initial(conn, PERIOD, period_id, SYSTEM, f"period {seq} of lease {lease['id']} ({funding})", now)
    return period_id


def periods_of(conn: Connection, lease_id: int) -> list[dict]:
    rows = conn.execute(select(lease_periods).where(lease_periods.c.lease_id == lease_id)
                        .order_by(lease_periods.c.seq)).mappings()
    return [dict(r) for r in rows]


def period_for(conn: Connection, lease: dict, start: int, end: int, what: str) -> dict:
    """The period an interval [start, end) lies in; UsageRejected naming the periods when it lies in
    none (before the lease, after its window, or across a period's close)."""
    found = [p for p in periods_of(conn, lease["id"]) if p["period_start"] <= start < ran_until(p)]
    if not found or end > ran_until(found[0]):
        shown = ", ".join(f"{p['seq']}: [{p['period_start']}, {ran_until(p)})" for p in periods_of(conn, lease["id"])[-3:])
        across = f"; it crosses the close of period {found[0]['seq']} at {ran_until(found[0])}: report each period's part " \
                 "on its own" if found else ""
        raise UsageRejected(f"{what} [{start}, {end}) lies outside every period of lease {lease['id']} "
                            f"(latest periods {shown or 'none: it has not started'}){across}",
                            lease=lease["id"], interval=[start, end])
    return found[0]


def ran_until(period: dict) -> int:
    """When a period stopped running: its end, or where the lease ended inside it."""
    return period["ended_at"] if period["ended_at"] is not None else period["period_end"]


def end_inside(conn: Connection, lease_id: int, now: int) -> None:
    """The lease ended at `now` (terminated): its running period ends there and closes."""
    for period in periods_of(conn, lease_id):
        if period["state"] == PERIOD_RUNNING:
            transition(conn, PERIOD, period["id"], CLOSED, SYSTEM, "the lease was terminated inside it", now,
                       ended_at=max(period["period_start"], min(now, period["period_end"])))


# -- renewal --------------------------------------------------------------------------------------


def _why_it_ends(conn: Connection, lease: dict, closing: dict, close: int, next_seq: int,
                 reportable: bool) -> tuple[str, str] | None:
    """(end reason code, why) when the lease ends at `close` instead of renewing; None to renew.
    `reportable`: the closing period was open before this renewal ran (one opened by a catch-up in the
    same call could take no record, so its silence says nothing)."""
    if lease["ends_at"] is not None and lease["ends_at"] <= close:
        side = (lease["notice_by"] or "tenant").split(":")[0]
        return (f"{side}_request" if side in ("tenant", "provider") else "operator_action",
                f"notice given by {lease['notice_by']}: the lease ends at {close}")
    if next_seq <= lease["term_periods"]:
        return None  # inside the committed term: prepaid, the provider committed to it
    listing = conn.execute(select(listings).where(listings.c.id == lease["listing_id"])).mappings().one()
    if listing["state"] != "open" or close + lease["period_s"] > listing["available_until"]:
        return "capacity_unavailable", f"listing {listing['id']} offers no period after {close}"
    reported = conn.execute(select(func.count()).where(usage_records.c.period_id == closing["id"])).scalar_one()
    if reportable and not reported:
        return "no_availability", (f"the provider reported no availability in period {closing['seq']} "
                                   f"[{closing['period_start']}, {close}); period {next_seq} is not renewed")
    short = escrow.shortfall(conn, lease["tenant_id"], lease["renewal_price"])
    if short:
        return "nonpayment", (f"renewing for period {next_seq} needs {lease['renewal_price']}; the tenant's "
                              f"available balance is {short} short")
    return None


def renew_or_close(conn: Connection, lease: dict, now: int) -> int:
    """Close every period of a running standing lease whose end has passed, renewing the lease into
    the next one or ending it at that close (see the module docstring). `lease` is locked by the
    caller. Returns how many periods closed.

    A sweep that runs late catches up the committed term's prepaid periods at once, but renews past the
    term one period per call: the period it opened could take no availability record yet, so the next
    call judges it by the no-availability rule. A clock that jumps a year thus never renews (and locks)
    a year of periods in one call, and one call's work is bounded by the term."""
    closed = 0
    current = next(p for p in reversed(periods_of(conn, lease["id"])) if p["state"] == PERIOD_RUNNING) \
        if lease["state"] == RUNNING and lease["window_end"] <= now else None
    while lease["state"] == RUNNING and lease["window_end"] <= now:
        seq = current["seq"] + 1
        if closed and seq > lease["term_periods"]:
            break  # past the term: the next call judges the period this one opened
        close = lease["window_end"]
        transition(conn, PERIOD, current["id"], CLOSED, SYSTEM, "its end passed", now)
        closed += 1
        ending = _why_it_ends(conn, lease, current, close, seq, reportable=closed == 1)
        if ending is not None:
            code, why = ending
            transition(conn, LEASE, lease["id"], WINDOW_CLOSED, SYSTEM, why, now, end_reason=code)
            release_capacity(conn, lease, now)
            audit(conn, SYSTEM, "lease.standing_end", f"lease:{lease['id']}", now, reason=code, at=close)
            lease["state"] = WINDOW_CLOSED
            break
        funding = "prepaid" if seq <= lease["term_periods"] else "renewal"
        if funding == "renewal":
            escrow.top_up(conn, lease, lease["renewal_price"], SYSTEM, now)
            audit(conn, SYSTEM, "lease.renew", f"lease:{lease['id']}", now, period=seq, funded=lease["renewal_price"])
        current = {"id": open_period(conn, lease, seq, close, close + lease["period_s"], funding, now), "seq": seq}
        conn.execute(update(leases).where(leases.c.id == lease["id"]).values(window_end=close + lease["period_s"]))
        lease.update(conn.execute(select(leases).where(leases.c.id == lease["id"])).mappings().one())
    return closed


# -- settlement -----------------------------------------------------------------------------------


def figures_of(conn: Connection, lease: dict, period: dict, now: int, window: int) -> tuple[PeriodFigures | None, int]:
    """A period's figures as of `now` (None while a record in it is held), and its held records."""
    accepted, _held, held_records = tally(conn, lease["id"], now, window, period_id=period["id"])
    if held_records:
        return None, held_records
    start = period["period_start"]
    figures = period_figures(period["price"], lease["devices"], lease["period_s"], ran_until(period) - start, accepted,
                             lease["availability_bps"], json.loads(lease["credit_rule"] or "[]"), lease["fee_bps"])
    return figures, 0


def _settle_period(conn: Connection, lease: dict, period: dict, figures: PeriodFigures, actor: Actor, now: int) -> int:
    escrow.pay(conn, lease, figures.provider, figures.fee, actor, now)
    escrow.give_back(conn, lease, figures.credit, "sla_credit", "credited", actor, now)
    escrow.give_back(conn, lease, figures.refund, "escrow_refund", "refunded", actor, now)
    conn.execute(update(leases).where(leases.c.id == lease["id"]).values(
        paid_provider=leases.c.paid_provider + figures.provider, paid_fee=leases.c.paid_fee + figures.fee))
    transition(
        conn, PERIOD, period["id"], PERIOD_SETTLED, SYSTEM, f"settled by {actor}", now,
        available_device_seconds=figures.available_device_seconds, availability_bps=figures.availability_bps,
        charge=figures.charge, credit=figures.credit, paid_provider=figures.provider, paid_fee=figures.fee,
        refunded=figures.refund, settled_at=now,
    )  # fmt: skip
    audit(conn, actor, "period.settle", f"lease:{lease['id']}", now, period=period["seq"], **figures.to_json())
    return figures.provider + figures.fee + figures.credit + figures.refund


def settle_standing(conn: Connection, lease_id: int, actor: Actor, now: int) -> int:
    """Settle every period of a standing lease that can be (see the module docstring), and the lease
    itself once it has ended and all are. Returns the money moved."""
    lease = lock_lease(conn, lease_id, None)
    if lease["state"] == SETTLED:
        return 0
    if lease["state"] != RUNNING and lease["state"] not in SETTLEABLE:
        raise InvalidTransition(f"lease {lease_id} is {lease['state']}; it settles period by period once it runs")
    window = Market.config(conn)["dispute_window_s"]
    moved = 0
    pending = 0
    for period in periods_of(conn, lease_id):
        if period["state"] == PERIOD_SETTLED:
            continue
        if period["state"] == PERIOD_RUNNING or now <= ran_until(period) + window:
            pending += 1
            continue
        figures, _ = figures_of(conn, lease, period, now, window)
        if figures is None:
            pending += 1
            continue
        moved += _settle_period(conn, lease, period, figures, actor, now)
    if lease["state"] in SETTLEABLE and not pending:
        moved += escrow.refund(conn, lease, actor, now)  # committed periods that never ran
        transition(conn, LEASE, lease_id, SETTLED, SYSTEM, f"settled by {actor}: every period settled", now)
        conn.execute(update(listings).where(listings.c.id == lease["listing_id"])
                     .values(leases_completed=listings.c.leases_completed + 1))
        audit(conn, actor, "lease.settled", f"lease:{lease_id}", now)
    return moved


def standing_summary(conn: Connection, lease: dict, now: int) -> dict:
    """A standing lease's settlement so far: the lease's totals and each period's figures."""
    window = Market.config(conn)["dispute_window_s"]
    accepted, held, held_records = tally(conn, lease["id"], now, window)
    return {
        "lease_id": lease["id"], "state": lease["state"], "escrow_amount": lease["escrow_amount"],
        "paid_provider": lease["paid_provider"], "paid_fee": lease["paid_fee"], "refunded": lease["refunded"],
        "credited": lease["credited"], "escrow_remaining": escrow.available(conn, lease),
        "accepted_device_seconds": accepted, "held_device_seconds": held, "held_records": held_records,
        "charge": lease["paid_provider"] + lease["paid_fee"] + lease["credited"], "fee": lease["paid_fee"],
        "periods": periods_of(conn, lease["id"]),
    }  # fmt: skip


def unsettled_count(conn: Connection, lease_id: int) -> int:
    return conn.execute(select(func.count()).where(lease_periods.c.lease_id == lease_id,
                                                   lease_periods.c.state != PERIOD_SETTLED)).scalar_one()
