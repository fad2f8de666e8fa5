"""Listings through the service layer, on both backends: a listing's idempotency key lists once."""

from __future__ import annotations

from runyard.market import identity, orders
from runyard.market.models import ListingIn
from runyard.market.signing import generate_keypair
from runyard.market.states import Actor

from .helpers import assert_audit_ok, listing, open_market


def test_create_listing_with_the_same_key_lists_once(store_url):
    market = open_market(store_url)
    try:
        made = identity.register(market, "prov", "provider", generate_keypair()[1])
        identity.request_verification(market, identity.authenticate(market, made["token"]), "papers")
        identity.decide(market, Actor("operator"), "prov", True, "ok")
        who = identity.authenticate(market, made["token"])
        body = ListingIn(**listing())
        first = orders.create_listing(market, who, body, "list-1")
        again = orders.create_listing(market, who, body, "list-1")
        assert again["id"] == first["id"]
        assert len(orders.list_listings(market, who, mine=True)) == 1
        other = orders.create_listing(market, who, body, "list-2")
        assert other["id"] != first["id"]
        assert_audit_ok(market)
    finally:
        market.store.dispose()
