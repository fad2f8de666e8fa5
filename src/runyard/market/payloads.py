"""The payloads parties sign, built in one place so that client and server agree byte for byte.

Each carries a `type` so that a signature over one kind of payload can never be replayed as
another, and the lease id so that it cannot be replayed on another lease.
"""

from __future__ import annotations


def lease_terms(lease: dict, currency: str) -> dict:
    """What a provider signs to accept a lease."""
    return {
        "type": "runyard.market.lease_acceptance.v1",
        "lease_id": lease["id"],
        "demand_id": lease["demand_id"],
        "listing_id": lease["listing_id"],
        "tenant_id": lease["tenant_id"],
        "provider_id": lease["provider_id"],
        "devices": lease["devices"],
        "price_per_device_hour": lease["price_per_device_hour"],
        "duration_s": lease["duration_s"],
        "escrow_amount": lease["escrow_amount"],
        "fee_bps": lease["fee_bps"],
        "currency": currency,
        # The job the provider agrees to run (runyard.market.jobs.job_sha256); None without one.
        "job_sha256": lease.get("job_sha256"),
    }


def usage_record(
    lease_id: int,
    seq: int,
    interval_start: int,
    interval_end: int,
    device_seconds: int,
    evidence: str | None = None,
) -> dict:
    """What a provider signs to report utilisation for one interval of a lease."""
    return {
        "type": "runyard.market.usage_record.v1",
        "lease_id": lease_id,
        "seq": seq,
        "interval_start": interval_start,
        "interval_end": interval_end,
        "device_seconds": device_seconds,
        "evidence": evidence,
    }


def measurement(lease_id: int, interval_start: int, interval_end: int, device_seconds: int) -> dict:
    """What a tenant signs to state its own view of the devices it had over an interval."""
    return {
        "type": "runyard.market.tenant_measurement.v1",
        "lease_id": lease_id,
        "interval_start": interval_start,
        "interval_end": interval_end,
        "device_seconds": device_seconds,
    }
