"""An operator revoked after it authenticated can set no fee, move no clock, run no sweep and read no
audit: each of those operations reads the operator's state again inside its own transaction (as
credit, decisions and dispute resolution do), not from the principal its token gave. Over HTTP the
same operator gets 403 `not_verified` in the error envelope."""

from __future__ import annotations

import pytest

from runyard.market import deadlines, identity, invariants
from runyard.market.client import MarketClient, MarketClientError
from runyard.market.errors import NotVerified
from runyard.market.server import ServerThread

from .helpers import assert_audit_ok, listing, new_party, open_market, operator_client, requirement


def test_a_revoked_operators_stale_principal_changes_nothing(tmp_path):
    market = open_market(str(tmp_path / "market.db"), accept_timeout_s=900)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        provider = new_party(server.url, "farm", "provider", ops).client
        tenant = new_party(server.url, "lab", "tenant", ops).client
        ops.credit("lab", 100_000, "seed")
        provider.create_listing(**listing())
        offered = tenant.place_demand(requirement(), 300)["lease_id"]
        token = identity.create_operator(market, "ops2")["token"]
        stale = identity.authenticate(market, token)  # authenticated while verified
        ops.decide("ops2", False, "left the company")
        ops.advance_clock(1000)  # the offered lease's accept deadline (900 s) has passed
        before = ops.market_info()
        for call in (
            lambda: market.set_fee(4000, stale.actor, principal=stale),
            lambda: market.advance_clock(86400, stale.actor, principal=stale),
            lambda: deadlines.sweep(market, stale),
            lambda: invariants.audit_market(market, stale),
        ):
            with pytest.raises(NotVerified) as refused:
                call()
            assert "ops2 is rejected" in refused.value.message, refused.value.message
        after = ops.market_info()
        assert (after["fee_bps"], after["now"]) == (before["fee_bps"], before["now"])
        assert tenant.lease(offered)["state"] == "offered"  # the refused sweep expired nothing

        revoked = MarketClient(server.url, token=token)
        for call in (lambda: revoked.set_fee(4000), lambda: revoked.advance_clock(86400),
                     revoked.sweep, revoked.audit):  # fmt: skip
            with pytest.raises(MarketClientError) as refused:
                call()
            assert (refused.value.status, refused.value.code) == (403, "not_verified"), refused.value
        assert ops.market_info()["fee_bps"] == before["fee_bps"]

        assert ops.sweep()["expired"] == 1  # a verified operator's sweep applies the deadline
        assert tenant.lease(offered)["state"] == "expired"
        assert_audit_ok(market)
    market.store.dispose()
