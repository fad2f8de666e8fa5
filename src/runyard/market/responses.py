"""Response bodies of the HTTP API, so that the OpenAPI document says what every answer holds.

Each model lists every field the market sends; unknown extra fields are allowed through (a newer
market may add some), which a client must ignore.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runyard.market.models import EndReason, LeaseStateName
from runyard.market.requirement import Requirement
from runyard.market.standing import Form

AccountState = Literal["unverified", "pending", "verified", "rejected"]
AccountRole = Literal["tenant", "provider", "operator"]
DemandState = Literal["open", "matched", "cancelled", "expired"]
ListingState = Literal["open", "withdrawn"]
RecordState = Literal["reported", "acknowledged", "part_acknowledged", "disputed", "resolved"]
DisputeState = Literal["open", "upheld", "partial", "rejected", "withdrawn"]
PeriodState = Literal["running", "closed", "settled"]
RolloutState = Literal["requested", "switched", "failed", "withdrawn"]
RecordKind = Literal["usage", "availability"]
ErrorCode = Literal[
    "bad_request", "invalid_request", "unauthenticated", "forbidden", "not_verified", "not_found",
    "conflict", "invalid_transition", "idempotency_key_reused", "insufficient_funds", "signature_invalid",
    "usage_rejected", "payload_too_large", "store_busy", "escrow_short", "limit_exceeded", "internal",
]  # fmt: skip


class Out(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ErrorOut(Out):
    """The error envelope of every 4xx and 5xx answer; a refused request changed nothing."""

    error: ErrorCode
    message: str
    detail: dict[str, Any] | None = None


class Health(Out):
    ok: bool


class MarketInfo(Out):
    currency: str
    fee_bps: int
    dispute_window_s: int
    accept_timeout_s: int
    start_timeout_s: int
    tolerance_bps: int
    test_clock: bool
    clock_offset_s: int
    deposit_limit_per_day: int
    withdrawal_limit_per_day: int
    balance_limit: int
    now: int = Field(description="the market's clock, Unix seconds")


class Registered(Out):
    id: int
    name: str
    role: AccountRole
    state: AccountState
    token: str = Field(description="the API token; shown once, stored by the market only as a hash")


class AccountOut(Out):
    id: int
    name: str
    role: AccountRole
    state: AccountState
    public_key: str | None = None


class VerificationOut(Out):
    id: int
    state: AccountState


class BalanceOut(Out):
    code: str
    posted: int
    available: int
    pending_out: int
    pending_in: int


class MoneyMoved(Out):
    transfer_id: int
    amount: int
    balance: BalanceOut


class HeldEarningsOut(Out):
    lease_id: int
    earnings_hold: Literal["released", "refunded"]
    amount: int = Field(description="minor units moved out of the lease's held account")
    to: str = Field(description="the ledger account that received them")


class Balances(Out):
    currency: str
    accounts: list[BalanceOut]


class Entry(Out):
    transfer_id: int
    at: int
    kind: Literal["single", "pending", "post", "void"]
    reason: str
    from_: str = Field(alias="from")
    to: str
    amount: int
    lease_id: int | None
    demand_id: int | None


class LeaseLine(Out):
    lease_id: int
    state: LeaseStateName
    devices: int
    price_per_device_hour: int
    escrow_amount: int
    fee_bps: int
    charged: int
    paid_provider: int
    fee: int
    refunded: int
    credited: int = Field(description="credits a standing lease returned under its listing's rule")
    form: Form


class StatementAccount(Out):
    id: int
    name: str
    role: AccountRole


class Statement(Out):
    account: StatementAccount
    currency: str
    market_fee_bps: int
    balances: dict[str, BalanceOut]
    entries: list[Entry]
    leases: list[LeaseLine]
    totals: dict[str, int | bool] = Field(description="role-specific totals; `reconciles` says they add up")


class PayoutMethodOut(Out):
    id: int
    rail: str
    destination: str
    created_at: int


class RailEventOut(Out):
    event_id: str
    rail: str
    account_id: int
    amount: int
    transfer_id: int
    duplicate: bool = Field(description="true when this event id was applied before (nothing moved now)")


class CreditTierOut(Out):
    below_bps: int
    credit_bps: int


class ReservedTermOut(Out):
    periods: int
    discount_bps: int


class StandingTermsOut(Out):
    """A standing listing's terms (runyard.market.standing)."""

    period_s: int
    min_term_periods: int
    notice_s: int
    availability_bps: int
    credits: list[CreditTierOut]
    reserved: list[ReservedTermOut]


class ListingOut(Out):
    id: int
    provider_id: int
    accelerator_kind: str
    devices_per_node: int
    node_count: int
    capacity: int
    reserved: int
    interconnect: str
    interconnect_gbps: int
    region: str
    jurisdiction: str
    price_per_device_hour: int
    available_from: int
    available_until: int
    start_class: Literal["immediate", "queued"]
    max_queue_s: int
    scheduler_kind: str
    state: ListingState
    leases_expired: int
    leases_completed: int
    created_at: int
    memory_gib: int
    form: Form
    standing: StandingTermsOut | None = Field(description="the terms of a standing listing; null for a block")


class DemandOut(Out):
    id: int
    tenant_id: int
    requirement: Requirement
    device_count: int
    duration_s: int
    max_price_per_device_hour: int
    latest_start: int | None
    escrow_account_id: int | None
    escrow_pending_id: int | None
    escrow_amount: int
    state: DemandState
    lease_id: int | None
    created_at: int
    job: dict[str, Any] | None = Field(default=None, description="the demand's job; only its tenant sees it")
    form: Form
    standing: dict[str, int] | None = Field(description="a standing demand's period and term")
    deployment: dict[str, Any] | None = Field(
        default=None, description="a standing demand's deployment; only its tenant sees it"
    )


class LeaseOut(Out):
    id: int
    demand_id: int
    listing_id: int
    tenant_id: int
    provider_id: int
    devices: int
    price_per_device_hour: int
    duration_s: int
    fee_bps: int
    escrow_account_id: int
    escrow_amount: int
    state: LeaseStateName
    created_at: int
    accept_by: int
    start_by: int
    started_at: int | None
    window_end: int | None
    terms_signature: str | None
    end_reason: EndReason | None
    last_seq: int
    last_interval_end: int | None
    paid_provider: int
    paid_fee: int
    refunded: int
    job_sha256: str | None = Field(default=None, description="digest of the job the acceptance signs")
    job: dict[str, Any] | None = Field(default=None, description="the job; only the lease's parties see it")
    form: Form
    period_s: int | None = Field(description="a standing lease's billing period, seconds")
    term_periods: int | None = Field(description="periods committed to (escrowed when the lease was made)")
    period_price: int | None = Field(description="a committed period's price (after the reserved discount)")
    renewal_price: int | None = Field(description="a renewed period's price")
    discount_bps: int | None
    availability_bps: int | None = Field(description="committed availability per period")
    credit_rule: list[CreditTierOut] | None
    notice_s: int | None
    ends_at: int | None = Field(description="the period close at which the lease ends, once notice is given")
    notice_by: str | None
    endpoint_url: str | None = Field(description="where the tenant reaches its deployment")
    credited: int
    deployment_sha256: str | None = Field(default=None, description="digest of the deployment the acceptance signs")
    earnings_hold: Literal["held", "released", "refunded"] | None = Field(
        default=None, description="set when the provider's verification was revoked before the lease settled: its "
        "provider share is held for the operator's decision (released to the provider or refunded to the tenant)")
    deployment: dict[str, Any] | None = Field(
        default=None, description="the deployment; only the lease's parties see it"
    )


class LeaseTerms(Out):
    """What a provider signs to accept a lease (docs/market-protocol.md)."""

    type: Literal["runyard.market.lease_acceptance.v1"]
    lease_id: int
    demand_id: int
    listing_id: int
    tenant_id: int
    provider_id: int
    devices: int
    price_per_device_hour: int
    duration_s: int
    escrow_amount: int
    fee_bps: int
    currency: str
    job_sha256: str | None


class StandingLeaseTerms(Out):
    """What a provider signs to accept a standing lease (docs/market-protocol.md)."""

    type: Literal["runyard.market.standing_lease_acceptance.v1"]
    lease_id: int
    demand_id: int
    listing_id: int
    tenant_id: int
    provider_id: int
    devices: int
    price_per_device_hour: int
    period_s: int
    term_periods: int
    period_price: int
    renewal_price: int
    discount_bps: int
    availability_bps: int
    credit_rule: list[CreditTierOut]
    notice_s: int
    escrow_amount: int
    fee_bps: int
    currency: str
    deployment_sha256: str | None


class LeaseWithTerms(LeaseOut):
    terms: Annotated[LeaseTerms | StandingLeaseTerms, Field(discriminator="type")]


class PeriodOut(Out):
    """One billing period of a standing lease; the figures once it is settled."""

    id: int
    lease_id: int
    seq: int
    period_start: int
    period_end: int
    ended_at: int | None
    price: int
    funding: Literal["prepaid", "renewal"]
    state: PeriodState
    available_device_seconds: int | None
    availability_bps: int | None
    charge: int | None = Field(description="for the time available")
    credit: int | None = Field(description="credited to the tenant under the listing's rule")
    paid_provider: int
    paid_fee: int
    refunded: int
    settled_at: int | None


class RolloutOut(Out):
    """One roll-out of a standing lease: what the tenant asked the provider to serve, and how it ended."""

    id: int
    lease_id: int
    seq: int = Field(description="1, 2, ... per lease")
    kind: Literal["rollout", "rollback"]
    state: RolloutState
    requested_at: int
    finished_at: int | None
    export_sha256: str | None = Field(description="digest of the new export's files and URLs (null for a roll-back)")
    export_digest: str | None = Field(description="the runyard export serving after the switch, as the provider "
                                                  "reports it (its runyard.json's sha256)")
    detail: str | None = Field(description="the provider's words on how it ended (why a switch failed)")
    export: dict[str, Any] | None = Field(
        default=None, description="the new export's files and URLs; only the lease's parties see it")


class SettlementOut(Out):
    lease_id: int
    state: LeaseStateName
    escrow_amount: int
    paid_provider: int
    paid_fee: int
    refunded: int
    escrow_remaining: int
    moved_now: int
    accepted_device_seconds: int
    held_device_seconds: int
    held_records: int
    charge: int
    fee: int
    credited: int
    periods: list[PeriodOut] | None = Field(default=None, description="a standing lease's periods")


class RecordOut(Out):
    id: int
    lease_id: int
    seq: int
    interval_start: int
    interval_end: int
    device_seconds: int
    evidence: str | None
    signature: str
    received_at: int
    state: RecordState
    acked_device_seconds: int | None
    acked_at: int | None
    kind: RecordKind
    period_id: int | None
    available_seconds: int | None
    probes: int | None
    probes_ok: int | None
    requests: int | None
    latency_p50_ms: int | None
    latency_p99_ms: int | None


class MeasurementRow(Out):
    id: int
    lease_id: int
    interval_start: int
    interval_end: int
    device_seconds: int
    signature: str
    received_at: int
    kind: Literal["usage", "probes"]
    available_seconds: int | None
    probes: int | None
    probes_ok: int | None


class MeasurementOut(Out):
    lease_id: int
    record_id: int | None
    dispute_id: int | None


class DisputeOut(Out):
    id: int
    lease_id: int
    record_id: int
    opened_by: str
    opener_side: Literal["tenant", "provider"]
    claimed_device_seconds: int
    counter_device_seconds: int
    reason: str
    state: DisputeState
    resolved_device_seconds: int | None
    created_at: int


class LeaseUsage(Out):
    lease_id: int
    records: list[RecordOut]
    measurements: list[MeasurementRow]
    disputes: list[DisputeOut]


class PendingAccount(Out):
    id: int
    name: str
    role: AccountRole
    evidence: str


class FeeOut(Out):
    fee_bps: int


class ClockOut(Out):
    now: int


class SweepFailure(Out):
    lease_id: int
    error: str
    message: str


class SweepOut(Out):
    expired: int
    closed: int
    demands_expired: int
    settled: int
    failed: list[SweepFailure] = Field(description="leases that could not settle; the rest settled")


class AuditOut(Out):
    ok: bool
    violations: list[str]
    counts: dict[str, int]


class CostPeriod(Out):
    """One serving period's settled cost (charged = paid_provider + fee; the credit went back)."""

    seq: int
    period_start: int
    period_end: int
    state: PeriodState
    charged: int
    paid_provider: int
    fee: int
    credit: int
    refunded: int
    settled_at: int | None


class CostLease(Out):
    """One lease's settled cost so far, in minor units."""

    lease_id: int
    demand_id: int
    state: LeaseStateName
    devices: int
    started_at: int | None
    window_end: int | None
    charged: int = Field(description="paid to the provider plus the market fee")
    paid_provider: int
    fee: int
    refunded: int
    credited: int | None = Field(default=None, description="a standing lease's SLA credits")
    periods: list[CostPeriod] | None = Field(default=None, description="a standing lease's periods")


class ModelCost(Out):
    """One model lineage: its training (block) and serving (standing) leases."""

    model: str = Field(description="the job spec's name (training) or the deployment's serve.model_name (serving)")
    training: list[CostLease]
    serving: list[CostLease]
    training_charged: int
    serving_charged: int
    charged: int
    serving_passed_training_at: int | None = Field(
        description="when cumulative serving cost first exceeded cumulative training cost, Unix seconds")


class ModelCosts(Out):
    tenant_id: int
    currency: str
    now: int
    models: list[ModelCost]
    charged: int = Field(description="all the tenant's leases together")
