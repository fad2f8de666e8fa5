"""The matching rule on its own (no store): hard constraints, then price, time, and id."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from runyard.market.matching import DemandView, ListingView, OrderBook, best_listing, fits
from tests.tiers import examples

NOW = 1_000_000


def listing(id: int, **kw) -> ListingView:
    base = dict(
        kind="h100-80gb", price=300, interconnect_rank=2, interconnect_gbps=900, region="eu-west",
        jurisdiction="eu", start_class="immediate", max_queue_s=0, available_from=0, available_until=NOW * 10,
    )  # fmt: skip
    return ListingView(id=id, **{**base, **kw})


def demand(**kw) -> DemandView:
    base = dict(
        id=1, kinds=frozenset({"h100-80gb"}), device_count=4, min_interconnect_rank=0, min_interconnect_gbps=0,
        duration_s=3600, allowed=None, latest_start=None, start_classes=frozenset({"immediate", "queued"}),
        max_price=400,
    )  # fmt: skip
    return DemandView(**{**base, **kw})


def test_each_hard_constraint_excludes():
    d = demand(
        allowed=frozenset({"eu"}), min_interconnect_rank=1, min_interconnect_gbps=400, latest_start=NOW + 60
    )
    assert fits(d, listing(1), 8, NOW) == NOW
    assert fits(d, listing(1, kind="a100-80gb"), 8, NOW) is None
    assert fits(d, listing(1), 3, NOW) is None  # not enough free devices
    assert fits(d, listing(1, price=401), 8, NOW) is None
    assert fits(d, listing(1, interconnect_rank=0), 8, NOW) is None
    assert fits(d, listing(1, interconnect_gbps=100), 8, NOW) is None
    assert fits(d, listing(1, region="us-east", jurisdiction="us"), 8, NOW) is None
    assert fits(d, listing(1, region="eu-central", jurisdiction="eu"), 8, NOW) == NOW  # jurisdiction counts
    assert fits(d, listing(1, start_class="queued", max_queue_s=120), 8, NOW) is None  # would start too late
    assert fits(d, listing(1, available_from=NOW + 61), 8, NOW) is None
    assert fits(d, listing(1, available_until=NOW + 3599), 8, NOW) is None
    assert fits(demand(start_classes=frozenset({"queued"})), listing(1), 8, NOW) is None


def test_price_then_time_then_id():
    free = {i: 8 for i in range(1, 5)}
    cheap_late = listing(1, price=200, start_class="queued", max_queue_s=600)
    cheap_now = listing(2, price=200)
    dear = listing(3, price=250)
    twin = listing(4, price=200)
    assert best_listing(demand(), [dear, cheap_late, twin, cheap_now], free, NOW)[0].id == 2
    assert best_listing(demand(), [dear, cheap_late], free, NOW)[0].id == 1
    assert (
        best_listing(demand(start_classes=frozenset({"immediate"})), [dear, cheap_late], free, NOW)[0].id == 3
    )


listings_st = st.lists(
    st.builds(
        lambda i, kind, price, sc, q, region: listing(
            i, kind=kind, price=price, start_class=sc, max_queue_s=q if sc == "queued" else 0, region=region
        ),
        st.integers(0, 10**6),
        st.sampled_from(["h100-80gb", "a100-80gb", "l40s"]),
        st.integers(1, 20),
        st.sampled_from(["immediate", "queued"]),
        st.integers(1, 900),
        st.sampled_from(["eu-west", "us-east"]),
    ),  # fmt: skip
    max_size=25,
    unique_by=lambda x: x.id,
)
demands_st = st.lists(
    st.builds(
        lambda kinds, count, price, late: demand(
            kinds=frozenset(kinds),
            device_count=count,
            max_price=price,
            latest_start=None if late is None else NOW + late,
        ),
        st.sets(st.sampled_from(["h100-80gb", "a100-80gb", "l40s"]), min_size=1),
        st.integers(1, 8),
        st.integers(1, 20),
        st.none() | st.integers(0, 900),
    ),  # fmt: skip
    max_size=25,
)


@settings(max_examples=examples(40, fast=15), deadline=None)
@given(listings_st, demands_st, st.integers(1, 16))
def test_order_book_agrees_with_a_linear_scan(listings, demands, capacity):
    free = {x.id: capacity for x in listings}
    book = OrderBook(listings, free)
    for d in demands:
        expected = best_listing(d, listings, free, NOW)
        got = book.match(d, NOW)
        assert (got and got[0].id) == (expected and expected[0].id)
        if expected:
            free[expected[0].id] -= d.device_count
    assert book.free == free
