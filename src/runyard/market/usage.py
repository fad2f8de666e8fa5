"""Usage: the provider's signed records, the tenant's acknowledgements, disputes and measurements.

A record is accepted only if its signature verifies against the provider's registered key over the
canonical payload (payloads.usage_record), its sequence number is above every earlier one, its
interval lies inside the lease's window, does not overlap the previous record and has already
ended, and it claims no more device-seconds than the lease's devices could give.
"""

from __future__ import annotations

from sqlalchemy import Connection, select, update

from runyard.market.errors import BadRequest, Conflict, Forbidden, NotFound, UsageRejected
from runyard.market.leases import get_lease
from runyard.market.models import AckIn, ContestIn, DisputeIn, MeasurementIn, ResolveIn, UsageIn
from runyard.market.payloads import measurement as measurement_payload
from runyard.market.payloads import usage_record
from runyard.market.rows import lock_lease
from runyard.market.schema import disputes, leases, measurements, usage_records
from runyard.market.service import Market, Principal, audit
from runyard.market.settlement import settle_in_tx
from runyard.market.signing import verify
from runyard.market.states import SYSTEM, Actor, record_initial, transition
from runyard.market.states.dispute import DISPUTE, OPEN, PARTIAL, REJECTED, UPHELD, WITHDRAWN
from runyard.market.states.lease import RUNNING, SETTLEABLE, TERMINATED, WINDOW_CLOSED
from runyard.market.states.record import ACKNOWLEDGED, DISPUTED, PART_ACKNOWLEDGED, RECORD, REPORTED, RESOLVED

USAGE_STATES = (RUNNING, WINDOW_CLOSED, TERMINATED)


def _lease_for(conn: Connection, lease_id: int, principal: Principal, side: str) -> dict:
    lease = lock_lease(conn, lease_id, principal)
    if principal.role != "operator" and lease[f"{side}_id"] != principal.id:
        raise Forbidden(f"only the lease's {side} may do this")
    return lease


def _record_for(conn: Connection, record_id: int, principal: Principal, side: str) -> dict:
    """A usage record, read after locking its lease (whose `side` the caller must be)."""
    lease_id = conn.execute(select(usage_records.c.lease_id).where(usage_records.c.id == record_id)).scalar()
    if lease_id is None:
        raise NotFound(f"no usage record {record_id}")
    _lease_for(conn, lease_id, principal, side)
    return _record_json(conn, record_id)


def _disputable_record(conn: Connection, record_id: int, principal: Principal, now: int) -> dict:
    """The tenant's usage record, while its dispute window is open; once it has closed the record
    stands as reported and the tenant can neither acknowledge nor dispute it."""
    record = _record_for(conn, record_id, principal, "tenant")
    if now > record["received_at"] + _window(conn):
        raise Conflict(f"record {record_id}'s dispute window has closed; it stands as reported")
    return record


def _window(conn: Connection) -> int:
    return Market.config(conn)["dispute_window_s"]


def _mismatch(conn: Connection, provider_value: int, tenant_value: int) -> bool:
    """The tenant saw less than the provider reported, by more than the tolerance. (A tenant that
    saw more has nothing to dispute: it is billed for what the provider reported.)"""
    tolerance = Market.config(conn)["tolerance_bps"]
    return (
        tenant_value < provider_value
        and (provider_value - tenant_value) * 10_000 > tolerance * provider_value
    )


def _open_dispute(
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


def report(market: Market, principal: Principal, lease_id: int, body: UsageIn, key: str | None) -> dict:
    """The provider reports one signed usage record."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        lease = _lease_for(conn, lease_id, principal, "provider")
        payload = usage_record(
            lease_id, body.seq, body.interval_start, body.interval_end, body.device_seconds, body.evidence
        )
        verify(principal.public_key, payload, body.signature, "usage record")
        if lease["state"] not in USAGE_STATES:
            raise UsageRejected(
                f"lease {lease_id} is {lease['state']}; usage is reported only once it has started"
            )
        if body.seq <= lease["last_seq"]:
            raise UsageRejected(
                f"seq {body.seq} is not above the last accepted seq {lease['last_seq']} (replay?)"
            )
        if body.interval_start < lease["started_at"] or body.interval_end > lease["window_end"]:
            raise UsageRejected(
                f"interval [{body.interval_start}, {body.interval_end}) lies outside the lease window "
                f"[{lease['started_at']}, {lease['window_end']})"
            )
        if body.interval_end > now:
            raise UsageRejected(f"interval ends at {body.interval_end}, after now ({now})")
        if now > lease["window_end"] + _window(conn):
            raise UsageRejected("the reporting period for this lease is over")
        if lease["last_interval_end"] is not None and body.interval_start < lease["last_interval_end"]:
            raise UsageRejected(
                f"interval starts at {body.interval_start}, overlapping the previous record (ends {lease['last_interval_end']})"
            )
        most = lease["devices"] * (body.interval_end - body.interval_start)
        if body.device_seconds > most:
            raise BadRequest(
                f"device_seconds {body.device_seconds} exceeds {lease['devices']} devices x interval = {most}"
            )
        record_id = conn.execute(
            usage_records.insert().values(
                lease_id=lease_id,
                seq=body.seq,
                interval_start=body.interval_start,
                interval_end=body.interval_end,
                device_seconds=body.device_seconds,
                evidence=body.evidence,
                signature=body.signature,
                received_at=now,
                state=REPORTED,
            )
        ).inserted_primary_key[0]
        conn.execute(
            update(leases)
            .where(leases.c.id == lease_id)
            .values(last_seq=body.seq, last_interval_end=body.interval_end)
        )
        record_initial(conn, RECORD, record_id, principal.actor, f"seq {body.seq}", now)
        audit(conn, principal.actor, "usage.report", f"record:{record_id}", now, lease=lease_id, seq=body.seq)
        theirs = conn.execute(
            select(measurements.c.device_seconds).where(
                measurements.c.lease_id == lease_id,
                measurements.c.interval_start == body.interval_start,
                measurements.c.interval_end == body.interval_end,
            )
        ).scalar()
        if theirs is not None and _mismatch(conn, body.device_seconds, theirs):
            record = {"id": record_id, "lease_id": lease_id, "device_seconds": body.device_seconds}
            _open_dispute(
                conn, record, SYSTEM, "tenant", theirs, body.device_seconds, "measurement mismatch", now
            )
        return _record_json(conn, record_id)

    return market.idempotent(principal, key, "usage.report", {"lease_id": lease_id, **body.model_dump()}, tx)


def submit_measurement(
    market: Market, principal: Principal, lease_id: int, body: MeasurementIn, key: str | None
) -> dict:
    """The tenant states, signed, what its job saw over an interval; a mismatch opens a dispute."""
    principal.require_role("tenant")

    def tx(conn: Connection, now: int) -> dict:
        lease = _lease_for(conn, lease_id, principal, "tenant")
        payload = measurement_payload(lease_id, body.interval_start, body.interval_end, body.device_seconds)
        verify(principal.public_key, payload, body.signature, "measurement")
        if lease["state"] not in USAGE_STATES:
            raise Conflict(f"lease {lease_id} is {lease['state']}; nothing to measure")
        if body.interval_start < lease["started_at"] or body.interval_end > lease["window_end"]:
            raise BadRequest("the measured interval lies outside the lease window")
        window = _window(conn)
        if now > lease["window_end"] + window:
            raise Conflict(
                f"lease {lease_id}'s reporting period ended at {lease['window_end'] + window}; measurements are closed"
            )
        exists = conn.execute(
            select(measurements.c.id).where(
                measurements.c.lease_id == lease_id,
                measurements.c.interval_start == body.interval_start,
                measurements.c.interval_end == body.interval_end,
            )
        ).scalar()
        if exists is not None:
            raise Conflict("a measurement for this interval was already submitted")
        record = (
            conn.execute(
                select(usage_records).where(
                    usage_records.c.lease_id == lease_id,
                    usage_records.c.interval_start == body.interval_start,
                    usage_records.c.interval_end == body.interval_end,
                )
            )
            .mappings()
            .one_or_none()
        )
        if record is not None and now > record["received_at"] + window:
            # Past the record's window it counts as accepted and may already be paid; settlement
            # never takes money back, so a measurement now could change nothing.
            raise Conflict(
                f"record {record['id']}'s dispute window has closed; a measurement of it comes too late"
            )
        conn.execute(
            measurements.insert().values(
                lease_id=lease_id,
                interval_start=body.interval_start,
                interval_end=body.interval_end,
                device_seconds=body.device_seconds,
                signature=body.signature,
                received_at=now,
            )
        )
        audit(
            conn,
            principal.actor,
            "usage.measure",
            f"lease:{lease_id}",
            now,
            interval=[body.interval_start, body.interval_end],
        )
        dispute_id = None
        if (
            record is not None
            and record["state"] == REPORTED
            and _mismatch(conn, record["device_seconds"], body.device_seconds)
        ):
            dispute_id = _open_dispute(
                conn,
                dict(record),
                SYSTEM,
                "tenant",
                body.device_seconds,
                record["device_seconds"],
                "measurement mismatch",
                now,
            )
        return {
            "lease_id": lease_id,
            "record_id": None if record is None else record["id"],
            "dispute_id": dispute_id,
        }

    return market.idempotent(principal, key, "usage.measure", {"lease_id": lease_id, **body.model_dump()}, tx)


def acknowledge(market: Market, principal: Principal, record_id: int, body: AckIn, key: str | None) -> dict:
    """The tenant accepts a record, in full or for fewer device-seconds."""
    principal.require_role("tenant")

    def tx(conn: Connection, now: int) -> dict:
        record = _disputable_record(conn, record_id, principal, now)
        accepted = (
            record["device_seconds"] if body.accepted_device_seconds is None else body.accepted_device_seconds
        )
        if accepted > record["device_seconds"]:
            raise BadRequest(
                f"cannot accept {accepted} device-seconds of a record of {record['device_seconds']}"
            )
        to = ACKNOWLEDGED if accepted == record["device_seconds"] else PART_ACKNOWLEDGED
        transition(
            conn, RECORD, record_id, to, principal.actor, f"accepted {accepted}", now,
            expect=REPORTED, acked_device_seconds=accepted, acked_at=now,
        )  # fmt: skip
        audit(conn, principal.actor, "usage.ack", f"record:{record_id}", now, accepted=accepted)
        return _record_json(conn, record_id)

    return market.idempotent(principal, key, "usage.ack", {"record_id": record_id, **body.model_dump()}, tx)


def dispute(market: Market, principal: Principal, record_id: int, body: DisputeIn, key: str | None) -> dict:
    """The tenant disputes a record within the window, saying what it believes was used."""
    principal.require_role("tenant")

    def tx(conn: Connection, now: int) -> dict:
        record = _disputable_record(conn, record_id, principal, now)
        if record["state"] != REPORTED:
            raise Conflict(f"record {record_id} is {record['state']}; only a reported record can be disputed")
        if body.claimed_device_seconds >= record["device_seconds"]:
            raise BadRequest("a dispute claims fewer device-seconds than the record")
        dispute_id = _open_dispute(
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
        record = _record_for(conn, record_id, principal, "provider")
        if record["state"] != PART_ACKNOWLEDGED:
            raise Conflict(
                f"record {record_id} is {record['state']}; only a partial acknowledgement can be contested"
            )
        if now > record["acked_at"] + _window(conn):
            raise Conflict("the window to contest this acknowledgement has closed")
        dispute_id = _open_dispute(
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


def _record_json(conn: Connection, record_id: int) -> dict:
    return dict(conn.execute(select(usage_records).where(usage_records.c.id == record_id)).mappings().one())


def dispute_json(conn: Connection, dispute_id: int) -> dict:
    return dict(conn.execute(select(disputes).where(disputes.c.id == dispute_id)).mappings().one())


def lease_usage(market: Market, principal: Principal, lease_id: int) -> dict:
    """Records, measurements and disputes of one lease, for its parties and operators."""
    get_lease(market, principal, lease_id)  # ownership check

    def tx(conn: Connection, now: int) -> dict:
        def rows(table):  # type: ignore[no-untyped-def]
            return [
                dict(r)
                for r in conn.execute(
                    select(table).where(table.c.lease_id == lease_id).order_by(table.c.id)
                ).mappings()
            ]

        return {
            "lease_id": lease_id,
            "records": rows(usage_records),
            "measurements": rows(measurements),
            "disputes": rows(disputes),
        }

    return market.read(tx)


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
