"""Regressions from review: a listing's idempotency key, unreadable identity files and stores."""

from __future__ import annotations

import json

import pytest

from runyard.errors import RunyardError
from runyard.market import identity, orders
from runyard.market.client import MarketClient
from runyard.market.machines import Actor
from runyard.market.models import ListingIn
from runyard.market.service import Principal

from .helpers import assert_audit_ok, listing, open_market


def test_create_listing_with_the_same_key_lists_once(store_url):
    market = open_market(store_url)
    try:
        made = identity.register(market, "prov", "provider", _key())
        identity.request_verification(market, _principal(market, made["token"]), "papers")
        identity.decide(market, Actor("operator"), "prov", True, "ok")
        who = _principal(market, made["token"])
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


def _key() -> str:
    from runyard.market.signing import generate_keypair

    return generate_keypair()[1]


def _private_key() -> str:
    from runyard.market.signing import generate_keypair

    return generate_keypair()[0]


def _principal(market, token: str) -> Principal:
    return identity.authenticate(market, token)


@pytest.mark.parametrize(
    "content, expect",
    [
        ("{bad", "cannot read market identity"),
        ("[1, 2]", "is not an object"),
        ('{"url": 5, "token": "t"}', "is not an object"),
        ('{"token": "t"}', "names no market url"),
    ],
)
def test_malformed_identity_file_is_a_clear_error(tmp_path, content, expect):
    path = tmp_path / "identity.json"
    path.write_text(content)
    with pytest.raises(RunyardError, match=expect):
        MarketClient.from_identity_file(path)


def test_identity_file_round_trip(tmp_path):
    path = tmp_path / "identity.json"
    path.write_text(json.dumps({"url": "http://127.0.0.1:9", "token": "t", "private_key": None}))
    client = MarketClient.from_identity_file(path)
    assert client.token == "t"

    # What save_identity writes (secret: mode 0600) reads back as the same account and key.
    saver = MarketClient("http://127.0.0.1:9")
    saver.token, saver.private_key = "tok-2", _private_key()
    saved = tmp_path / "saved.json"
    saver.save_identity(saved)
    assert saved.stat().st_mode & 0o777 == 0o600
    again = MarketClient.from_identity_file(saved)
    assert (again.base_url, again.token, again.private_key) == (saver.base_url, "tok-2", saver.private_key)
    assert [f.name for f in tmp_path.iterdir() if f.name not in ("identity.json", "saved.json")] == []


def test_admin_on_an_unreadable_store_is_a_clear_error(tmp_path):
    import argparse

    from runyard.cli.market import _admin_market

    not_a_db = tmp_path / "market.db"
    not_a_db.write_text("this is not SQLite\n" * 100)
    with pytest.raises(RunyardError, match="cannot open the market store .*not a database"):
        _admin_market(argparse.Namespace(db=str(not_a_db)), lambda m: None)
    with pytest.raises(RunyardError, match=r"cannot open the market store postgresql://u:\*\*\*@"):
        _admin_market(argparse.Namespace(db="postgresql://u:secret@127.0.0.1:1/none"), lambda m: None)
