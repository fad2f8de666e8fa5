"""Lease operations: accept (with the provider's signature over the terms), reject, start, close the
window, terminate, cancel, and reading leases. (`deadlines.sweep` applies the timeouts.)

Every state change goes through the lease machine (`states/lease.py`). Ends before any usage
(rejected, expired, cancelled) return the whole escrow to the tenant; every end that frees the
listing's devices offers them to waiting demands (`matcher.release_capacity`). A standing lease
(`runyard.market.standing`) starts its first billing period when it starts (`periods`), is never
closed by its provider (it ends by notice, nonpayment or termination), and its tenant cannot
terminate it inside the committed term.
"""

from __future__ import annotations

import json

from sqlalchemy import Connection, or_, select, update

from runyard.market import escrow, periods
from runyard.market.errors import BadRequest, Conflict, InvalidTransition, NotFound
from runyard.market.jobs import JOB_COLUMNS, job_of, job_sha256
from runyard.market.matcher import release_capacity
from runyard.market.models import AcceptIn, EndIn
from runyard.market.payloads import lease_terms
from runyard.market.rows import is_party, lock_demand, lock_lease, lock_lease_as
from runyard.market.schema import demands, leases, listings
from runyard.market.service import Market, Principal, audit
from runyard.market.serving import deployment_of, deployment_sha256
from runyard.market.signing import verify
from runyard.market.states import SYSTEM, Actor, transition
from runyard.market.states.demand import CANCELLED as DEMAND_CANCELLED
from runyard.market.states.demand import DEMAND, MATCHED
from runyard.market.states.demand import OPEN as DEMAND_OPEN
from runyard.market.states.lease import (
    ACCEPTED,
    CANCELLED,
    EXPIRED,
    LEASE,
    OFFERED,
    REJECTED,
    RUNNING,
    TERMINATED,
    WINDOW_CLOSED,
)


def lease_json(row) -> dict:  # type: ignore[no-untyped-def]
    out = {k: v for k, v in dict(row).items() if k not in (*JOB_COLUMNS, "deployment")}
    if isinstance(out.get("credit_rule"), str):
        out["credit_rule"] = json.loads(out["credit_rule"])
    return out


def _with_job(row, principal: Principal) -> dict:  # type: ignore[no-untyped-def]
    """A lease joined with its demand's job or deployment: `job` and `deployment` for the lease's
    parties only (not operators); `job_sha256` and `deployment_sha256`, which the provider's
    acceptance signs, for anyone who may see the lease."""
    out = lease_json(row)
    job, deployment = job_of(row), deployment_of(row["deployment"])
    out["job_sha256"] = job_sha256(job)
    out["deployment_sha256"] = deployment_sha256(deployment)
    if principal.id in (row["tenant_id"], row["provider_id"]):
        out["job"] = job
        out["deployment"] = deployment
    return out


def _job_query():  # type: ignore[no-untyped-def]
    return select(leases, *(demands.c[c] for c in (*JOB_COLUMNS, "deployment"))).join(
        demands, demands.c.id == leases.c.demand_id
    )


def _digests(conn: Connection, demand_id: int) -> dict[str, str | None]:
    """The job and deployment digests the provider's acceptance signs."""
    row = (
        conn.execute(select(*(demands.c[c] for c in (*JOB_COLUMNS, "deployment"))).where(demands.c.id == demand_id))
        .mappings()
        .one()
    )
    return {"job_sha256": job_sha256(job_of(row)), "deployment_sha256": deployment_sha256(deployment_of(row["deployment"]))}


def end_before_start(
    conn: Connection, lease: dict, to: str, actor: Actor, reason: str, now: int, note: str = ""
) -> None:
    # end_reason keeps the code; the transition's reason also says why in the party's words.
    why = f"{reason}: {note}" if note else reason
    transition(conn, LEASE, lease["id"], to, actor, why, now, end_reason=reason)
    escrow.refund(conn, lease, actor, now)
    if to == EXPIRED:
        conn.execute(
            update(listings)
            .where(listings.c.id == lease["listing_id"])
            .values(leases_expired=listings.c.leases_expired + 1)
        )
    audit(conn, actor, f"lease.{to}", f"lease:{lease['id']}", now, reason=reason)
    _after_lease_failed(conn, lease, to, actor, now)
    release_capacity(conn, lease, now)


def _after_lease_failed(conn: Connection, lease: dict, to: str, actor: Actor, now: int) -> None:
    """The lease's demand after the lease ended before it started: open again with a fresh hold
    (so another listing may serve it), or cancelled when its tenant cancelled the lease or the hold
    cannot be made again."""
    demand = lock_demand(conn, lease["demand_id"])
    if demand is None or demand["state"] != MATCHED or demand["lease_id"] != lease["id"]:
        return
    if to == CANCELLED and actor.side == "tenant":
        transition(
            conn,
            DEMAND,
            demand["id"],
            DEMAND_CANCELLED,
            actor,
            f"lease {lease['id']} cancelled by its tenant",
            now,
        )
        return
    short = escrow.shortfall(conn, demand["tenant_id"], demand["escrow_amount"])
    if short:
        why = f"lease {lease['id']} {to}; {short} more is needed to hold the escrow again"
        transition(conn, DEMAND, demand["id"], DEMAND_CANCELLED, SYSTEM, why, now)
        return
    escrow_id, pending_id = escrow.reserve(
        conn, demand["id"], demand["tenant_id"], demand["escrow_amount"], SYSTEM, now
    )
    transition(
        conn, DEMAND, demand["id"], DEMAND_OPEN, SYSTEM, f"lease {lease['id']} {to}; open again", now,
        escrow_account_id=escrow_id, escrow_pending_id=pending_id, lease_id=None,
    )  # fmt: skip
    audit(conn, SYSTEM, "demand.reopen", f"demand:{demand['id']}", now, lease=lease["id"])


def _reread(conn: Connection, lease_id: int) -> dict:
    return lease_json(conn.execute(select(leases).where(leases.c.id == lease_id)).mappings().one())


def accept(market: Market, principal: Principal, lease_id: int, body: AcceptIn, key: str | None) -> dict:
    """The provider accepts an offered lease by signing its terms (payloads.lease_terms)."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        principal.require_verified("accept leases", conn)  # before the lease lock: see revocation
        lease = lock_lease_as(conn, lease_id, principal, "provider")
        if lease["state"] != OFFERED:
            raise InvalidTransition(
                f"lease {lease_id} is {lease['state']}; only an offered lease can be accepted"
            )
        if now > lease["accept_by"]:
            raise Conflict(f"lease {lease_id} had to be accepted by {lease['accept_by']}; it is expiring")
        lease.update(_digests(conn, lease["demand_id"]))
        verify(
            principal.public_key,
            lease_terms(lease, Market.config(conn)["currency"]),
            body.signature,
            "lease terms",
        )
        transition(
            conn, LEASE, lease_id, ACCEPTED, principal.actor, "provider signed the terms", now,
            expect=OFFERED, terms_signature=body.signature,
        )  # fmt: skip
        audit(conn, principal.actor, "lease.accept", f"lease:{lease_id}", now)
        return _reread(conn, lease_id)

    return market.idempotent(principal, key, "lease.accept", {"lease_id": lease_id, **body.model_dump()}, tx)


def reject(market: Market, principal: Principal, lease_id: int, body: EndIn, key: str | None) -> dict:
    """The provider declines an offered lease; the tenant's escrow returns in full."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        lease = lock_lease_as(conn, lease_id, principal, "provider")
        end_before_start(conn, lease, REJECTED, principal.actor, body.reason_code, now, body.note)
        return _reread(conn, lease_id)

    return market.idempotent(principal, key, "lease.reject", {"lease_id": lease_id, **body.model_dump()}, tx)


def cancel(market: Market, principal: Principal, lease_id: int, body: EndIn, key: str | None) -> dict:
    """The tenant cancels a lease that has not started; its escrow returns in full."""
    principal.require_role("tenant", "operator")

    def tx(conn: Connection, now: int) -> dict:
        lease = lock_lease_as(conn, lease_id, principal, "tenant")
        end_before_start(conn, lease, CANCELLED, principal.actor, body.reason_code, now, body.note)
        return _reread(conn, lease_id)

    return market.idempotent(principal, key, "lease.cancel", {"lease_id": lease_id, **body.model_dump()}, tx)


def start(market: Market, principal: Principal, lease_id: int, key: str | None) -> dict:
    """The provider starts an accepted lease: the paid window runs from now for its duration."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        principal.require_verified("start leases", conn)
        lease = lock_lease_as(conn, lease_id, principal, "provider")
        if lease["state"] != ACCEPTED:
            raise InvalidTransition(f"lease {lease_id} is {lease['state']}; only an accepted lease can start")
        if now > lease["start_by"]:
            raise Conflict(f"lease {lease_id} had to start by {lease['start_by']}; it is expiring")
        # A standing lease's window is its current period; renewal moves its end (periods.renew_or_close).
        span = lease["period_s"] if lease["form"] == "standing" else lease["duration_s"]
        transition(
            conn, LEASE, lease_id, RUNNING, principal.actor, "started", now,
            expect=ACCEPTED, started_at=now, window_end=now + span,
        )  # fmt: skip
        if lease["form"] == "standing":
            periods.open_period(conn, lease, 1, now, now + span, "prepaid", now)
        audit(conn, principal.actor, "lease.start", f"lease:{lease_id}", now)
        return _reread(conn, lease_id)

    return market.idempotent(principal, key, "lease.start", {"lease_id": lease_id}, tx)


def close_window(market: Market, principal: Principal, lease_id: int, key: str | None) -> dict:
    """The provider marks a running lease's window as over (only once its end has come)."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        lease = lock_lease_as(conn, lease_id, principal, "provider")
        if lease["form"] == "standing":
            raise Conflict(f"lease {lease_id} is a standing lease: it ends by notice (POST /v1/leases/{lease_id}/"
                           "notice) at a period's close, or by termination, never by closing its window")
        if lease["state"] == RUNNING and now < lease["window_end"]:
            raise Conflict(
                f"lease {lease_id}'s window ends at {lease['window_end']}; to stop early, terminate it"
            )
        transition(conn, LEASE, lease_id, WINDOW_CLOSED, principal.actor, "window ended", now, expect=RUNNING)
        release_capacity(conn, lease, now)
        audit(conn, principal.actor, "lease.window_closed", f"lease:{lease_id}", now)
        return _reread(conn, lease_id)

    return market.idempotent(principal, key, "lease.close", {"lease_id": lease_id}, tx)


def terminate(market: Market, principal: Principal, lease_id: int, body: EndIn, key: str | None) -> dict:
    """End a running lease early (either side, or an operator); usage up to now is still paid."""

    def tx(conn: Connection, now: int) -> dict:
        lease = lock_lease(conn, lease_id, principal)
        if lease["form"] == "standing" and lease["state"] == RUNNING and principal.role == "tenant":
            term_end = lease["started_at"] + lease["period_s"] * lease["term_periods"]
            if now < term_end:
                raise Conflict(f"lease {lease_id}'s committed term runs to {term_end}; give notice instead "
                               "(it then ends at the first period close after the notice and the term)")
        transition(
            conn, LEASE, lease_id, TERMINATED, principal.actor, f"{body.reason_code}: {body.note}".rstrip(": "), now,
            expect=RUNNING, end_reason=body.reason_code, window_end=min(now, lease["window_end"] or now),
        )  # fmt: skip
        if lease["form"] == "standing":
            periods.end_inside(conn, lease_id, now)
        release_capacity(conn, lease, now)
        audit(conn, principal.actor, "lease.terminate", f"lease:{lease_id}", now, reason=body.reason_code)
        return _reread(conn, lease_id)

    return market.idempotent(
        principal, key, "lease.terminate", {"lease_id": lease_id, **body.model_dump()}, tx
    )


def list_leases(market: Market, principal: Principal, state: str | None = None) -> list[dict]:
    """The caller's leases (as tenant or provider); operators see all."""
    if state is not None and state not in LEASE.states:
        raise BadRequest(f"unknown lease state {state!r}; expected one of {sorted(LEASE.states)}")

    def tx(conn: Connection, now: int) -> list[dict]:
        query = _job_query().order_by(leases.c.id)
        if principal.role != "operator":
            query = query.where(or_(leases.c.tenant_id == principal.id, leases.c.provider_id == principal.id))
        if state is not None:
            query = query.where(leases.c.state == state)
        return [_with_job(r, principal) for r in conn.execute(query).mappings()]

    return market.read(tx)


def get_lease(market: Market, principal: Principal, lease_id: int) -> dict:
    def tx(conn: Connection, now: int) -> dict:
        row = conn.execute(_job_query().where(leases.c.id == lease_id)).mappings().one_or_none()
        if row is None or not is_party(principal, row):
            raise NotFound(f"no lease {lease_id} of yours")
        out = _with_job(row, principal)
        out["terms"] = lease_terms(out, Market.config(conn)["currency"])
        return out

    return market.read(tx)
