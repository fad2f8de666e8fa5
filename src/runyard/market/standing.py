"""Standing allocations: a defined shape of devices available continuously, billed per period.

The market sells two forms of capacity (`FORMS`). A `block` is devices for one window, used by a
training job (the form every lease had before). A `standing` allocation is serving capacity: a shape
(accelerator kind and count, device memory, region) offered continuously under these terms, stated
by the listing (`StandingTermsIn`) and signed by the provider when it accepts a lease:

- `period_s`: billing period. Period k of a lease is [started_at + (k-1)·P, started_at + k·P).
- `min_term_periods`: the shortest commitment a tenant may make. A demand commits to `term_periods`
  (at least that); the whole committed term is escrowed when the lease is made.
- `reserved`: longer commitments at a stated discount (`ReservedTermIn`): a demand committing to at
  least `periods` pays its committed periods `discount_bps` less. Periods after the term renew one at
  a time at the undiscounted price.
- `notice_s`: notice either side gives to end the lease; it then ends at the first period close that
  is at least `notice_s` away and not inside the committed term.
- `availability_bps`: the availability the provider commits to per period (9950 = 99.5%), and
  `credits`, the rule that credits the tenant when a period falls below it (`CreditTierIn`: below
  `below_bps`, `credit_bps` of the period's charge comes back; the largest tier that applies).

Pure rules live here (discount, credit, a period's figures) so that settlement, the audit and the
tests compute them the same way. Everything is integer minor units and integer basis points; each
division rounds down, and every rounding is in the tenant's favour.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Form = Literal["block", "standing"]
FORMS: tuple[str, ...] = Form.__args__  # type: ignore[attr-defined]
MIN_PERIOD_S = 60
MAX_PERIOD_S = 366 * 86400
MAX_TERM_S = 10 * 366 * 86400  # the longest commitment a demand may make
MAX_MEMORY_GIB = 65_536  # the most device memory a listing may state per device
MAX_TIERS = 10


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreditTierIn(_Strict):
    """One step of a listing's credit rule."""

    below_bps: int = Field(ge=1, le=10_000, description="applies when a period's availability is below this")
    credit_bps: int = Field(ge=1, le=10_000, description="share of the period's charge credited to the tenant")


class ReservedTermIn(_Strict):
    """A longer commitment at a discount."""

    periods: int = Field(ge=2, le=1000, description="committed periods that earn the discount")
    discount_bps: int = Field(ge=1, le=9000, description="discount on each committed period's price")


class StandingTermsIn(_Strict):
    """The terms of a standing listing (see runyard.market.standing)."""

    period_s: int = Field(ge=MIN_PERIOD_S, le=MAX_PERIOD_S, description="billing period, seconds")
    min_term_periods: int = Field(default=1, ge=1, le=1000, description="shortest commitment, in periods")
    notice_s: int = Field(default=0, ge=0, le=MAX_PERIOD_S, description="notice to end the lease, seconds")
    availability_bps: int = Field(ge=1, le=10_000, description="committed availability per period (9950 = 99.5%)")
    credits: list[CreditTierIn] = Field(
        default_factory=list, max_length=MAX_TIERS,
        description="credit rule: below `below_bps` availability, `credit_bps` of the period's charge is credited",
    )  # fmt: skip
    reserved: list[ReservedTermIn] = Field(
        default_factory=list, max_length=MAX_TIERS, description="longer commitments at a discount"
    )

    @model_validator(mode="after")
    def _coherent(self) -> StandingTermsIn:
        belows = [t.below_bps for t in self.credits]
        if len(set(belows)) != len(belows):
            raise ValueError("credits: each tier needs its own below_bps")
        if any(b > self.availability_bps for b in belows):
            raise ValueError("credits: a tier's below_bps cannot exceed the committed availability_bps")
        ordered = sorted(self.credits, key=lambda t: -t.below_bps)
        if any(a.credit_bps > b.credit_bps for a, b in zip(ordered, ordered[1:], strict=False)):
            raise ValueError("credits: a lower availability must credit at least as much as a higher one")
        periods = [r.periods for r in self.reserved]
        if len(set(periods)) != len(periods):
            raise ValueError("reserved: each term needs its own number of periods")
        if any(p < self.min_term_periods for p in periods):
            raise ValueError("reserved: a reserved term is at least min_term_periods long")
        if self.period_s * max([self.min_term_periods, *periods]) > MAX_TERM_S:
            raise ValueError(f"a term may be at most {MAX_TERM_S} seconds")
        return self


class StandingDemandIn(_Strict):
    """What a standing demand asks for beyond its requirement (kinds, device count, regions)."""

    period_s: int = Field(ge=MIN_PERIOD_S, le=MAX_PERIOD_S, description="billing period wanted, seconds")
    term_periods: int = Field(default=1, ge=1, le=1000, description="periods committed to (escrowed up front)")
    min_memory_gib: int = Field(default=0, ge=0, le=MAX_MEMORY_GIB, description="least device memory, GiB")
    min_availability_bps: int = Field(
        default=0, ge=0, le=10_000, description="least availability a listing must commit to"
    )

    @model_validator(mode="after")
    def _bounded(self) -> StandingDemandIn:
        if self.period_s * self.term_periods > MAX_TERM_S:
            raise ValueError(f"period_s x term_periods may be at most {MAX_TERM_S} seconds")
        return self

    @property
    def term_s(self) -> int:
        return self.period_s * self.term_periods


class NoticeIn(_Strict):
    note: str = Field(default="", max_length=2000, description="free text for the record")


class EndpointIn(_Strict):
    endpoint_url: str = Field(
        min_length=8, max_length=500, pattern=r"^https?://[^\s@]+$",
        description="where the tenant reaches its deployment (http or https, no credentials)",
    )  # fmt: skip


class AvailabilityIn(_Strict):
    """An availability record: `runyard.market.availability_record.v1` less `type` and `lease_id`, signed."""

    seq: int = Field(ge=1, le=2**62, description="1, 2, ... strictly increasing per lease")
    interval_start: int = Field(ge=0, le=2**40, description="start of the interval, Unix seconds")
    interval_end: int = Field(ge=0, le=2**40, description="end of the interval, inside the same period")
    available_seconds: int = Field(ge=0, le=MAX_PERIOD_S, description="seconds the endpoint answered its probes")
    probes: int = Field(ge=0, le=2**40, description="health probes sent in the interval")
    probes_ok: int = Field(ge=0, le=2**40, description="probes answered healthy")
    requests: int = Field(ge=0, le=2**50, description="tenant requests served in the interval")
    latency_p50_ms: int | None = Field(default=None, ge=0, le=2**40, description="median request latency")
    latency_p99_ms: int | None = Field(default=None, ge=0, le=2**40, description="99th percentile request latency")
    signature: str = Field(min_length=80, max_length=100, description="base64url Ed25519 signature")

    @model_validator(mode="after")
    def _evidence(self) -> AvailabilityIn:
        check_probe_counts(self.interval_start, self.interval_end, self.available_seconds, self.probes,
                           self.probes_ok)
        return self


class ProbesIn(_Strict):
    """A tenant's probe results: `runyard.market.tenant_probes.v1` less `type` and `lease_id`, signed."""

    interval_start: int = Field(ge=0, le=2**40, description="start of the interval, Unix seconds")
    interval_end: int = Field(ge=0, le=2**40, description="end of the interval, inside the same period")
    available_seconds: int = Field(ge=0, le=MAX_PERIOD_S, description="seconds the tenant's probes saw it up")
    probes: int = Field(ge=0, le=2**40, description="probes the tenant sent")
    probes_ok: int = Field(ge=0, le=2**40, description="probes answered healthy")
    signature: str = Field(min_length=80, max_length=100, description="base64url Ed25519 signature")

    @model_validator(mode="after")
    def _evidence(self) -> ProbesIn:
        check_probe_counts(self.interval_start, self.interval_end, self.available_seconds, self.probes,
                           self.probes_ok)
        return self


def check_probe_counts(start: int, end: int, available: int, probes: int, ok: int) -> None:
    """ValueError unless the interval is positive and the counts could all be true at once."""
    if end <= start:
        raise ValueError("interval_end must be after interval_start")
    if available > end - start:
        raise ValueError(f"available_seconds {available} exceeds the interval's {end - start} seconds")
    if ok > probes:
        raise ValueError(f"probes_ok {ok} exceeds probes {probes}")
    if available and not ok:
        raise ValueError("available seconds need healthy probes as evidence (probes_ok is 0)")


# -- the rules ---------------------------------------------------------------------------------------


def discount_for(reserved: list[dict], term_periods: int) -> int:
    """The discount (bps) a commitment of `term_periods` earns: the best reserved term it reaches."""
    return max((r["discount_bps"] for r in reserved if r["periods"] <= term_periods), default=0)


def credit_for(rule: list[dict], committed_bps: int, availability_bps: int) -> int:
    """The share (bps) of a period's charge credited back at `availability_bps`: 0 at or above the
    commitment, else the largest tier whose `below_bps` the period fell under."""
    if availability_bps >= committed_bps:
        return 0
    return max((t["credit_bps"] for t in rule if availability_bps < t["below_bps"]), default=0)


@dataclass(frozen=True)
class PeriodFigures:
    """What one period of a standing lease costs, from the available device-seconds accepted in it."""

    available_device_seconds: int
    availability_bps: int
    charge: int  # for the time available
    credit: int  # back to the tenant under the credit rule
    fee: int  # the market's share of what the provider is paid
    provider: int  # charge - credit - fee
    refund: int  # the period's escrow the charge did not use: price - charge

    def to_json(self) -> dict:
        return dict(self.__dict__)


def period_figures(price: int, devices: int, period_s: int, length_s: int, available_device_seconds: int,
                   committed_bps: int, rule: list[dict], fee_bps: int) -> PeriodFigures:
    """A period's settlement. `price` is its escrow (the whole period's price), `length_s` how long it
    ran (the period's length, or less when the lease ended inside it).

        availability = available / (devices x length)            (bps, rounded down)
        charge       = price x available / (devices x period)    (the time available, rounded down)
        credit       = charge x credit_bps(availability) / 10000 (the listing's rule, rounded down)
        fee          = (charge - credit) x fee_bps / 10000       (rounded down)
        provider     = charge - credit - fee
        refund       = price - charge                            (back to the tenant with the credit)
    """
    available = min(available_device_seconds, devices * length_s)
    availability = available * 10_000 // (devices * length_s) if length_s > 0 else 10_000
    charge = price * available // (devices * period_s)
    credit = charge * credit_for(rule, committed_bps, availability) // 10_000
    fee = (charge - credit) * fee_bps // 10_000
    return PeriodFigures(available, availability, charge, credit, fee, charge - credit - fee, price - charge)


def dumps(value: object) -> str:
    """The stored (and signed) form of a list of tiers or reserved terms: sorted keys, compact."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def tiers_json(credits: list[CreditTierIn]) -> list[dict]:
    return sorted(({"below_bps": t.below_bps, "credit_bps": t.credit_bps} for t in credits),
                  key=lambda t: -t["below_bps"])


def reserved_json(reserved: list[ReservedTermIn]) -> list[dict]:
    return sorted(({"periods": r.periods, "discount_bps": r.discount_bps} for r in reserved),
                  key=lambda r: r["periods"])
