"""Matching in the store: the rules of `matching` applied to open demands and open listings.

Matching runs when a demand is placed, a listing is created, an account is verified, and whenever
a lease releases capacity (`release_capacity`). It posts the demand's escrow at the listing's
price (the rest of the hold goes back to the tenant in the same step) and creates the lease. A
standing lease's escrow is its whole committed term at the committed period price (the listing's
period price less the reserved discount the term earns); its terms are copied from the listing.
"""

from __future__ import annotations

import json
from datetime import UTC

from sqlalchemy import Connection, and_, select, update

from runyard.market import escrow
from runyard.market.matching import DemandView, ListingView, best_listing
from runyard.market.pricing import cost
from runyard.market.requirement import Interconnect, Requirement
from runyard.market.rows import lock_demand
from runyard.market.schema import accounts, demands, leases, listings
from runyard.market.service import Market, audit
from runyard.market.standing import StandingDemandIn, discount_for
from runyard.market.states import SYSTEM, record_initial, transition
from runyard.market.states.demand import DEMAND, MATCHED, OPEN
from runyard.market.states.identity import VERIFIED
from runyard.market.states.lease import LEASE


def timestamp(req: Requirement) -> int:
    """A requirement's latest start as Unix seconds (UTC when it names no zone)."""
    latest = req.latest_start
    assert latest is not None
    return int((latest if latest.tzinfo else latest.replace(tzinfo=UTC)).timestamp())


def _view(row) -> ListingView:  # type: ignore[no-untyped-def]
    return ListingView(
        id=row["id"],
        kind=row["accelerator_kind"],
        price=row["price_per_device_hour"],
        interconnect_rank=Interconnect(row["interconnect"]).rank,
        interconnect_gbps=row["interconnect_gbps"],
        region=row["region"],
        jurisdiction=row["jurisdiction"],
        start_class=row["start_class"],
        max_queue_s=row["max_queue_s"],
        available_from=row["available_from"],
        available_until=row["available_until"],
        form=row["form"],
        memory_gib=row["memory_gib"],
        period_s=row["period_s"],
        min_term_periods=row["min_term_periods"],
        availability_bps=row["availability_bps"],
    )


def standing_of(demand: dict) -> StandingDemandIn | None:
    """A demand row's standing terms, or None for a block demand."""
    return StandingDemandIn.model_validate_json(demand["standing"]) if demand.get("standing") else None


def standing_prices(listing: dict, devices: int, standing: StandingDemandIn) -> tuple[int, int, int]:
    """(committed period price, renewal period price, discount bps) of a standing lease on `listing`."""
    base = cost(listing["price_per_device_hour"], devices, standing.period_s)
    discount = discount_for(json.loads(listing["reserved_terms"] or "[]"), standing.term_periods)
    return base - base * discount // 10_000, base, discount


def match_demand(conn: Connection, demand_id: int, now: int) -> int | None:
    """Match one open demand to the best listing, if any; returns the new lease id."""
    row = lock_demand(conn, demand_id)
    if row is None or row["state"] != OPEN:
        return None
    tenant_state = conn.execute(
        select(accounts.c.state).where(accounts.c.id == row["tenant_id"])
    ).scalar_one()
    if tenant_state != VERIFIED:
        return None
    req = Requirement.model_validate_json(row["requirement"])
    demand = DemandView.of(demand_id, req, row["max_price_per_device_hour"], standing_of(row))
    # A listing whose lease for this demand already failed (rejected, expired) is not offered again.
    tried = select(leases.c.listing_id).where(leases.c.demand_id == demand_id)
    candidates = (
        conn.execute(
            select(listings)
            .join(accounts, and_(accounts.c.id == listings.c.provider_id, accounts.c.state == VERIFIED))
            .where(
                listings.c.state == "open",
                listings.c.form == demand.form,
                listings.c.accelerator_kind.in_(sorted(demand.kinds)),
                listings.c.price_per_device_hour <= demand.max_price,
                listings.c.capacity - listings.c.reserved >= demand.device_count,
                listings.c.start_class.in_(sorted(demand.start_classes)),
                listings.c.available_until >= now + demand.span_s,
                listings.c.id.not_in(tried),
            )
        )
        .mappings()
        .all()
    )
    views = [_view(c) for c in candidates]
    free = {c["id"]: c["capacity"] - c["reserved"] for c in candidates}
    by_id = {c["id"]: c for c in candidates}
    while views:
        found = best_listing(demand, views, free, now)
        if found is None:
            return None
        listing, start = found
        # Reserve only if the devices are still free (a concurrent match may have taken them).
        taken = conn.execute(
            update(listings)
            .where(
                listings.c.id == listing.id,
                listings.c.state == "open",
                listings.c.capacity - listings.c.reserved >= demand.device_count,
            )
            .values(reserved=listings.c.reserved + demand.device_count)
        ).rowcount
        if taken == 1:
            return _create_lease(conn, row, by_id[listing.id], start, now)
        views = [v for v in views if v.id != listing.id]
    return None


def _create_lease(conn: Connection, demand: dict, listing: dict, start: int, now: int) -> int:
    config = Market.config(conn)
    price = listing["price_per_device_hour"]
    amount = cost(price, demand["device_count"], demand["duration_s"])
    terms: dict = {"form": "block"}
    standing = standing_of(demand)
    if standing is not None:
        period_price, renewal_price, discount = standing_prices(listing, demand["device_count"], standing)
        amount = period_price * standing.term_periods
        terms = {
            "form": "standing", "period_s": standing.period_s, "term_periods": standing.term_periods,
            "period_price": period_price, "renewal_price": renewal_price, "discount_bps": discount,
            "availability_bps": listing["availability_bps"], "credit_rule": listing["credit_rule"],
            "notice_s": listing["notice_s"],
        }  # fmt: skip
    lease_id = conn.execute(
        leases.insert().values(
            demand_id=demand["id"],
            listing_id=listing["id"],
            tenant_id=demand["tenant_id"],
            provider_id=listing["provider_id"],
            devices=demand["device_count"],
            price_per_device_hour=price,
            duration_s=demand["duration_s"],
            fee_bps=config["fee_bps"],
            escrow_account_id=demand["escrow_account_id"],
            escrow_amount=amount,
            state=LEASE.initial,
            created_at=now,
            accept_by=now + config["accept_timeout_s"],
            start_by=start + config["start_timeout_s"],
            last_seq=0,
            paid_provider=0,
            paid_fee=0,
            refunded=0,
            credited=0,
            **terms,
        )
    ).inserted_primary_key[0]
    escrow.fund(conn, demand["escrow_pending_id"], amount, lease_id, now)
    transition(
        conn,
        DEMAND,
        demand["id"],
        MATCHED,
        SYSTEM,
        f"matched to listing {listing['id']}",
        now,
        lease_id=lease_id,
    )
    record_initial(
        conn, LEASE, lease_id, SYSTEM, f"demand {demand['id']} matched listing {listing['id']}", now
    )
    audit(
        conn,
        SYSTEM,
        "lease.offer",
        f"lease:{lease_id}",
        now,
        demand=demand["id"],
        listing=listing["id"],
        escrow=amount,
    )
    return lease_id


def match_open_demands(conn: Connection, now: int, listing_id: int | None = None) -> list[int]:
    """Try every open demand, oldest first (time priority); returns the leases made. With
    `listing_id`, only the demands that listing could serve are tried."""
    query = select(demands.c.id).where(demands.c.state == OPEN).order_by(demands.c.created_at, demands.c.id)
    if listing_id is not None:
        listing = conn.execute(select(listings).where(listings.c.id == listing_id)).mappings().one()
        query = query.where(
            demands.c.form == listing["form"],
            demands.c.kinds.contains(f",{listing['accelerator_kind']},"),
            demands.c.max_price_per_device_hour >= listing["price_per_device_hour"],
            demands.c.device_count <= listing["capacity"] - listing["reserved"],
        )
    made = []
    for demand_id in conn.execute(query).scalars().all():
        lease_id = match_demand(conn, demand_id, now)
        if lease_id is not None:
            made.append(lease_id)
    return made


def release_capacity(conn: Connection, lease: dict, now: int) -> list[int]:
    """Give a lease's devices back to its listing and offer them to the demands waiting for them
    (every end of a lease that held capacity comes through here). Returns the leases made."""
    conn.execute(
        update(listings)
        .where(listings.c.id == lease["listing_id"])
        .values(reserved=listings.c.reserved - lease["devices"])
    )
    return match_open_demands(conn, now, listing_id=lease["listing_id"])
