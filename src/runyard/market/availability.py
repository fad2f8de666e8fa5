"""Availability of standing leases: the provider's signed availability records, the tenant's own
probe results, notice, the endpoint, and the periods as they stand.

An availability record is the usage record of a standing lease. It is accepted only if its
signature verifies (payloads.availability_record), its sequence number is the last one plus 1 (`check_seq`),
its interval lies inside one billing period of the lease (never across a period's close), has ended,
does not overlap the previous record, arrives before that period's reports close (its end plus the
dispute window), and its counts could all be true (available seconds within the interval, healthy
probes within the probes, no available time without a healthy probe). It is stored as a record of
kind "availability" whose device-seconds are its available seconds times the lease's devices, so
acknowledging, disputing and resolving it are the same operations as for usage.

A tenant's probe results for the same interval that saw less, beyond the market's tolerance, open a
dispute by themselves claiming what the tenant's probes saw (as a measurement does for usage).
"""

from __future__ import annotations

from sqlalchemy import Connection, select, update

from runyard.market.errors import BadRequest, Conflict, UsageRejected
from runyard.market.leases import get_lease, lease_json
from runyard.market.payloads import availability_record, tenant_probes
from runyard.market.periods import period_for, periods_of, ran_until
from runyard.market.rows import lock_lease_as
from runyard.market.schema import leases, measurements, usage_records
from runyard.market.service import Market, Principal, audit
from runyard.market.signing import verify
from runyard.market.standing import AvailabilityIn, EndpointIn, NoticeIn, ProbesIn
from runyard.market.states import SYSTEM, record_initial
from runyard.market.states.lease import ACCEPTED, RUNNING
from runyard.market.states.period import SETTLED as PERIOD_SETTLED
from runyard.market.states.record import RECORD, REPORTED
from runyard.market.usage_rules import (
    USAGE_STATES,
    check_seq,
    dispute_window,
    lease_for,
    mismatch,
    open_dispute,
    record_json,
)


def _standing(lease: dict, what: str) -> None:
    if lease["form"] != "standing":
        raise UsageRejected(f"lease {lease['id']} is a block lease; {what} belongs to a standing lease "
                            "(a block lease reports usage)")


def _period_open_for_reports(conn: Connection, lease: dict, start: int, end: int, now: int, what: str) -> dict:
    period = period_for(conn, lease, start, end, what)
    closes = ran_until(period) + dispute_window(conn)
    if period["state"] == PERIOD_SETTLED or now > closes:
        raise UsageRejected(f"period {period['seq']} of lease {lease['id']} closed its reports at {closes}; "
                            f"{what} for it comes too late")
    if end > now:
        raise UsageRejected(f"{what} ends at {end}, after now ({now})")
    return period


def report_availability(market: Market, principal: Principal, lease_id: int, body: AvailabilityIn,
                        key: str | None) -> dict:
    """The provider reports one signed availability record of a standing lease."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        principal.require_verified("report availability", conn)  # nothing after a revocation
        lease = lease_for(conn, lease_id, principal, "provider")
        payload = availability_record(lease_id, body.seq, body.interval_start, body.interval_end,
                                      body.available_seconds, body.probes, body.probes_ok, body.requests,
                                      body.latency_p50_ms, body.latency_p99_ms)
        verify(principal.public_key, payload, body.signature, "availability record")
        _standing(lease, "an availability record")
        if lease["state"] not in USAGE_STATES:
            raise UsageRejected(f"lease {lease_id} is {lease['state']}; availability is reported once it has started")
        check_seq(lease, body.seq)
        period = _period_open_for_reports(conn, lease, body.interval_start, body.interval_end, now,
                                          "the availability record's interval")
        if lease["last_interval_end"] is not None and body.interval_start < lease["last_interval_end"]:
            raise UsageRejected(f"interval starts at {body.interval_start}, overlapping the previous record "
                                f"(ends {lease['last_interval_end']})")
        record_id = conn.execute(
            usage_records.insert().values(
                lease_id=lease_id, seq=body.seq, interval_start=body.interval_start,
                interval_end=body.interval_end, device_seconds=body.available_seconds * lease["devices"],
                evidence=None, signature=body.signature, received_at=now, state=REPORTED, kind="availability",
                period_id=period["id"], available_seconds=body.available_seconds, probes=body.probes,
                probes_ok=body.probes_ok, requests=body.requests, latency_p50_ms=body.latency_p50_ms,
                latency_p99_ms=body.latency_p99_ms,
            )
        ).inserted_primary_key[0]  # fmt: skip
        conn.execute(update(leases).where(leases.c.id == lease_id)
                     .values(last_seq=body.seq, last_interval_end=body.interval_end))
        record_initial(conn, RECORD, record_id, principal.actor, f"seq {body.seq}", now)
        audit(conn, principal.actor, "availability.report", f"record:{record_id}", now, lease=lease_id, seq=body.seq,
              available=body.available_seconds)
        theirs = conn.execute(select(measurements.c.device_seconds).where(
            measurements.c.lease_id == lease_id, measurements.c.interval_start == body.interval_start,
            measurements.c.interval_end == body.interval_end)).scalar()
        reported = body.available_seconds * lease["devices"]
        if theirs is not None and mismatch(conn, reported, theirs):
            record = {"id": record_id, "lease_id": lease_id, "device_seconds": reported}
            open_dispute(conn, record, SYSTEM, "tenant", theirs, reported, "tenant probes disagree", now)
        return record_json(conn, record_id)

    return market.idempotent(principal, key, "availability.report", {"lease_id": lease_id, **body.model_dump()}, tx)


def submit_probes(market: Market, principal: Principal, lease_id: int, body: ProbesIn, key: str | None) -> dict:
    """The tenant states, signed, what its own probes of its endpoint saw over an interval; when the
    provider's record of that interval reports more, beyond the tolerance, a dispute opens."""
    principal.require_role("tenant")

    def tx(conn: Connection, now: int) -> dict:
        lease = lease_for(conn, lease_id, principal, "tenant")
        payload = tenant_probes(lease_id, body.interval_start, body.interval_end, body.available_seconds,
                                body.probes, body.probes_ok)
        verify(principal.public_key, payload, body.signature, "probe results")
        _standing(lease, "probe results")
        if lease["state"] not in USAGE_STATES:
            raise Conflict(f"lease {lease_id} is {lease['state']}; nothing to probe")
        try:
            _period_open_for_reports(conn, lease, body.interval_start, body.interval_end, now, "the probed interval")
        except UsageRejected as exc:
            raise BadRequest(exc.message, **exc.detail) from None
        exists = conn.execute(select(measurements.c.id).where(
            measurements.c.lease_id == lease_id, measurements.c.interval_start == body.interval_start,
            measurements.c.interval_end == body.interval_end)).scalar()
        if exists is not None:
            raise Conflict("probe results for this interval were already submitted")
        record = conn.execute(select(usage_records).where(
            usage_records.c.lease_id == lease_id, usage_records.c.interval_start == body.interval_start,
            usage_records.c.interval_end == body.interval_end)).mappings().one_or_none()
        if record is not None and now > record["received_at"] + dispute_window(conn):
            raise Conflict(f"record {record['id']}'s dispute window has closed; probe results for it come too late")
        seen = body.available_seconds * lease["devices"]
        conn.execute(measurements.insert().values(
            lease_id=lease_id, interval_start=body.interval_start, interval_end=body.interval_end,
            device_seconds=seen, signature=body.signature, received_at=now, kind="probes",
            available_seconds=body.available_seconds, probes=body.probes, probes_ok=body.probes_ok))
        audit(conn, principal.actor, "availability.probes", f"lease:{lease_id}", now,
              interval=[body.interval_start, body.interval_end], available=body.available_seconds)
        dispute_id = None
        if record is not None and record["state"] == REPORTED and mismatch(conn, record["device_seconds"], seen):
            dispute_id = open_dispute(conn, dict(record), SYSTEM, "tenant", seen, record["device_seconds"],
                                      "tenant probes disagree", now)
        return {"lease_id": lease_id, "record_id": None if record is None else record["id"], "dispute_id": dispute_id}

    return market.idempotent(principal, key, "availability.probes", {"lease_id": lease_id, **body.model_dump()}, tx)


def give_notice(market: Market, principal: Principal, lease_id: int, body: NoticeIn, key: str | None) -> dict:
    """Either party (or an operator) ends a running standing lease by notice: it ends at the first
    period close at least the listing's notice away and not inside the committed term. Notice given
    twice keeps the earlier end."""
    principal.require_role("tenant", "provider", "operator")

    def tx(conn: Connection, now: int) -> dict:
        lease = get_locked(conn, lease_id, principal)
        if lease["form"] != "standing":
            raise Conflict(f"lease {lease_id} is a block lease: it ends with its window (or terminate it)")
        if lease["state"] != RUNNING:
            raise Conflict(f"lease {lease_id} is {lease['state']}; notice is given on a running standing lease "
                           "(cancel or reject one that has not started)")
        period, start = lease["period_s"], lease["started_at"]
        earliest = max(now + lease["notice_s"], start + period * lease["term_periods"])
        ends_at = start + period * -(-(earliest - start) // period)
        if lease["ends_at"] is None or ends_at < lease["ends_at"]:
            conn.execute(update(leases).where(leases.c.id == lease_id)
                         .values(ends_at=ends_at, notice_by=str(principal.actor)))
            audit(conn, principal.actor, "lease.notice", f"lease:{lease_id}", now, ends_at=ends_at, note=body.note)
        return _reread(conn, lease_id)

    return market.idempotent(principal, key, "lease.notice", {"lease_id": lease_id, **body.model_dump()}, tx)


def publish_endpoint(market: Market, principal: Principal, lease_id: int, body: EndpointIn, key: str | None) -> dict:
    """The provider says where the tenant reaches its deployment (shown to the lease's parties)."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        lease = lock_lease_as(conn, lease_id, principal, "provider")
        if lease["form"] != "standing":
            raise Conflict(f"lease {lease_id} is a block lease; only a standing lease serves an endpoint")
        if lease["state"] not in (ACCEPTED, RUNNING):
            raise Conflict(f"lease {lease_id} is {lease['state']}; an endpoint is published for an accepted or "
                           "running lease")
        conn.execute(update(leases).where(leases.c.id == lease_id).values(endpoint_url=body.endpoint_url))
        audit(conn, principal.actor, "lease.endpoint", f"lease:{lease_id}", now, url=body.endpoint_url)
        return _reread(conn, lease_id)

    return market.idempotent(principal, key, "lease.endpoint", {"lease_id": lease_id, **body.model_dump()}, tx)


def lease_periods(market: Market, principal: Principal, lease_id: int) -> list[dict]:
    """A standing lease's billing periods, with each settled one's figures."""
    get_lease(market, principal, lease_id)  # ownership check
    return market.read(lambda conn, now: periods_of(conn, lease_id))


def get_locked(conn: Connection, lease_id: int, principal: Principal) -> dict:
    """A lease locked for a party (either side) or an operator."""
    side = "tenant" if principal.role == "tenant" else "provider"
    return lock_lease_as(conn, lease_id, principal, side)


def _reread(conn: Connection, lease_id: int) -> dict:
    return lease_json(conn.execute(select(leases).where(leases.c.id == lease_id)).mappings().one())
