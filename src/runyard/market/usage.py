"""Usage of block leases: the provider's signed records, the tenant's measurements and
acknowledgements, and a lease's usage as a whole.

A record is accepted only if its signature verifies against the provider's registered key over the
canonical payload (payloads.usage_record), its sequence number is the last one plus 1 (`check_seq`), its
interval lies inside the lease's window, does not overlap the previous record and has already
ended, and it claims no more device-seconds than the lease's devices could give. A standing lease
reports availability instead (`availability`); disputes of either kind are in `disputes`.
"""

from __future__ import annotations

from sqlalchemy import Connection, select, update

from runyard.market.errors import BadRequest, Conflict, UsageRejected
from runyard.market.leases import get_lease
from runyard.market.models import AckIn, MeasurementIn, UsageIn
from runyard.market.payloads import measurement as measurement_payload
from runyard.market.payloads import usage_record
from runyard.market.schema import disputes, leases, measurements, usage_records
from runyard.market.service import Market, Principal, audit
from runyard.market.signing import verify
from runyard.market.states import SYSTEM, record_initial, transition
from runyard.market.states.record import ACKNOWLEDGED, PART_ACKNOWLEDGED, RECORD, REPORTED
from runyard.market.usage_rules import (
    USAGE_STATES,
    check_seq,
    disputable_record,
    dispute_window,
    lease_for,
    mismatch,
    open_dispute,
    record_json,
)


def report(market: Market, principal: Principal, lease_id: int, body: UsageIn, key: str | None) -> dict:
    """The provider reports one signed usage record."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        # Usage is billable only while the provider is verified (revocation's rule: nothing after).
        principal.require_verified("report usage", conn)
        lease = lease_for(conn, lease_id, principal, "provider")
        payload = usage_record(
            lease_id, body.seq, body.interval_start, body.interval_end, body.device_seconds, body.evidence
        )
        verify(principal.public_key, payload, body.signature, "usage record")
        if lease["form"] == "standing":
            raise UsageRejected(f"lease {lease_id} is a standing lease: it reports availability "
                                f"(POST /v1/leases/{lease_id}/availability), not usage")
        if lease["state"] not in USAGE_STATES:
            raise UsageRejected(
                f"lease {lease_id} is {lease['state']}; usage is reported only once it has started"
            )
        check_seq(lease, body.seq)
        if body.interval_start < lease["started_at"] or body.interval_end > lease["window_end"]:
            raise UsageRejected(
                f"interval [{body.interval_start}, {body.interval_end}) lies outside the lease window "
                f"[{lease['started_at']}, {lease['window_end']})"
            )
        if body.interval_end > now:
            raise UsageRejected(f"interval ends at {body.interval_end}, after now ({now})")
        if now > lease["window_end"] + dispute_window(conn):
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
        if theirs is not None and mismatch(conn, body.device_seconds, theirs):
            record = {"id": record_id, "lease_id": lease_id, "device_seconds": body.device_seconds}
            open_dispute(
                conn, record, SYSTEM, "tenant", theirs, body.device_seconds, "measurement mismatch", now
            )
        return record_json(conn, record_id)

    return market.idempotent(principal, key, "usage.report", {"lease_id": lease_id, **body.model_dump()}, tx)


def submit_measurement(
    market: Market, principal: Principal, lease_id: int, body: MeasurementIn, key: str | None
) -> dict:
    """The tenant states, signed, what its job saw over an interval; a mismatch opens a dispute."""
    principal.require_role("tenant")

    def tx(conn: Connection, now: int) -> dict:
        lease = lease_for(conn, lease_id, principal, "tenant")
        payload = measurement_payload(lease_id, body.interval_start, body.interval_end, body.device_seconds)
        verify(principal.public_key, payload, body.signature, "measurement")
        if lease["form"] == "standing":
            raise Conflict(f"lease {lease_id} is a standing lease: the tenant submits probe results "
                           f"(POST /v1/leases/{lease_id}/probes), not measurements")
        if lease["state"] not in USAGE_STATES:
            raise Conflict(f"lease {lease_id} is {lease['state']}; nothing to measure")
        if body.interval_start < lease["started_at"] or body.interval_end > lease["window_end"]:
            raise BadRequest("the measured interval lies outside the lease window")
        window = dispute_window(conn)
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
            and mismatch(conn, record["device_seconds"], body.device_seconds)
        ):
            dispute_id = open_dispute(
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
        record = disputable_record(conn, record_id, principal, now)
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
        return record_json(conn, record_id)

    return market.idempotent(principal, key, "usage.ack", {"record_id": record_id, **body.model_dump()}, tx)


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
