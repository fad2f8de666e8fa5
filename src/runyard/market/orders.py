"""Listings (providers) and demands (tenants), and matching them in the store.

A demand is placed with its escrow: max price x devices x duration is reserved from the tenant's
available balance as a pending transfer before anything else happens, so a provider only ever sees
demands backed by real money. Matching runs when a demand is placed, a listing is created, an
account is verified or capacity is released; it posts the escrow at the listing's price (the rest of
the hold goes back to the tenant in the same step) and creates the lease.
"""

from __future__ import annotations

import json
from datetime import UTC

from sqlalchemy import Connection, and_, select, update

from runyard.market import ledger
from runyard.market.errors import BadRequest, NotFound
from runyard.market.jobs import JOB_COLUMNS, job_columns, job_of
from runyard.market.machines import SYSTEM, record_initial, transition
from runyard.market.machines.demand import CANCELLED, DEMAND, MATCHED, OPEN
from runyard.market.machines.identity import VERIFIED
from runyard.market.machines.lease import LEASE
from runyard.market.machines.listing import LISTING, WITHDRAWN
from runyard.market.matching import DemandView, ListingView, best_listing
from runyard.market.models import DemandIn, ListingIn
from runyard.market.requirement import Interconnect, Requirement
from runyard.market.schema import accounts, demands, leases, listings
from runyard.market.service import Market, Principal, audit


def cost(price_per_device_hour: int, devices: int, seconds: int) -> int:
    """Price of `devices` for `seconds`, rounded up to a whole minor unit."""
    return -(-price_per_device_hour * devices * seconds // 3600)


def listing_json(row) -> dict:  # type: ignore[no-untyped-def]
    return dict(row)


def demand_json(row, with_job: bool = True) -> dict:  # type: ignore[no-untyped-def]
    """A demand as the API shows it; `job` only to its tenant (with_job), never to an operator."""
    hidden = ("requirement", "kinds", *JOB_COLUMNS)
    out = {k: v for k, v in dict(row).items() if k not in hidden}
    out["requirement"] = json.loads(row["requirement"])
    if with_job:
        out["job"] = job_of(row)
    return out


# -- listings --------------------------------------------------------------------------------------


def create_listing(market: Market, principal: Principal, body: ListingIn, key: str | None = None) -> dict:
    """A verified provider offers capacity; open demands that fit are matched at once.

    Idempotent on `key` when one is given (a listing moves no money, so a key is optional)."""
    principal.require_role("provider")
    principal.require_verified("list capacity")

    def tx(conn: Connection, now: int) -> dict:
        available_from = body.available_from if body.available_from is not None else now
        if body.available_until <= now:
            raise BadRequest("available_until is in the past")
        listing_id = conn.execute(
            listings.insert().values(
                provider_id=principal.id,
                accelerator_kind=body.accelerator_kind,
                devices_per_node=body.devices_per_node,
                node_count=body.node_count,
                capacity=body.devices_per_node * body.node_count,
                reserved=0,
                interconnect=str(body.interconnect),
                interconnect_gbps=body.interconnect_gbps,
                region=body.region,
                jurisdiction=body.jurisdiction,
                price_per_device_hour=body.price_per_device_hour,
                available_from=available_from,
                available_until=body.available_until,
                start_class=str(body.start_class),
                max_queue_s=body.max_queue_s,
                scheduler_kind=body.scheduler_kind,
                state="open",
                leases_expired=0,
                leases_completed=0,
                created_at=now,
            )
        ).inserted_primary_key[0]
        record_initial(conn, LISTING, listing_id, principal.actor, "listed", now)
        audit(conn, principal.actor, "listing.create", f"listing:{listing_id}", now)
        match_open_demands(conn, now, listing_id=listing_id)
        return listing_json(
            conn.execute(select(listings).where(listings.c.id == listing_id)).mappings().one()
        )

    if key is None:
        return market.write(tx)
    return market.idempotent(principal, key, "listing.create", body.model_dump(mode="json"), tx)


def withdraw_listing(market: Market, principal: Principal, listing_id: int) -> dict:
    principal.require_role("provider", "operator")

    def tx(conn: Connection, now: int) -> dict:
        row = conn.execute(select(listings).where(listings.c.id == listing_id)).mappings().one_or_none()
        if row is None or (principal.role == "provider" and row["provider_id"] != principal.id):
            raise NotFound(f"no listing {listing_id} of yours")
        transition(conn, LISTING, listing_id, WITHDRAWN, principal.actor, "withdrawn", now)
        audit(conn, principal.actor, "listing.withdraw", f"listing:{listing_id}", now)
        return listing_json(
            conn.execute(select(listings).where(listings.c.id == listing_id)).mappings().one()
        )

    return market.write(tx)


def list_listings(market: Market, principal: Principal, mine: bool) -> list[dict]:
    """Providers see their own listings; with mine=False anyone sees the open ones (the offer book)."""

    def tx(conn: Connection, now: int) -> list[dict]:
        query = select(listings).order_by(listings.c.id)
        if mine or principal.role == "provider":
            query = query.where(listings.c.provider_id == principal.id)
        else:
            query = query.where(listings.c.state == "open")
        return [listing_json(r) for r in conn.execute(query).mappings()]

    return market.read(tx)


# -- demands ---------------------------------------------------------------------------------------


def place_demand(market: Market, principal: Principal, body: DemandIn, key: str | None) -> dict:
    """Place a demand and fund its escrow in one step (idempotent on `key`)."""
    principal.require_role("tenant")
    principal.require_verified("place demands")
    req = body.requirement
    escrow = cost(body.max_price_per_device_hour, req.device_count, req.duration_s)
    ledger.check_amount(escrow, "escrow (max price x devices x duration)")

    def tx(conn: Connection, now: int) -> dict:
        if req.latest_start is not None and _ts(req) < now:
            raise BadRequest("requirement.latest_start is in the past")
        demand_id = conn.execute(
            demands.insert().values(
                tenant_id=principal.id,
                requirement=req.model_dump_json(),
                kinds="," + ",".join(sorted(req.accelerator_kinds)) + ",",
                device_count=req.device_count,
                duration_s=req.duration_s,
                max_price_per_device_hour=body.max_price_per_device_hour,
                latest_start=None if req.latest_start is None else _ts(req),
                escrow_amount=escrow,
                state=OPEN,
                created_at=now,
                **job_columns(body.job),
            )
        ).inserted_primary_key[0]
        escrow_id = ledger.open_account(conn, f"escrow:demand:{demand_id}", "escrow", principal.id)
        available = ledger.account_id(conn, f"tenant:{principal.id}:available")
        pending_id = ledger.transfer(
            conn, available, escrow_id, escrow, reason="escrow_reserve", actor=str(principal.actor), now=now,
            pending=True, demand_id=demand_id,
        )  # fmt: skip
        conn.execute(
            update(demands)
            .where(demands.c.id == demand_id)
            .values(escrow_account_id=escrow_id, escrow_pending_id=pending_id)
        )
        record_initial(conn, DEMAND, demand_id, principal.actor, "placed with escrow", now)
        audit(conn, principal.actor, "demand.place", f"demand:{demand_id}", now, escrow=escrow)
        match_demand(conn, demand_id, now)
        return demand_json(conn.execute(select(demands).where(demands.c.id == demand_id)).mappings().one())

    return market.idempotent(principal, key, "demand.place", body.model_dump(mode="json"), tx)


def cancel_demand(market: Market, principal: Principal, demand_id: int, key: str | None) -> dict:
    """Cancel an open demand: its escrow hold is released in full."""
    principal.require_role("tenant")

    def tx(conn: Connection, now: int) -> dict:
        row = _lock_demand(conn, demand_id)
        if row is None or row["tenant_id"] != principal.id:
            raise NotFound(f"no demand {demand_id} of yours")
        transition(
            conn, DEMAND, demand_id, CANCELLED, principal.actor, "cancelled by tenant", now, expect=OPEN
        )
        ledger.void_pending(
            conn, row["escrow_pending_id"], reason="escrow_release", actor=str(principal.actor), now=now
        )
        audit(conn, principal.actor, "demand.cancel", f"demand:{demand_id}", now)
        return demand_json(conn.execute(select(demands).where(demands.c.id == demand_id)).mappings().one())

    return market.idempotent(principal, key, "demand.cancel", {"demand_id": demand_id}, tx)


def list_demands(market: Market, principal: Principal) -> list[dict]:
    principal.require_role("tenant", "operator")

    def tx(conn: Connection, now: int) -> list[dict]:
        query = select(demands).order_by(demands.c.id)
        if principal.role == "tenant":
            query = query.where(demands.c.tenant_id == principal.id)
        return [demand_json(r, principal.role == "tenant") for r in conn.execute(query).mappings()]

    return market.read(tx)


def get_demand(market: Market, principal: Principal, demand_id: int) -> dict:
    def tx(conn: Connection, now: int) -> dict:
        row = conn.execute(select(demands).where(demands.c.id == demand_id)).mappings().one_or_none()
        if row is None or (principal.role != "operator" and row["tenant_id"] != principal.id):
            raise NotFound(f"no demand {demand_id} of yours")
        return demand_json(row, principal.role == "tenant")

    return market.read(tx)


# -- matching in the store -------------------------------------------------------------------------


def _ts(req: Requirement) -> int:
    latest = req.latest_start
    assert latest is not None
    return int((latest if latest.tzinfo else latest.replace(tzinfo=UTC)).timestamp())


def _lock_demand(conn: Connection, demand_id: int):  # type: ignore[no-untyped-def]
    return (
        conn.execute(select(demands).where(demands.c.id == demand_id).with_for_update())
        .mappings()
        .one_or_none()
    )


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
    )


def match_demand(conn: Connection, demand_id: int, now: int) -> int | None:
    """Match one open demand to the best listing, if any; returns the new lease id."""
    row = _lock_demand(conn, demand_id)
    if row is None or row["state"] != OPEN:
        return None
    tenant_state = conn.execute(
        select(accounts.c.state).where(accounts.c.id == row["tenant_id"])
    ).scalar_one()
    if tenant_state != VERIFIED:
        return None
    req = Requirement.model_validate_json(row["requirement"])
    demand = DemandView.of(demand_id, req, row["max_price_per_device_hour"])
    candidates = (
        conn.execute(
            select(listings)
            .join(accounts, and_(accounts.c.id == listings.c.provider_id, accounts.c.state == VERIFIED))
            .where(
                listings.c.state == "open",
                listings.c.accelerator_kind.in_(sorted(demand.kinds)),
                listings.c.price_per_device_hour <= demand.max_price,
                listings.c.capacity - listings.c.reserved >= demand.device_count,
                listings.c.start_class.in_(sorted(demand.start_classes)),
                listings.c.available_until >= now + demand.duration_s,
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
    escrow = cost(price, demand["device_count"], demand["duration_s"])
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
            escrow_amount=escrow,
            state=LEASE.initial,
            created_at=now,
            accept_by=now + config["accept_timeout_s"],
            start_by=start + config["start_timeout_s"],
            last_seq=0,
            paid_provider=0,
            paid_fee=0,
            refunded=0,
        )
    ).inserted_primary_key[0]
    # Post the hold at the listing's price; what the demand reserved beyond it is released now.
    ledger.post_pending(
        conn,
        demand["escrow_pending_id"],
        escrow,
        reason="escrow_fund",
        actor="system",
        now=now,
        lease_id=lease_id,
    )
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
        escrow=escrow,
    )
    return lease_id


def match_open_demands(conn: Connection, now: int, listing_id: int | None = None) -> list[int]:
    """Try every open demand, oldest first (time priority); returns the leases made."""
    query = select(demands.c.id).where(demands.c.state == OPEN).order_by(demands.c.created_at, demands.c.id)
    if listing_id is not None:
        listing = conn.execute(select(listings).where(listings.c.id == listing_id)).mappings().one()
        query = query.where(
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
