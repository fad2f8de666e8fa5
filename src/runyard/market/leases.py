"""Lease operations: accept (with the provider's signature over the terms), reject, start, close the
window, terminate, cancel, and the sweep that applies deadlines (expiry, window end, settlement).

Every state change goes through the lease machine (`machines/lease.py`). Ends before any usage
(rejected, expired, cancelled) return the whole escrow to the tenant and free the listing's devices.
"""

from __future__ import annotations

from sqlalchemy import Connection, or_, select, update

from runyard.market import ledger
from runyard.market.errors import BadRequest, Conflict, InvalidTransition, NotFound
from runyard.market.jobs import JOB_COLUMNS, job_of, job_sha256
from runyard.market.machines import SYSTEM, Actor, transition
from runyard.market.machines.demand import DEMAND
from runyard.market.machines.demand import EXPIRED as DEMAND_EXPIRED
from runyard.market.machines.demand import OPEN as DEMAND_OPEN
from runyard.market.machines.lease import (
    ACCEPTED,
    ACTIVE,
    CANCELLED,
    EXPIRED,
    LEASE,
    OFFERED,
    REJECTED,
    RUNNING,
    SETTLEABLE,
    TERMINATED,
    WINDOW_CLOSED,
)
from runyard.market.models import AcceptIn, EndIn
from runyard.market.payloads import lease_terms
from runyard.market.schema import demands, leases, listings
from runyard.market.service import Market, Principal, audit
from runyard.market.signing import verify


def lease_json(row) -> dict:  # type: ignore[no-untyped-def]
    return {k: v for k, v in dict(row).items() if k not in JOB_COLUMNS}


def _with_job(row, principal: Principal) -> dict:  # type: ignore[no-untyped-def]
    """A lease joined with its demand's job: `job` for the lease's parties only (not operators);
    `job_sha256`, which the provider's acceptance signs, for anyone who may see the lease."""
    out = lease_json(row)
    job = job_of(row)
    out["job_sha256"] = job_sha256(job)
    if principal.id in (row["tenant_id"], row["provider_id"]):
        out["job"] = job
    return out


def _job_query():  # type: ignore[no-untyped-def]
    return select(leases, *(demands.c[c] for c in JOB_COLUMNS)).join(
        demands, demands.c.id == leases.c.demand_id
    )


def _job_digest(conn: Connection, demand_id: int) -> str | None:
    row = (
        conn.execute(select(*(demands.c[c] for c in JOB_COLUMNS)).where(demands.c.id == demand_id))
        .mappings()
        .one()
    )
    return job_sha256(job_of(row))


def lock_lease(conn: Connection, lease_id: int, principal: Principal | None) -> dict:
    """Lock a lease row for this transaction; NotFound unless the caller is a party or an operator."""
    row = (
        conn.execute(select(leases).where(leases.c.id == lease_id).with_for_update()).mappings().one_or_none()
    )
    if row is None or (principal is not None and not _party(principal, row)):
        raise NotFound(f"no lease {lease_id} of yours")
    return dict(row)


def _lock_as(conn: Connection, lease_id: int, principal: Principal, side: str) -> dict:
    """Lock a lease the caller holds as `side` ("tenant" or "provider"); operators may act on any.
    NotFound otherwise, as for a lease that does not exist."""
    lease = lock_lease(conn, lease_id, principal)
    if principal.role != "operator" and lease[f"{side}_id"] != principal.id:
        raise NotFound(f"no lease {lease_id} of yours")
    return lease


def _party(principal: Principal, row) -> bool:  # type: ignore[no-untyped-def]
    return principal.role == "operator" or principal.id in (row["tenant_id"], row["provider_id"])


def release_capacity(conn: Connection, lease: dict) -> None:
    conn.execute(
        update(listings)
        .where(listings.c.id == lease["listing_id"])
        .values(reserved=listings.c.reserved - lease["devices"])
    )


def refund_remainder(conn: Connection, lease: dict, actor: Actor, now: int) -> int:
    """Return whatever is left in the lease's escrow to the tenant. Returns the amount moved."""
    remaining = ledger.balance(conn, lease["escrow_account_id"]).available
    if remaining > 0:
        tenant = ledger.account_id(conn, f"tenant:{lease['tenant_id']}:available")
        ledger.transfer(
            conn, lease["escrow_account_id"], tenant, remaining,
            reason="escrow_refund", actor=str(actor), now=now, lease_id=lease["id"],
        )  # fmt: skip
        conn.execute(
            update(leases).where(leases.c.id == lease["id"]).values(refunded=leases.c.refunded + remaining)
        )
    return remaining


def _end_before_start(
    conn: Connection, lease: dict, to: str, actor: Actor, reason: str, now: int, note: str = ""
) -> None:
    # end_reason keeps the code; the transition's reason also says why in the party's words.
    why = f"{reason}: {note}" if note else reason
    transition(conn, LEASE, lease["id"], to, actor, why, now, end_reason=reason)
    release_capacity(conn, lease)
    refund_remainder(conn, lease, actor, now)
    if to == EXPIRED:
        conn.execute(
            update(listings)
            .where(listings.c.id == lease["listing_id"])
            .values(leases_expired=listings.c.leases_expired + 1)
        )
    audit(conn, actor, f"lease.{to}", f"lease:{lease['id']}", now, reason=reason)
    # The devices are free again: someone waiting may fit.
    from runyard.market.orders import match_open_demands

    match_open_demands(conn, now, listing_id=lease["listing_id"])


def _reread(conn: Connection, lease_id: int) -> dict:
    return lease_json(conn.execute(select(leases).where(leases.c.id == lease_id)).mappings().one())


def accept(market: Market, principal: Principal, lease_id: int, body: AcceptIn, key: str | None) -> dict:
    """The provider accepts an offered lease by signing its terms (payloads.lease_terms)."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        lease = _lock_as(conn, lease_id, principal, "provider")
        if lease["state"] != OFFERED:
            raise InvalidTransition(
                f"lease {lease_id} is {lease['state']}; only an offered lease can be accepted"
            )
        if now > lease["accept_by"]:
            raise Conflict(f"lease {lease_id} had to be accepted by {lease['accept_by']}; it is expiring")
        lease["job_sha256"] = _job_digest(conn, lease["demand_id"])
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
        lease = _lock_as(conn, lease_id, principal, "provider")
        _end_before_start(conn, lease, REJECTED, principal.actor, body.reason_code, now, body.note)
        return _reread(conn, lease_id)

    return market.idempotent(principal, key, "lease.reject", {"lease_id": lease_id, **body.model_dump()}, tx)


def cancel(market: Market, principal: Principal, lease_id: int, body: EndIn, key: str | None) -> dict:
    """The tenant cancels a lease that has not started; its escrow returns in full."""
    principal.require_role("tenant", "operator")

    def tx(conn: Connection, now: int) -> dict:
        lease = _lock_as(conn, lease_id, principal, "tenant")
        _end_before_start(conn, lease, CANCELLED, principal.actor, body.reason_code, now, body.note)
        return _reread(conn, lease_id)

    return market.idempotent(principal, key, "lease.cancel", {"lease_id": lease_id, **body.model_dump()}, tx)


def start(market: Market, principal: Principal, lease_id: int, key: str | None) -> dict:
    """The provider starts an accepted lease: the paid window runs from now for its duration."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        lease = _lock_as(conn, lease_id, principal, "provider")
        if lease["state"] != ACCEPTED:
            raise InvalidTransition(f"lease {lease_id} is {lease['state']}; only an accepted lease can start")
        if now > lease["start_by"]:
            raise Conflict(f"lease {lease_id} had to start by {lease['start_by']}; it is expiring")
        transition(
            conn, LEASE, lease_id, RUNNING, principal.actor, "started", now,
            expect=ACCEPTED, started_at=now, window_end=now + lease["duration_s"],
        )  # fmt: skip
        audit(conn, principal.actor, "lease.start", f"lease:{lease_id}", now)
        return _reread(conn, lease_id)

    return market.idempotent(principal, key, "lease.start", {"lease_id": lease_id}, tx)


def close_window(market: Market, principal: Principal, lease_id: int, key: str | None) -> dict:
    """The provider marks a running lease's window as over (only once its end has come)."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        lease = _lock_as(conn, lease_id, principal, "provider")
        if lease["state"] == RUNNING and now < lease["window_end"]:
            raise Conflict(
                f"lease {lease_id}'s window ends at {lease['window_end']}; to stop early, terminate it"
            )
        transition(conn, LEASE, lease_id, WINDOW_CLOSED, principal.actor, "window ended", now, expect=RUNNING)
        release_capacity(conn, lease)
        audit(conn, principal.actor, "lease.window_closed", f"lease:{lease_id}", now)
        return _reread(conn, lease_id)

    return market.idempotent(principal, key, "lease.close", {"lease_id": lease_id}, tx)


def terminate(market: Market, principal: Principal, lease_id: int, body: EndIn, key: str | None) -> dict:
    """End a running lease early (either side, or an operator); usage up to now is still paid."""

    def tx(conn: Connection, now: int) -> dict:
        lease = lock_lease(conn, lease_id, principal)
        transition(
            conn, LEASE, lease_id, TERMINATED, principal.actor, f"{body.reason_code}: {body.note}".rstrip(": "), now,
            expect=RUNNING, end_reason=body.reason_code, window_end=min(now, lease["window_end"] or now),
        )  # fmt: skip
        release_capacity(conn, lease)
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
        if row is None or not _party(principal, row):
            raise NotFound(f"no lease {lease_id} of yours")
        out = _with_job(row, principal)
        out["terms"] = lease_terms(out, Market.config(conn)["currency"])
        return out

    return market.read(tx)


# -- deadlines -------------------------------------------------------------------------------------


def sweep(market: Market) -> dict:
    """Apply every deadline that has passed, each in its own transaction (system actor):
    expire leases not accepted or started in time and demands past their latest start, close
    windows that have ended, and settle what can be settled."""
    from runyard.market.settlement import settle_in_tx

    now = market.now()

    def due(conn: Connection, _now: int) -> dict[str, list[int]]:
        ids = lambda q: conn.execute(q).scalars().all()  # noqa: E731
        return {
            "expire": ids(
                select(leases.c.id).where(
                    or_(
                        (leases.c.state == OFFERED) & (leases.c.accept_by < now),
                        (leases.c.state.in_(ACTIVE[:2])) & (leases.c.start_by < now),
                    )
                )
            ),
            "close": ids(select(leases.c.id).where(leases.c.state == RUNNING, leases.c.window_end <= now)),
            "settle": ids(select(leases.c.id).where(leases.c.state.in_(SETTLEABLE))),
            "demands": ids(
                select(demands.c.id).where(demands.c.state == DEMAND_OPEN, demands.c.latest_start < now)
            ),
        }

    todo = market.read(due)

    # Each step re-checks its condition under the row lock, so a sweep racing a party is harmless.
    def expire(conn: Connection, lease_id: int) -> int:
        lease = lock_lease(conn, lease_id, None)
        if lease["state"] == OFFERED and lease["accept_by"] < now:
            reason = "accept_timeout"
        elif lease["state"] in (OFFERED, ACCEPTED) and lease["start_by"] < now:
            reason = "start_timeout"
        else:
            return 0
        _end_before_start(conn, lease, EXPIRED, SYSTEM, reason, now)
        return 1

    def close(conn: Connection, lease_id: int) -> int:
        lease = lock_lease(conn, lease_id, None)
        if lease["state"] != RUNNING or lease["window_end"] > now:
            return 0
        transition(conn, LEASE, lease_id, WINDOW_CLOSED, SYSTEM, "window ended", now)
        release_capacity(conn, lease)
        return 1

    def expire_demand(conn: Connection, demand_id: int) -> int:
        row = (
            conn.execute(select(demands).where(demands.c.id == demand_id).with_for_update()).mappings().one()
        )
        if row["state"] != DEMAND_OPEN or row["latest_start"] is None or row["latest_start"] >= now:
            return 0
        transition(conn, DEMAND, demand_id, DEMAND_EXPIRED, SYSTEM, "no match before latest_start", now)
        ledger.void_pending(conn, row["escrow_pending_id"], reason="escrow_release", actor="system", now=now)
        return 1

    write = market.store.write
    done = {
        "expired": sum(write(lambda c, i=i: expire(c, i)) for i in todo["expire"]),
        "closed": sum(write(lambda c, i=i: close(c, i)) for i in todo["close"]),
        "demands_expired": sum(write(lambda c, i=i: expire_demand(c, i)) for i in todo["demands"]),
    }
    settled = [
        write(lambda c, i=i: settle_in_tx(c, i, SYSTEM, now))
        for i in sorted(set(todo["settle"]) | set(todo["close"]))
    ]
    done["settled"] = sum(1 for s in settled if s["state"] == "settled")
    return done
