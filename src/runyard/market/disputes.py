"""Disputes of usage and availability records: the tenant's dispute, the provider's contest of a
partial acknowledgement, withdrawal by the opener, and the operator's resolution.

A dispute's positions are bounded by what its record reported, so no dispute can make settlement
pay more than the escrow was asked to hold for it. Resolving one settles what it freed at once.
"""

from __future__ import annotations

from sqlalchemy import Connection, select

from runyard.market.errors import BadRequest, Conflict, Forbidden, NotFound
from runyard.market.models import ContestIn, DisputeIn, ResolveIn
from runyard.market.periods import settle_standing
from runyard.market.rows import lock_lease
from runyard.market.schema import disputes, leases
from runyard.market.service import Market, Principal, audit
from runyard.market.settlement import settle_in_tx
from runyard.market.states import SYSTEM, Actor, transition
from runyard.market.states.dispute import DISPUTE, OPEN, PARTIAL, REJECTED, UPHELD, WITHDRAWN
from runyard.market.states.lease import RUNNING, SETTLEABLE
from runyard.market.states.record import DISPUTED, PART_ACKNOWLEDGED, RECORD, REPORTED, RESOLVED
from runyard.market.usage_rules import (
    disputable_record,
    dispute_json,
    dispute_window,
    open_dispute,
    record_for,
)


def dispute(market: Market, principal: Principal, record_id: int, body: DisputeIn, key: str | None) -> dict:
    """The tenant disputes a record within the window, saying what it believes was used."""
    principal.require_role("tenant")

    def tx(conn: Connection, now: int) -> dict:
        record = disputable_record(conn, record_id, principal, now)
        if record["state"] != REPORTED:
            raise Conflict(f"record {record_id} is {record['state']}; only a reported record can be disputed")
        if body.claimed_device_seconds >= record["device_seconds"]:
            raise BadRequest("a dispute claims fewer device-seconds than the record")
        dispute_id = open_dispute(
            conn,
            record,
            principal.actor,
            "tenant",
            body.claimed_device_seconds,
            record["device_seconds"],
            body.reason,
            now,
        )
        return dispute_json(conn, dispute_id)

    return market.idempotent(
        principal, key, "usage.dispute", {"record_id": record_id, **body.model_dump()}, tx
    )


def contest(market: Market, principal: Principal, record_id: int, body: ContestIn, key: str | None) -> dict:
    """The provider contests a tenant's partial acknowledgement within the window."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        record = record_for(conn, record_id, principal, "provider")
        if record["state"] != PART_ACKNOWLEDGED:
            raise Conflict(
                f"record {record_id} is {record['state']}; only a partial acknowledgement can be contested"
            )
        if now > record["acked_at"] + dispute_window(conn):
            raise Conflict("the window to contest this acknowledgement has closed")
        dispute_id = open_dispute(
            conn,
            record,
            principal.actor,
            "provider",
            record["device_seconds"],
            record["acked_device_seconds"],
            body.reason,
            now,
        )
        return dispute_json(conn, dispute_id)

    return market.idempotent(
        principal, key, "usage.contest", {"record_id": record_id, **body.model_dump()}, tx
    )


def withdraw_dispute(market: Market, principal: Principal, dispute_id: int, key: str | None) -> dict:
    """The side that opened a dispute drops it: the other side's position stands."""

    def tx(conn: Connection, now: int) -> dict:
        _, row = _dispute_for(conn, dispute_id, principal)
        if row["opened_by"] != str(principal.actor):
            raise Forbidden("only the account that opened a dispute may withdraw it")
        transition(
            conn, DISPUTE, dispute_id, WITHDRAWN, principal.actor, "withdrawn", now,
            resolved_device_seconds=row["counter_device_seconds"],
        )  # fmt: skip
        _resolve_record(
            conn, row["record_id"], row["counter_device_seconds"], principal.actor, "dispute withdrawn", now
        )
        audit(conn, principal.actor, "dispute.withdraw", f"dispute:{dispute_id}", now)
        return dispute_json(conn, dispute_id)

    return market.idempotent(principal, key, "dispute.withdraw", {"dispute_id": dispute_id}, tx)


def resolve(market: Market, principal: Principal, dispute_id: int, body: ResolveIn, key: str | None) -> dict:
    """The operator resolves a dispute in full (upheld), in part, or rejects it, with a reason."""
    principal.require_role("operator")

    def tx(conn: Connection, now: int) -> dict:
        principal.require_verified("resolve disputes", conn)  # a revoked operator, now
        lease, row = _dispute_for(conn, dispute_id, principal)
        claimed, counter = row["claimed_device_seconds"], row["counter_device_seconds"]
        if body.outcome == PARTIAL:
            low, high = min(claimed, counter), max(claimed, counter)
            if body.device_seconds is None or not low <= body.device_seconds <= high:
                raise BadRequest(f"a partial resolution sets device_seconds between {low} and {high}")
            value = body.device_seconds
        else:
            if body.device_seconds is not None:
                raise BadRequest("device_seconds is only for a partial resolution")
            value = claimed if body.outcome == UPHELD else counter
        assert body.outcome in (UPHELD, PARTIAL, REJECTED)
        transition(
            conn,
            DISPUTE,
            dispute_id,
            body.outcome,
            principal.actor,
            body.reason,
            now,
            resolved_device_seconds=value,
        )
        _resolve_record(conn, row["record_id"], value, principal.actor, f"dispute {body.outcome}", now)
        audit(
            conn,
            principal.actor,
            "dispute.resolve",
            f"dispute:{dispute_id}",
            now,
            outcome=body.outcome,
            value=value,
        )
        if lease["state"] in SETTLEABLE:  # resolving a dispute never moves the lease locked above
            settle_in_tx(conn, row["lease_id"], SYSTEM, now)
        elif lease["form"] == "standing" and lease["state"] == RUNNING:
            settle_standing(conn, row["lease_id"], SYSTEM, now)  # the periods it freed
        return dispute_json(conn, dispute_id)

    return market.idempotent(
        principal, key, "dispute.resolve", {"dispute_id": dispute_id, **body.model_dump()}, tx
    )


def _resolve_record(
    conn: Connection, record_id: int, value: int, actor: Actor, reason: str, now: int
) -> None:
    """A decided or withdrawn dispute takes its record out of `disputed`, holding the outcome."""
    transition(
        conn,
        RECORD,
        record_id,
        RESOLVED,
        actor,
        reason,
        now,
        expect=DISPUTED,
        acked_device_seconds=value,
        acked_at=now,
    )


def _dispute_for(conn: Connection, dispute_id: int, principal: Principal) -> tuple[dict, dict]:
    """A dispute and its lease, locked (NotFound unless the caller is a party or an operator)."""
    lease_id = conn.execute(select(disputes.c.lease_id).where(disputes.c.id == dispute_id)).scalar()
    if lease_id is None:
        raise NotFound(f"no dispute {dispute_id}")
    lease = lock_lease(conn, lease_id, principal)
    return lease, dispute_json(conn, dispute_id)


def open_disputes(market: Market, principal: Principal) -> list[dict]:
    """Open disputes: all for operators, those on the caller's leases otherwise."""

    def tx(conn: Connection, now: int) -> list[dict]:
        query = select(disputes).where(disputes.c.state == OPEN).order_by(disputes.c.id)
        if principal.role != "operator":
            mine = select(leases.c.id).where(
                (leases.c.tenant_id == principal.id) | (leases.c.provider_id == principal.id)
            )
            query = query.where(disputes.c.lease_id.in_(mine))
        return [dict(r) for r in conn.execute(query).mappings()]

    return market.read(tx)
