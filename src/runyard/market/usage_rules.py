"""What the usage operations share: the lease and record a caller may act on, the dispute window,
the tolerance test, and opening a dispute. (Block leases report usage in `usage`, standing leases
availability in `availability`; disputes of either are in `disputes`.)"""

from __future__ import annotations

from sqlalchemy import Connection, select

from runyard.market.errors import BadRequest, Conflict, Forbidden, NotFound, UsageRejected
from runyard.market.rows import lock_lease
from runyard.market.schema import disputes, usage_records
from runyard.market.service import Market, Principal, audit
from runyard.market.states import SYSTEM, Actor, record_initial, transition
from runyard.market.states.dispute import DISPUTE, OPEN
from runyard.market.states.lease import RUNNING, TERMINATED, WINDOW_CLOSED
from runyard.market.states.record import DISPUTED, RECORD

USAGE_STATES = (RUNNING, WINDOW_CLOSED, TERMINATED)


def lease_for(conn: Connection, lease_id: int, principal: Principal, side: str) -> dict:
    lease = lock_lease(conn, lease_id, principal)
    if principal.role != "operator" and lease[f"{side}_id"] != principal.id:
        raise Forbidden(f"only the lease's {side} may do this")
    return lease


def check_seq(lease: dict, seq: int) -> None:
    """A record's `seq` is the lease's last accepted one plus 1 (1 for the first): a replay (at or
    below it) or a gap (a number skipped) is refused with 409 `usage_rejected` naming the seq
    expected, so a provider and the market never disagree about which records there are."""
    expected = lease["last_seq"] + 1
    if seq < expected:
        raise UsageRejected(f"seq {seq} is not above the last accepted seq {lease['last_seq']} (replay?); "
                            f"the next record is seq {expected}", expected_seq=expected)
    if seq > expected:
        raise UsageRejected(f"seq {seq} skips seq {expected}: sequence numbers are consecutive; "
                            f"the next record is seq {expected}", expected_seq=expected)


def record_for(conn: Connection, record_id: int, principal: Principal, side: str) -> dict:
    """A usage record, read after locking its lease (whose `side` the caller must be)."""
    lease_id = conn.execute(select(usage_records.c.lease_id).where(usage_records.c.id == record_id)).scalar()
    if lease_id is None:
        raise NotFound(f"no usage record {record_id}")
    lease_for(conn, lease_id, principal, side)
    return record_json(conn, record_id)


def disputable_record(conn: Connection, record_id: int, principal: Principal, now: int) -> dict:
    """The tenant's usage record, while its dispute window is open; once it has closed the record
    stands as reported and the tenant can neither acknowledge nor dispute it."""
    record = record_for(conn, record_id, principal, "tenant")
    if now > record["received_at"] + dispute_window(conn):
        raise Conflict(f"record {record_id}'s dispute window has closed; it stands as reported")
    return record


def dispute_window(conn: Connection) -> int:
    return Market.config(conn)["dispute_window_s"]


def mismatch(conn: Connection, provider_value: int, tenant_value: int) -> bool:
    """The tenant saw less than the provider reported, by more than the tolerance. (A tenant that
    saw more has nothing to dispute: it is billed for what the provider reported.)"""
    tolerance = Market.config(conn)["tolerance_bps"]
    return (
        tenant_value < provider_value
        and (provider_value - tenant_value) * 10_000 > tolerance * provider_value
    )


def open_dispute(
    conn: Connection, record: dict, actor: Actor, side: str, claimed: int, counter: int, reason: str, now: int
) -> int:
    """Open a dispute on `record`. Both positions are bounded by what the record reported, so no
    dispute can ever claim more than the escrow was asked to pay for it."""
    reported = record["device_seconds"]
    if not (0 <= claimed <= reported and 0 <= counter <= reported):
        raise BadRequest(
            f"a dispute's positions ({claimed}, {counter}) must lie within the record's {reported}"
        )
    dispute_id = conn.execute(
        disputes.insert().values(
            lease_id=record["lease_id"],
            record_id=record["id"],
            opened_by=str(actor),
            opener_side=side,
            claimed_device_seconds=claimed,
            counter_device_seconds=counter,
            reason=reason,
            state=OPEN,
            created_at=now,
        )
    ).inserted_primary_key[0]
    transition(conn, RECORD, record["id"], DISPUTED, actor if actor.side != "system" else SYSTEM, reason, now)
    record_initial(conn, DISPUTE, dispute_id, actor, reason, now)
    audit(conn, actor, "dispute.open", f"dispute:{dispute_id}", now, record=record["id"], claimed=claimed)
    return dispute_id


def record_json(conn: Connection, record_id: int) -> dict:
    return dict(conn.execute(select(usage_records).where(usage_records.c.id == record_id)).mappings().one())


def dispute_json(conn: Connection, dispute_id: int) -> dict:
    return dict(conn.execute(select(disputes).where(disputes.c.id == dispute_id)).mappings().one())


