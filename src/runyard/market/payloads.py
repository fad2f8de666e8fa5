"""The payloads parties sign, built in one place so that client and server agree byte for byte.

Each carries a `type` so that a signature over one kind of payload can never be replayed as
another, and the lease id so that it cannot be replayed on another lease.
"""

from __future__ import annotations

import json


def lease_terms(lease: dict, currency: str) -> dict:
    """What a provider signs to accept a lease (a standing lease: `standing_lease_terms`)."""
    if lease.get("form") == "standing":
        return standing_lease_terms(lease, currency)
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


def standing_lease_terms(lease: dict, currency: str) -> dict:
    """What a provider signs to accept a standing lease: the shape, the period's prices, the
    commitment and its credit rule, the notice, and the deployment it will serve."""
    rule = lease.get("credit_rule")
    return {
        "type": "runyard.market.standing_lease_acceptance.v1",
        "lease_id": lease["id"],
        "demand_id": lease["demand_id"],
        "listing_id": lease["listing_id"],
        "tenant_id": lease["tenant_id"],
        "provider_id": lease["provider_id"],
        "devices": lease["devices"],
        "price_per_device_hour": lease["price_per_device_hour"],
        "period_s": lease["period_s"],
        "term_periods": lease["term_periods"],
        "period_price": lease["period_price"],
        "renewal_price": lease["renewal_price"],
        "discount_bps": lease["discount_bps"],
        "availability_bps": lease["availability_bps"],
        "credit_rule": json.loads(rule) if isinstance(rule, str) else rule,
        "notice_s": lease["notice_s"],
        "escrow_amount": lease["escrow_amount"],
        "fee_bps": lease["fee_bps"],
        "currency": currency,
        # The model the provider agrees to serve (runyard.market.serving.deployment_sha256).
        "deployment_sha256": lease.get("deployment_sha256"),
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


def availability_record(
    lease_id: int,
    seq: int,
    interval_start: int,
    interval_end: int,
    available_seconds: int,
    probes: int,
    probes_ok: int,
    requests: int,
    latency_p50_ms: int | None = None,
    latency_p99_ms: int | None = None,
) -> dict:
    """What a provider signs to report a standing lease's availability over one interval: the seconds
    its health probes found the endpoint up, with the probes and the requests served as evidence."""
    return {
        "type": "runyard.market.availability_record.v1",
        "lease_id": lease_id,
        "seq": seq,
        "interval_start": interval_start,
        "interval_end": interval_end,
        "available_seconds": available_seconds,
        "probes": probes,
        "probes_ok": probes_ok,
        "requests": requests,
        "latency_p50_ms": latency_p50_ms,
        "latency_p99_ms": latency_p99_ms,
    }


def tenant_probes(
    lease_id: int, interval_start: int, interval_end: int, available_seconds: int, probes: int, probes_ok: int
) -> dict:
    """What a tenant signs to state what its own probes of its endpoint saw over an interval."""
    return {
        "type": "runyard.market.tenant_probes.v1",
        "lease_id": lease_id,
        "interval_start": interval_start,
        "interval_end": interval_end,
        "available_seconds": available_seconds,
        "probes": probes,
        "probes_ok": probes_ok,
    }
