"""Listings (providers) and demands (tenants).

A demand is placed with its escrow: max price x devices x duration is reserved from the tenant's
available balance as a pending transfer before anything else happens, so a provider only ever sees
demands backed by real money (a standing demand: its committed term, max price x devices x period,
times the periods it commits to). Placing either one runs matching (`matcher`) at once.
"""

from __future__ import annotations

import json

from sqlalchemy import Connection, select, update

from runyard.market import escrow, ledger
from runyard.market.errors import BadRequest, NotFound
from runyard.market.jobs import JOB_COLUMNS, job_columns, job_of
from runyard.market.matcher import match_demand, match_open_demands, timestamp
from runyard.market.matching import never_matches
from runyard.market.models import DemandIn, ListingIn
from runyard.market.pricing import cost
from runyard.market.rows import lock_demand
from runyard.market.schema import demands, listings
from runyard.market.service import Market, Principal, audit
from runyard.market.serving import deployment_json, deployment_of
from runyard.market.standing import dumps, reserved_json, tiers_json
from runyard.market.states import record_initial, transition
from runyard.market.states.demand import CANCELLED, DEMAND, OPEN
from runyard.market.states.listing import LISTING, WITHDRAWN

STANDING_LISTING_COLUMNS = ("period_s", "min_term_periods", "notice_s", "availability_bps", "credit_rule",
                            "reserved_terms")


def listing_json(row) -> dict:  # type: ignore[no-untyped-def]
    """A listing as the API shows it: a standing listing's terms under `standing`."""
    out = {k: v for k, v in dict(row).items() if k not in STANDING_LISTING_COLUMNS}
    out["standing"] = None
    if row["form"] == "standing":
        out["standing"] = {
            "period_s": row["period_s"], "min_term_periods": row["min_term_periods"], "notice_s": row["notice_s"],
            "availability_bps": row["availability_bps"], "credits": json.loads(row["credit_rule"] or "[]"),
            "reserved": json.loads(row["reserved_terms"] or "[]"),
        }  # fmt: skip
    return out


def demand_json(row, with_job: bool = True) -> dict:  # type: ignore[no-untyped-def]
    """A demand as the API shows it; `job` and `deployment` only to its tenant (with_job), never to an
    operator."""
    hidden = ("requirement", "kinds", "standing", "deployment", *JOB_COLUMNS)
    out = {k: v for k, v in dict(row).items() if k not in hidden}
    out["requirement"] = json.loads(row["requirement"])
    out["standing"] = json.loads(row["standing"]) if row["standing"] else None
    if with_job:
        out["job"] = job_of(row)
        out["deployment"] = deployment_of(row["deployment"])
    return out


# -- listings --------------------------------------------------------------------------------------


def create_listing(market: Market, principal: Principal, body: ListingIn, key: str | None = None) -> dict:
    """A verified provider offers capacity; open demands that fit are matched at once.

    Idempotent on `key` when one is given (a listing moves no money, so a key is optional)."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        principal.require_verified("list capacity", conn)
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
                memory_gib=body.memory_gib,
                form=body.form,
                **_standing_columns(body),
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


def _standing_columns(body: ListingIn) -> dict:
    terms = body.standing
    if terms is None:
        return {}
    return {
        "period_s": terms.period_s, "min_term_periods": terms.min_term_periods, "notice_s": terms.notice_s,
        "availability_bps": terms.availability_bps, "credit_rule": dumps(tiers_json(terms.credits)),
        "reserved_terms": dumps(reserved_json(terms.reserved)),
    }  # fmt: skip


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
    req, standing = body.requirement, body.standing
    impossible = never_matches(req, standing)
    if impossible:
        raise BadRequest(f"this demand could never match: {impossible}")
    if standing is None:
        amount, duration = cost(body.max_price_per_device_hour, req.device_count, req.duration_s), req.duration_s
        ledger.check_amount(amount, "escrow (max price x devices x duration)")
    else:
        period = cost(body.max_price_per_device_hour, req.device_count, standing.period_s)
        amount, duration = period * standing.term_periods, standing.term_s
        ledger.check_amount(amount, "escrow (max price x devices x period x term_periods)")

    def tx(conn: Connection, now: int) -> dict:
        principal.require_verified("place demands", conn)
        if req.latest_start is not None and timestamp(req) < now:
            raise BadRequest("requirement.latest_start is in the past")
        demand_id = conn.execute(
            demands.insert().values(
                tenant_id=principal.id,
                requirement=req.model_dump_json(),
                kinds="," + ",".join(sorted(req.accelerator_kinds)) + ",",
                device_count=req.device_count,
                duration_s=duration,
                max_price_per_device_hour=body.max_price_per_device_hour,
                latest_start=None if req.latest_start is None else timestamp(req),
                escrow_amount=amount,
                state=OPEN,
                created_at=now,
                **job_columns(body.job),
                form=body.form,
                standing=None if standing is None else standing.model_dump_json(),
                deployment=deployment_json(body.deployment),
            )
        ).inserted_primary_key[0]
        escrow_id, pending_id = escrow.reserve(conn, demand_id, principal.id, amount, principal.actor, now)
        conn.execute(
            update(demands)
            .where(demands.c.id == demand_id)
            .values(escrow_account_id=escrow_id, escrow_pending_id=pending_id)
        )
        record_initial(conn, DEMAND, demand_id, principal.actor, "placed with escrow", now)
        audit(conn, principal.actor, "demand.place", f"demand:{demand_id}", now, escrow=amount)
        match_demand(conn, demand_id, now)
        return demand_json(conn.execute(select(demands).where(demands.c.id == demand_id)).mappings().one())

    return market.idempotent(principal, key, "demand.place", body.model_dump(mode="json"), tx)


def cancel_demand(market: Market, principal: Principal, demand_id: int, key: str | None) -> dict:
    """Cancel an open demand: its escrow hold is released in full."""
    principal.require_role("tenant")

    def tx(conn: Connection, now: int) -> dict:
        row = lock_demand(conn, demand_id)
        if row is None or row["tenant_id"] != principal.id:
            raise NotFound(f"no demand {demand_id} of yours")
        transition(
            conn, DEMAND, demand_id, CANCELLED, principal.actor, "cancelled by tenant", now, expect=OPEN
        )
        escrow.release(conn, row["escrow_pending_id"], principal.actor, now)
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
