"""Settlement: pay accepted usage from escrow, hold what is disputed, return the rest.

Settlement computes, from the records as they stand, what the provider and the market *should* have
been paid so far, and moves only the difference from what was paid before. Running it twice
therefore moves nothing the second time, and it is safe to run it whenever anything changes (a
window closes, a dispute window passes, a dispute is resolved).

A record counts as accepted by the rule in `acceptance`. The charge is accepted device-seconds x
price / 3600, rounded down (in the tenant's favour); the fee is charge x fee_bps / 10000, rounded
down, taken out of the charge. When nothing is held and no record can still arrive, the remainder
returns to the tenant and the lease is settled.

A standing lease settles per billing period instead (`periods.settle_standing`): each period, once
its reports are closed and nothing in it is held, pays for the time available, credits the tenant
under the listing's rule and returns the rest of its escrow; the lease is settled when it has ended
and every period is.
"""

from __future__ import annotations

from sqlalchemy import Connection, select, update

from runyard.market import escrow, periods
from runyard.market.acceptance import tally
from runyard.market.errors import InvalidTransition
from runyard.market.matcher import release_capacity
from runyard.market.rows import lock_lease
from runyard.market.schema import leases, listings
from runyard.market.service import Market, Principal, audit
from runyard.market.states import Actor, transition
from runyard.market.states.lease import LEASE, RUNNING, SETTLEABLE, SETTLED, WINDOW_CLOSED


def charge_for(device_seconds: int, price_per_device_hour: int) -> int:
    return device_seconds * price_per_device_hour // 3600


def fee_for(charge: int, fee_bps: int) -> int:
    return charge * fee_bps // 10_000


def position(conn: Connection, lease: dict, now: int) -> dict:
    """What the lease owes as of `now`: accepted and held device-seconds, charge and fee."""
    window = Market.config(conn)["dispute_window_s"]
    accepted, held, held_records = tally(conn, lease["id"], now, window)
    charge = charge_for(accepted, lease["price_per_device_hour"])
    fee = fee_for(charge, lease["fee_bps"])
    reports_closed = lease["window_end"] is not None and now > lease["window_end"] + window
    return {
        "accepted_device_seconds": accepted,
        "held_device_seconds": held,
        "held_records": held_records,
        "charge": charge,
        "fee": fee,
        "provider_share": charge - fee,
        "final": held_records == 0 and reports_closed,
    }


def settle_in_tx(conn: Connection, lease_id: int, actor: Actor, now: int) -> dict:
    """Bring a lease's payments up to date inside the caller's transaction (see module docstring)."""
    lease = lock_lease(conn, lease_id, None)
    if lease["form"] == "standing":
        periods.renew_or_close(conn, lease, now)
        moved = periods.settle_standing(conn, lease_id, actor, now)
        return summary(conn, lease_id, now, moved=moved)
    if lease["state"] == RUNNING and lease["window_end"] <= now:
        # The window is over even if no sweep has said so yet: close it first, as the sweep would.
        transition(conn, LEASE, lease_id, WINDOW_CLOSED, Actor("system"), "window ended", now)
        release_capacity(conn, lease, now)
        lease["state"] = WINDOW_CLOSED
    if lease["state"] == SETTLED:
        return summary(conn, lease_id, now, moved=0)
    if lease["state"] not in SETTLEABLE:
        raise InvalidTransition(f"lease {lease_id} is {lease['state']}; it settles after its window closes")
    pos = position(conn, lease, now)
    to_provider = pos["provider_share"] - lease["paid_provider"]
    to_fees = pos["fee"] - lease["paid_fee"]
    if to_provider < 0 or to_fees < 0:  # accepted usage only grows; this would be a bug, never a refund
        raise AssertionError(
            f"lease {lease_id}: settlement would move money backwards ({to_provider}, {to_fees})"
        )
    escrow.pay(conn, lease, to_provider, to_fees, actor, now)
    if to_provider or to_fees:
        conn.execute(
            update(leases)
            .where(leases.c.id == lease_id)
            .values(paid_provider=pos["provider_share"], paid_fee=pos["fee"])
        )
        audit(
            conn, actor, "lease.settle_payment", f"lease:{lease_id}", now, provider=to_provider, fee=to_fees
        )
    moved = to_provider + to_fees
    if pos["final"]:
        moved += escrow.refund(conn, lease, actor, now)
        transition(conn, LEASE, lease_id, SETTLED, Actor("system"), f"settled by {actor}", now)
        conn.execute(
            update(listings)
            .where(listings.c.id == lease["listing_id"])
            .values(leases_completed=listings.c.leases_completed + 1)
        )
        audit(conn, actor, "lease.settled", f"lease:{lease_id}", now)
    return summary(conn, lease_id, now, moved=moved)


def summary(conn: Connection, lease_id: int, now: int, moved: int) -> dict:
    lease = dict(conn.execute(select(leases).where(leases.c.id == lease_id)).mappings().one())
    if lease["form"] == "standing":
        return {**periods.standing_summary(conn, lease, now), "moved_now": moved}
    pos = position(conn, lease, now)
    return {
        "lease_id": lease_id,
        "state": lease["state"],
        "escrow_amount": lease["escrow_amount"],
        "paid_provider": lease["paid_provider"],
        "paid_fee": lease["paid_fee"],
        "refunded": lease["refunded"],
        "credited": lease["credited"],
        "escrow_remaining": escrow.available(conn, lease),
        "moved_now": moved,
        **{
            k: pos[k]
            for k in ("accepted_device_seconds", "held_device_seconds", "held_records", "charge", "fee")
        },
    }


def settle(market: Market, principal: Principal, lease_id: int, key: str | None) -> dict:
    """Settle a lease on request of a party or an operator (idempotent on `key`, and by design)."""

    def tx(conn: Connection, now: int) -> dict:
        lock_lease(conn, lease_id, principal)  # ownership
        return settle_in_tx(conn, lease_id, principal.actor, now)

    return market.idempotent(principal, key, "lease.settle", {"lease_id": lease_id}, tx)
