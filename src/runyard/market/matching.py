"""The matching rule, as pure functions over plain values (no store), so that it is the same code
in the service and in the benchmark, and easy to test on its own.

Hard constraints first: the same form (a block demand only ever meets block listings, a standing
demand standing ones), accelerator kind, free device count, interconnect kind and bandwidth, region
(or jurisdiction) within the demand's allowed set, start class accepted, expected start no later
than the demand's latest start, the listing available for the whole duration (a standing demand:
its committed term), price within the demand's maximum; for a standing demand also the billing
period, a minimum term the demand's term reaches, enough device memory and an availability
commitment at least the demand's. (Both parties being verified is checked by the store's query.) Among the listings
that pass: lowest price, then earliest expected start, then lowest listing id, so that ties are
broken the same way every time.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC

from runyard.market.requirement import Interconnect, Requirement
from runyard.market.standing import MAX_MEMORY_GIB, StandingDemandIn


@dataclass(frozen=True, slots=True)
class ListingView:
    id: int
    kind: str
    price: int  # per device-hour, minor units
    interconnect_rank: int
    interconnect_gbps: int
    region: str
    jurisdiction: str
    start_class: str
    max_queue_s: int
    available_from: int
    available_until: int
    form: str = "block"
    memory_gib: int = 0
    period_s: int | None = None
    min_term_periods: int | None = None
    availability_bps: int | None = None


@dataclass(frozen=True, slots=True)
class DemandView:
    id: int
    kinds: frozenset[str]
    device_count: int
    min_interconnect_rank: int
    min_interconnect_gbps: int
    duration_s: int
    allowed: frozenset[str] | None
    latest_start: int | None
    start_classes: frozenset[str]
    max_price: int
    form: str = "block"
    period_s: int | None = None
    term_periods: int | None = None
    min_memory_gib: int = 0
    min_availability_bps: int = 0

    @classmethod
    def of(
        cls, demand_id: int, requirement: Requirement, max_price: int, standing: StandingDemandIn | None = None
    ) -> DemandView:
        latest = requirement.latest_start
        extra = {}
        if standing is not None:
            extra = {"form": "standing", "period_s": standing.period_s, "term_periods": standing.term_periods,
                     "min_memory_gib": standing.min_memory_gib,
                     "min_availability_bps": standing.min_availability_bps}
        return cls(
            id=demand_id,
            kinds=frozenset(requirement.accelerator_kinds),
            device_count=requirement.device_count,
            min_interconnect_rank=Interconnect(requirement.min_interconnect).rank,
            min_interconnect_gbps=requirement.min_interconnect_gbps,
            duration_s=requirement.duration_s,
            allowed=None if requirement.allowed_regions is None else frozenset(requirement.allowed_regions),
            latest_start=None
            if latest is None
            else int((latest if latest.tzinfo else latest.replace(tzinfo=UTC)).timestamp()),
            start_classes=frozenset(str(c) for c in requirement.start_classes),
            max_price=max_price,
            **extra,
        )

    @property
    def span_s(self) -> int:
        """How long the listing must stay available: the window, or a standing demand's committed term."""
        if self.form == "standing" and self.period_s and self.term_periods:
            return self.period_s * self.term_periods
        return self.duration_s


MAX_LISTING_GBPS = 100_000  # the largest interconnect bandwidth a listing may state
MAX_REGION = 64  # the longest region or jurisdiction a listing may state


def never_matches(requirement: Requirement, standing: StandingDemandIn | None = None) -> str | None:
    """Why no listing could ever satisfy `requirement` (and a standing demand's `standing`), or None
    when one could."""
    if requirement.allowed_regions is not None:
        usable = [r for r in requirement.allowed_regions if 0 < len(r) <= MAX_REGION]
        if not usable:
            return "allowed_regions names no region a listing could have (an empty list allows none)"
    if requirement.min_interconnect_gbps > MAX_LISTING_GBPS:
        return f"min_interconnect_gbps {requirement.min_interconnect_gbps} exceeds what any listing may offer ({MAX_LISTING_GBPS})"
    if standing is not None and standing.min_memory_gib > MAX_MEMORY_GIB:
        return f"min_memory_gib {standing.min_memory_gib} exceeds what any listing may state ({MAX_MEMORY_GIB})"
    if standing is not None and "immediate" not in {str(c) for c in requirement.start_classes}:
        return "standing listings are immediate capacity; a standing demand must accept start class 'immediate'"
    return None


def expected_start(listing: ListingView, now: int) -> int:
    """When a lease on this listing would start at the latest: queued capacity may wait its queue time."""
    begin = max(now, listing.available_from)
    return begin + (listing.max_queue_s if listing.start_class == "queued" else 0)


def fits(demand: DemandView, listing: ListingView, free: int, now: int) -> int | None:
    """The expected start if `listing` (with `free` devices) meets every hard constraint, else None."""
    if listing.form != demand.form:
        return None  # the two forms never meet
    if listing.kind not in demand.kinds or listing.price > demand.max_price or free < demand.device_count:
        return None
    if demand.form == "standing" and not _standing_fits(demand, listing):
        return None
    if listing.start_class not in demand.start_classes:
        return None
    if listing.interconnect_rank < demand.min_interconnect_rank:
        return None
    if listing.interconnect_gbps < demand.min_interconnect_gbps:
        return None
    if (
        demand.allowed is not None
        and listing.region not in demand.allowed
        and listing.jurisdiction not in demand.allowed
    ):
        return None
    start = expected_start(listing, now)
    if demand.latest_start is not None and start > demand.latest_start:
        return None
    if start + demand.span_s > listing.available_until:
        return None
    return start


def _standing_fits(demand: DemandView, listing: ListingView) -> bool:
    """A standing listing's terms against a standing demand: same period, a term the listing allows,
    the memory asked, and at least the availability asked."""
    return (
        listing.period_s == demand.period_s
        and (listing.min_term_periods or 1) <= (demand.term_periods or 1)
        and listing.memory_gib >= demand.min_memory_gib
        and (listing.availability_bps or 0) >= demand.min_availability_bps
    )


def rank(listing: ListingView, start: int) -> tuple[int, int, int]:
    return (listing.price, start, listing.id)


def best_listing(
    demand: DemandView, listings: list[ListingView], free: dict[int, int], now: int
) -> tuple[ListingView, int] | None:
    """The best listing for `demand` among `listings` (a linear scan), with its expected start."""
    best: tuple[tuple[int, int, int], ListingView, int] | None = None
    for listing in listings:
        start = fits(demand, listing, free[listing.id], now)
        if start is not None and (best is None or rank(listing, start) < best[0]):
            best = (rank(listing, start), listing, start)
    return None if best is None else (best[1], best[2])


class OrderBook:
    """Listings indexed by kind and sorted by price, with free capacity tracked as leases are made.

    `match` gives the same answer as `best_listing` over all listings, but reads only the listings
    of the demand's kinds at prices up to the best one found.
    """

    def __init__(self, listings: list[ListingView], free: dict[int, int]):
        self.free = dict(free)
        self._by_kind: dict[str, list[tuple[int, int, ListingView]]] = defaultdict(list)
        for listing in listings:
            self._by_kind[listing.kind].append((listing.price, listing.id, listing))
        for book in self._by_kind.values():
            book.sort(key=lambda entry: entry[:2])

    def match(self, demand: DemandView, now: int) -> tuple[ListingView, int] | None:
        """Find the best listing for `demand` and reserve its devices there."""
        best: tuple[tuple[int, int, int], ListingView, int] | None = None
        for kind in demand.kinds:
            book = self._by_kind.get(kind)
            if not book:
                continue
            stop = bisect.bisect_right(book, (demand.max_price, float("inf")), key=lambda e: e[:2])
            for i in range(stop):
                price, _, listing = book[i]
                if best is not None and price > best[0][0]:
                    break  # everything further is dearer than what we have
                start = fits(demand, listing, self.free[listing.id], now)
                if start is not None and (best is None or rank(listing, start) < best[0]):
                    best = (rank(listing, start), listing, start)
        if best is None:
            return None
        self.free[best[1].id] -= demand.device_count
        return best[1], best[2]
