"""Request bodies of the HTTP API, validated by pydantic before anything is touched. Every model
forbids unknown fields, so a typo is an error rather than a silently ignored setting."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runyard.market.jobs import (
    MAX_DATA_URLS,
    MAX_JOB_FILES,
    MAX_RESULTS_TO,
    MAX_SPEC_BYTES,
    check_data_urls,
    check_env_lock,
    check_init_export,
    check_results_to,
    check_spec_text,
    decode_files,
)
from runyard.market.requirement import ACCELERATOR_KINDS, Interconnect, Requirement, StartClass
from runyard.market.serving import DeploymentIn, ExportIn
from runyard.market.standing import MAX_MEMORY_GIB, Form, StandingDemandIn, StandingTermsIn

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
    "no_availability",
    "provider_revoked",
    "tenant_revoked",
    "other",
]
END_REASONS: tuple[str, ...] = EndReason.__args__  # type: ignore[attr-defined]
Outcome = Literal["upheld", "partial", "rejected"]
AcceleratorKind = Literal[ACCELERATOR_KINDS]  # type: ignore[valid-type]
SchedulerKind = Literal[SCHEDULER_KINDS]  # type: ignore[valid-type]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterIn(Strict):
    name: str = Field(
        min_length=1, max_length=100, description="account name: letters, digits, '.', '_', '-'"
    )
    role: Role = Field(description="tenant (buys capacity) or provider (sells it)")
    public_key: str = Field(min_length=40, max_length=64, description="base64url raw Ed25519 public key")


class VerifyRequestIn(Strict):
    evidence: str = Field(default="", max_length=10_000, description="what the verifier should check")


class AmountIn(Strict):
    # strict: money is an integer in the JSON, never a string or a float that happens to convert.
    amount: int = Field(gt=0, le=MAX_AMOUNT, strict=True, description="minor units of the market's currency")


class ListingIn(Strict):
    accelerator_kind: AcceleratorKind = Field(description="the devices offered")
    devices_per_node: int = Field(ge=1, le=1024, description="devices on each node")
    node_count: int = Field(ge=1, le=100_000, description="number of nodes")
    interconnect: Interconnect = Field(default=Interconnect.ETHERNET, description="how the nodes are linked")
    interconnect_gbps: int = Field(default=0, ge=0, le=100_000, description="interconnect bandwidth, Gbit/s")
    region: str = Field(min_length=1, max_length=64, description="where the devices are, e.g. eu-west")
    jurisdiction: str = Field(min_length=1, max_length=64, description="legal jurisdiction, e.g. eu")
    price_per_device_hour: int = Field(
        gt=0, le=MAX_PRICE, strict=True, description="minor units per device-hour"
    )
    available_from: int | None = Field(
        default=None, ge=0, le=MAX_TIME, description="Unix seconds; default now"
    )
    available_until: int = Field(gt=0, le=MAX_TIME, description="Unix seconds")
    start_class: StartClass = Field(
        default=StartClass.IMMEDIATE, description="immediate, or queued (may wait up to max_queue_s)"
    )
    max_queue_s: int = Field(default=0, ge=0, le=30 * 86400, description="longest wait before start (queued)")
    scheduler_kind: SchedulerKind = Field(default="local", description="the provider's scheduler")
    memory_gib: int = Field(default=0, ge=0, le=MAX_MEMORY_GIB, description="memory per device, GiB (0: unstated)")
    form: Form = Field(default="block", description="block: devices for a window; standing: serving capacity")
    standing: StandingTermsIn | None = Field(default=None, description="the terms of a standing listing")

    @model_validator(mode="after")
    def _coherent(self) -> ListingIn:
        if self.form == "standing" and self.standing is None:
            raise ValueError("a standing listing states its terms in `standing`")
        if self.form == "block" and self.standing is not None:
            raise ValueError("`standing` terms belong to a standing listing (form: standing)")
        if self.form == "standing" and self.start_class != StartClass.IMMEDIATE:
            raise ValueError("a standing listing is capacity available now: start_class 'immediate'")
        if self.available_from is not None and self.available_until <= self.available_from:
            raise ValueError("available_until must be after available_from")
        if self.start_class == StartClass.IMMEDIATE and self.max_queue_s:
            raise ValueError("max_queue_s applies only to start_class 'queued'")
        if self.start_class == StartClass.QUEUED and not self.max_queue_s:
            raise ValueError("a queued listing states its max_queue_s (> 0)")
        if self.devices_per_node * self.node_count > 1_000_000:
            raise ValueError("a listing offers at most 1,000,000 devices")
        return self


class EnvLockIn(Strict):
    """A run's environment lock (runyard.reproduce.lock): the two files of its env/ directory."""

    requirements: str = Field(min_length=1, description="env/requirements.txt: pip's hash-checking format")
    environment: str = Field(min_length=2, description="env/environment.json: interpreter, torch build, digests")


class InitExportIn(ExportIn):
    """The export a job starts from (its spec's `model.init: {from: export}`), carried as a
    deployment's export is: uploaded files and files the provider fetches by URL."""


class JobIn(Strict):
    """The job a demand carries (see `runyard.market.jobs`)."""

    spec: str = Field(
        min_length=1, max_length=MAX_SPEC_BYTES, description="the job spec, YAML text (a mapping)"
    )
    results_to: str = Field(
        min_length=1, max_length=MAX_RESULTS_TO, description="absolute local path or URL for the results"
    )

    files: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_JOB_FILES,
        description="relative path -> base64 content: the data the job may read (bounded in size)",
    )
    data_urls: list[str] = Field(
        default_factory=list, max_length=MAX_DATA_URLS,
        description="http(s) URLs the provider fetches for the job before it starts",
    )
    env_lock: EnvLockIn | None = Field(
        default=None, description="the environment the job runs in: the provider builds it from this lock"
    )
    init_export: InitExportIn | None = Field(
        default=None, description="the export the job starts from: its spec's model.init.path is pointed at it"
    )

    @model_validator(mode="after")
    def _checked(self) -> JobIn:
        check_spec_text(self.spec)
        check_results_to(self.results_to)
        decode_files(self.files)
        check_data_urls(self.data_urls)
        if self.env_lock is not None:
            check_env_lock(self.env_lock.model_dump())
        if self.init_export is not None:
            check_init_export(self.init_export.model_dump())
        return self


class DemandIn(Strict):
    requirement: Requirement
    max_price_per_device_hour: int = Field(gt=0, le=MAX_PRICE, strict=True)
    job: JobIn | None = Field(
        default=None, description="the job to run on the lease, seen only by its parties"
    )
    form: Form = Field(default="block", description="block (a window for a job) or standing (serving capacity)")
    standing: StandingDemandIn | None = Field(default=None, description="a standing demand's period and term")
    deployment: DeploymentIn | None = Field(
        default=None, description="a standing demand's model to serve, seen only by the lease's parties"
    )

    @model_validator(mode="after")
    def _coherent(self) -> DemandIn:
        if self.form == "standing":
            if self.standing is None:
                raise ValueError("a standing demand states its period and term in `standing`")
            if self.job is not None:
                raise ValueError("a standing demand carries a deployment, not a job")
            explicit = "duration_s" in self.requirement.model_fields_set
            if explicit and self.requirement.duration_s != self.standing.term_s:
                raise ValueError(f"requirement.duration_s {self.requirement.duration_s} differs from the committed "
                                 f"term (period_s x term_periods = {self.standing.term_s}); leave it out")
        elif self.standing is not None or self.deployment is not None:
            raise ValueError("`standing` and `deployment` belong to a standing demand (form: standing)")
        return self


class AcceptIn(Strict):
    signature: str = Field(
        min_length=80, max_length=100, description="provider's signature of the lease terms"
    )


class EndIn(Strict):
    reason_code: EndReason = Field(description="why the lease ends early")
    note: str = Field(default="", max_length=2000, description="free text for the record")


class UsageIn(Strict):
    """A usage record: the fields of the signed payload `runyard.market.usage_record.v1` less `type`
    and `lease_id`, and the provider's signature of it (docs/market-protocol.md)."""

    seq: int = Field(ge=1, le=2**62, description="1, 2, ... strictly increasing per lease")
    interval_start: int = Field(ge=0, le=MAX_TIME, description="start of the interval, Unix seconds")
    interval_end: int = Field(ge=0, le=MAX_TIME, description="end of the interval, Unix seconds")
    device_seconds: int = Field(ge=0, le=2**50, description="devices used x seconds, in the interval")
    evidence: str | None = Field(default=None, max_length=2000, description="e.g. the run's metrics digest")
    signature: str = Field(min_length=80, max_length=100, description="base64url Ed25519 signature")

    @model_validator(mode="after")
    def _window(self) -> UsageIn:
        if self.interval_end <= self.interval_start:
            raise ValueError("interval_end must be after interval_start")
        return self


class MeasurementIn(Strict):
    """A tenant measurement: `runyard.market.tenant_measurement.v1` less `type` and `lease_id`, signed."""

    interval_start: int = Field(ge=0, le=MAX_TIME, description="start of the interval, Unix seconds")
    interval_end: int = Field(ge=0, le=MAX_TIME, description="end of the interval, Unix seconds")
    device_seconds: int = Field(ge=0, le=2**50, description="what the tenant's job saw, device-seconds")
    signature: str = Field(min_length=80, max_length=100, description="base64url Ed25519 signature")

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
    reason: str = Field(min_length=1, max_length=2000, description="why (recorded)")
    claimed_device_seconds: int = Field(
        default=0, ge=0, le=2**50, description="what the tenant says was used"
    )


class ContestIn(Strict):
    reason: str = Field(min_length=1, max_length=2000, description="why (recorded)")


class ResolveIn(Strict):
    outcome: Outcome = Field(
        description="upheld: the opener's claim; rejected: the other side's; partial: a value between"
    )
    reason: str = Field(min_length=1, max_length=2000, description="why (recorded)")
    device_seconds: int | None = Field(default=None, ge=0, le=2**50, description="required for 'partial'")


class DecisionIn(Strict):
    approve: bool = Field(description="verify the account (or refuse / revoke its verification)")
    reason: str = Field(min_length=1, max_length=2000, description="why (recorded with the decision)")


class HeldDecisionIn(Strict):
    decision: Literal["release", "refund"] = Field(
        description="release: the held earnings go to the provider's earnings; refund: back to the tenant"
    )
    reason: str = Field(min_length=1, max_length=2000, description="why (recorded with the decision)")


class FeeIn(Strict):
    fee_bps: int = Field(ge=0, le=5000, description="market fee for new leases, basis points (100 = 1%)")


class ClockIn(Strict):
    seconds: int = Field(ge=0, le=10 * 366 * 86400, description="how far to move a test market's clock")


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
