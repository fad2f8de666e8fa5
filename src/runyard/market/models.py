"""Request bodies of the HTTP API, validated by pydantic before anything is touched. Every model
forbids unknown fields, so a typo is an error rather than a silently ignored setting."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runyard.market.jobs import MAX_RESULTS_TO, MAX_SPEC_BYTES, check_results_to, check_spec_text
from runyard.market.requirement import ACCELERATOR_KINDS, Interconnect, Requirement, StartClass

# Largest amount one transfer may move: far inside a signed 64-bit integer, so that sums of many
# accounts cannot overflow either.
MAX_AMOUNT = 10**15
MAX_PRICE = 10**9  # minor units per device-hour
MAX_TIME = 2**40  # Unix seconds; far beyond any real date, far inside 64 bits
MAX_ID = 2**63 - 1  # ids in paths: anything above is not an id (and would overflow a BIGINT)
SCHEDULER_KINDS = ("local", "slurm", "kubernetes", "torchrun", "other")

# Closed sets, typed as such so that the OpenAPI document lists them as enums.
Role = Literal["tenant", "provider"]
# Reason codes for early ends of a lease (terminated, cancelled, rejected, expired).
EndReason = Literal[
    "tenant_request",
    "provider_request",
    "hardware_failure",
    "job_failed",
    "policy_violation",
    "nonpayment",
    "operator_action",
    "accept_timeout",
    "start_timeout",
    "capacity_unavailable",
    "other",
]
END_REASONS: tuple[str, ...] = EndReason.__args__  # type: ignore[attr-defined]
Outcome = Literal["upheld", "partial", "rejected"]
AcceleratorKind = Literal[ACCELERATOR_KINDS]  # type: ignore[valid-type]
SchedulerKind = Literal[SCHEDULER_KINDS]  # type: ignore[valid-type]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterIn(Strict):
    name: str = Field(min_length=1, max_length=100)
    role: Role
    public_key: str = Field(min_length=40, max_length=64, description="base64url raw Ed25519 public key")


class VerifyRequestIn(Strict):
    evidence: str = Field(default="", max_length=10_000)


class AmountIn(Strict):
    # strict: money is an integer in the JSON, never a string or a float that happens to convert.
    amount: int = Field(gt=0, le=MAX_AMOUNT, strict=True, description="minor units of the market's currency")


class ListingIn(Strict):
    accelerator_kind: AcceleratorKind
    devices_per_node: int = Field(ge=1, le=1024)
    node_count: int = Field(ge=1, le=100_000)
    interconnect: Interconnect = Interconnect.ETHERNET
    interconnect_gbps: int = Field(default=0, ge=0, le=100_000)
    region: str = Field(min_length=1, max_length=64)
    jurisdiction: str = Field(min_length=1, max_length=64)
    price_per_device_hour: int = Field(gt=0, le=MAX_PRICE, strict=True)
    available_from: int | None = Field(
        default=None, ge=0, le=MAX_TIME, description="Unix seconds; default now"
    )
    available_until: int = Field(gt=0, le=MAX_TIME, description="Unix seconds")
    start_class: StartClass = StartClass.IMMEDIATE
    max_queue_s: int = Field(default=0, ge=0, le=30 * 86400)
    scheduler_kind: SchedulerKind = "local"

    @model_validator(mode="after")
    def _coherent(self) -> ListingIn:
        if self.available_from is not None and self.available_until <= self.available_from:
            raise ValueError("available_until must be after available_from")
        if self.start_class == StartClass.IMMEDIATE and self.max_queue_s:
            raise ValueError("max_queue_s applies only to start_class 'queued'")
        if self.start_class == StartClass.QUEUED and not self.max_queue_s:
            raise ValueError("a queued listing states its max_queue_s (> 0)")
        if self.devices_per_node * self.node_count > 1_000_000:
            raise ValueError("a listing offers at most 1,000,000 devices")
        return self


class JobIn(Strict):
    """The job a demand carries (see `runyard.market.jobs`)."""

    spec: str = Field(
        min_length=1, max_length=MAX_SPEC_BYTES, description="the job spec, YAML text (a mapping)"
    )
    results_to: str = Field(
        min_length=1, max_length=MAX_RESULTS_TO, description="absolute local path or URL for the results"
    )

    @model_validator(mode="after")
    def _checked(self) -> JobIn:
        check_spec_text(self.spec)
        check_results_to(self.results_to)
        return self


class DemandIn(Strict):
    requirement: Requirement
    max_price_per_device_hour: int = Field(gt=0, le=MAX_PRICE, strict=True)
    job: JobIn | None = Field(
        default=None, description="the job to run on the lease, seen only by its parties"
    )


class AcceptIn(Strict):
    signature: str = Field(
        min_length=80, max_length=100, description="provider's signature of the lease terms"
    )


class EndIn(Strict):
    reason_code: EndReason
    note: str = Field(default="", max_length=2000)


class UsageIn(Strict):
    seq: int = Field(ge=1, le=2**62)
    interval_start: int = Field(ge=0, le=MAX_TIME)
    interval_end: int = Field(ge=0, le=MAX_TIME)
    device_seconds: int = Field(ge=0, le=2**50)
    evidence: str | None = Field(default=None, max_length=2000)
    signature: str = Field(min_length=80, max_length=100)

    @model_validator(mode="after")
    def _window(self) -> UsageIn:
        if self.interval_end <= self.interval_start:
            raise ValueError("interval_end must be after interval_start")
        return self


class MeasurementIn(Strict):
    interval_start: int = Field(ge=0, le=MAX_TIME)
    interval_end: int = Field(ge=0, le=MAX_TIME)
    device_seconds: int = Field(ge=0, le=2**50)
    signature: str = Field(min_length=80, max_length=100)

    @model_validator(mode="after")
    def _window(self) -> MeasurementIn:
        if self.interval_end <= self.interval_start:
            raise ValueError("interval_end must be after interval_start")
        return self


class AckIn(Strict):
    accepted_device_seconds: int | None = Field(
        default=None, ge=0, le=2**50, description="default: all of it"
    )


class DisputeIn(Strict):
    reason: str = Field(min_length=1, max_length=2000)
    claimed_device_seconds: int = Field(
        default=0, ge=0, le=2**50, description="what the tenant says was used"
    )


class ContestIn(Strict):
    reason: str = Field(min_length=1, max_length=2000)


class ResolveIn(Strict):
    outcome: Outcome
    reason: str = Field(min_length=1, max_length=2000)
    device_seconds: int | None = Field(default=None, ge=0, le=2**50, description="required for 'partial'")


class DecisionIn(Strict):
    approve: bool
    reason: str = Field(min_length=1, max_length=2000)


class FeeIn(Strict):
    fee_bps: int = Field(ge=0, le=5000)


class ClockIn(Strict):
    seconds: int = Field(ge=0, le=10 * 366 * 86400)


LeaseStateName = Literal[
    "offered", "accepted", "running", "window_closed", "settled", "rejected", "expired", "cancelled", "terminated"
]  # fmt: skip


class WithdrawIn(Strict):
    amount: int = Field(gt=0, le=MAX_AMOUNT, strict=True, description="minor units of the market's currency")
    payout_method_id: int = Field(
        ge=1, le=MAX_ID, strict=True, description="one of the caller's payout methods"
    )


class PayoutMethodIn(Strict):
    rail: str = Field(
        min_length=1, max_length=32, pattern=r"^[a-z0-9_-]+$", description="a configured payment rail"
    )
    destination: str = Field(
        min_length=1,
        max_length=200,
        description="where the rail pays out (an account reference it understands)",
    )


class CreditIn(Strict):
    account: str = Field(min_length=1, max_length=100, description="account name or id")
    amount: int = Field(gt=0, le=MAX_AMOUNT, strict=True, description="minor units of the market's currency")
    reason: str = Field(min_length=1, max_length=2000)


class RailEventIn(BaseModel):
    """A payment rail's event. Unknown fields are ignored (rails add fields over time); the signature
    over the raw body is checked before this is read."""

    id: str = Field(min_length=1, max_length=200, description="the rail's event id (idempotency)")
    type: Literal["deposit.succeeded"]
    account_id: int = Field(ge=1, le=MAX_ID, strict=True, description="the market account credited")
    amount: int = Field(gt=0, le=MAX_AMOUNT, strict=True)
    currency: str = Field(min_length=1, max_length=8)
