"""Request bodies of the HTTP API, validated by pydantic before anything is touched. Every model
forbids unknown fields, so a typo is an error rather than a silently ignored setting."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runyard.market.jobs import (
    MAX_DATA_URLS,
    MAX_JOB_FILES,
    MAX_RESULTS_TO,
    MAX_SPEC_BYTES,
    check_data_urls,
    check_results_to,
    check_spec_text,
    decode_files,
)
from runyard.market.ledger import MAX_AMOUNT
from runyard.market.machines.lease import END_REASONS
from runyard.market.requirement import ACCELERATOR_KINDS, Interconnect, Requirement, StartClass

MAX_PRICE = 10**9  # minor units per device-hour
MAX_TIME = 2**40  # Unix seconds; far beyond any real date, far inside 64 bits
SCHEDULER_KINDS = ("local", "slurm", "kubernetes", "torchrun", "other")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterIn(Strict):
    name: str = Field(min_length=1, max_length=100)
    role: str = Field(pattern="^(tenant|provider)$")
    public_key: str = Field(min_length=40, max_length=64, description="base64url raw Ed25519 public key")


class VerifyRequestIn(Strict):
    evidence: str = Field(default="", max_length=10_000)


class AmountIn(Strict):
    # strict: money is an integer in the JSON, never a string or a float that happens to convert.
    amount: int = Field(gt=0, le=MAX_AMOUNT, strict=True, description="minor units of the market's currency")


class ListingIn(Strict):
    accelerator_kind: str
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
    scheduler_kind: str = "local"

    @model_validator(mode="after")
    def _coherent(self) -> ListingIn:
        if self.accelerator_kind not in ACCELERATOR_KINDS:
            raise ValueError(
                f"unknown accelerator_kind {self.accelerator_kind!r}; expected one of {list(ACCELERATOR_KINDS)}"
            )
        if self.available_from is not None and self.available_until <= self.available_from:
            raise ValueError("available_until must be after available_from")
        if self.start_class == StartClass.IMMEDIATE and self.max_queue_s:
            raise ValueError("max_queue_s applies only to start_class 'queued'")
        if self.start_class == StartClass.QUEUED and not self.max_queue_s:
            raise ValueError("a queued listing states its max_queue_s (> 0)")
        if self.scheduler_kind not in SCHEDULER_KINDS:
            raise ValueError(f"scheduler_kind must be one of {list(SCHEDULER_KINDS)}")
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

    files: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_JOB_FILES,
        description="relative path -> base64 content: the data the job may read (bounded in size)",
    )
    data_urls: list[str] = Field(
        default_factory=list, max_length=MAX_DATA_URLS,
        description="http(s) URLs the provider fetches for the job before it starts",
    )

    @model_validator(mode="after")
    def _checked(self) -> JobIn:
        check_spec_text(self.spec)
        check_results_to(self.results_to)
        decode_files(self.files)
        check_data_urls(self.data_urls)
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
    reason_code: str = Field(description=f"one of {list(END_REASONS)}")
    note: str = Field(default="", max_length=2000)

    @model_validator(mode="after")
    def _known(self) -> EndIn:
        if self.reason_code not in END_REASONS:
            raise ValueError(f"unknown reason_code {self.reason_code!r}; expected one of {list(END_REASONS)}")
        return self


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
    outcome: str = Field(pattern="^(upheld|partial|rejected)$")
    device_seconds: int | None = Field(default=None, ge=0, le=2**50, description="required for 'partial'")
    reason: str = Field(min_length=1, max_length=2000)


class DecisionIn(Strict):
    approve: bool
    reason: str = Field(min_length=1, max_length=2000)


class FeeIn(Strict):
    fee_bps: int = Field(ge=0, le=5000)


class ClockIn(Strict):
    seconds: int = Field(ge=0, le=10 * 366 * 86400)
