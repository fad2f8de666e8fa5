"""When a usage or availability record counts, and for how much: the one rule block settlement,
period settlement and the audit share.

A record counts as accepted:
  acknowledged                      -> its device-seconds
  part_acknowledged, window passed  -> the acknowledged part (the provider did not contest)
  disputed, its dispute decided     -> the resolution's device-seconds
  resolved                          -> the resolution's device-seconds
  reported, window passed           -> its device-seconds (silence is consent)
and is held otherwise; never more than the record reported. (An availability record's
device-seconds are its available seconds times the lease's devices.)
"""

from __future__ import annotations

from sqlalchemy import Connection, select

from runyard.market.schema import disputes, usage_records
from runyard.market.states.dispute import OPEN as DISPUTE_OPEN
from runyard.market.states.record import ACKNOWLEDGED, DISPUTED, PART_ACKNOWLEDGED, REPORTED, RESOLVED


def accepted_seconds(record: dict, dispute: dict | None, now: int, window: int) -> int | None:
    """Device-seconds of `record` accepted as of `now`, or None while it is held."""
    value = _accepted(record, dispute, now, window)
    return None if value is None else min(value, record["device_seconds"])


def _accepted(record: dict, dispute: dict | None, now: int, window: int) -> int | None:
    state = record["state"]
    if state == ACKNOWLEDGED:
        return record["device_seconds"]
    if state == RESOLVED:
        return record["acked_device_seconds"]
    if state == PART_ACKNOWLEDGED:
        return record["acked_device_seconds"] if now > record["acked_at"] + window else None
    if state == DISPUTED:
        assert dispute is not None, f"record {record['id']} is disputed without a dispute row"
        return None if dispute["state"] == DISPUTE_OPEN else dispute["resolved_device_seconds"]
    if state == REPORTED:
        return record["device_seconds"] if now > record["received_at"] + window else None
    raise AssertionError(f"unknown record state {state!r}")


def tally(conn: Connection, lease_id: int, now: int, window: int, period_id: int | None = None) -> tuple[int, int, int]:
    """(accepted device-seconds, held device-seconds, held records) of a lease's records as of `now`;
    with `period_id`, of that billing period's records only."""
    query = select(usage_records).where(usage_records.c.lease_id == lease_id)
    if period_id is not None:
        query = query.where(usage_records.c.period_id == period_id)
    by_record = {
        d["record_id"]: dict(d)
        for d in conn.execute(select(disputes).where(disputes.c.lease_id == lease_id)).mappings()
    }
    accepted = held = held_records = 0
    for record in conn.execute(query).mappings():
        value = accepted_seconds(dict(record), by_record.get(record["id"]), now, window)
        if value is None:
            held += record["device_seconds"]
            held_records += 1
        else:
            accepted += value
    return accepted, held, held_records
