"""Roll-outs of a standing lease over real HTTP: only the tenant asks, for its running standing lease,
one at a time; only the provider reports; a roll-back's target is resolved by the market from what
was served (the deployment's export, then each switched roll-out's), so a second roll-back returns
to what the first undid. Bad requests are refused with the reason and change nothing."""

from __future__ import annotations

import base64

import pytest

from runyard.market.client import MarketClientError
from runyard.market.server import ServerThread
from runyard.market.serving import deployment_body

from .helpers import assert_audit_ok, fingerprint, listing, new_party, open_market, operator_client

PERIOD = 600
PRICE = 3600
DIGEST = {n: "sha256:" + f"{n}" * 64 for n in "abcd"}


def _files(text: str) -> dict[str, str]:
    return {"config.json": base64.b64encode(text.encode()).decode()}


@pytest.fixture
def world(store_url):
    market = open_market(store_url, fee_bps=200, dispute_window_s=100)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        provider = new_party(server.url, "farm", "provider", ops)
        other = new_party(server.url, "rival", "provider", ops)
        tenant = new_party(server.url, "lab", "tenant", ops)
        stranger = new_party(server.url, "someone", "tenant", ops)
        ops.credit("lab", 100_000, "seed")
        provider.client.create_listing(**listing(form="standing", standing={"period_s": PERIOD, "availability_bps": 9950, "credits": [], "notice_s": 0}, accelerator_kind="l4",
                                                 price_per_device_hour=PRICE, memory_gib=24))
        yield {"market": market, "ops": ops, "p": provider.client, "t": tenant.client, "rival": other.client,
               "stranger": stranger.client}
    market.store.dispose()


def _lease(world, start: bool = True) -> int:
    body, _ = deployment_body(files=_files("first"))
    demand = world["t"].place_demand({"accelerator_kinds": ["l4"], "device_count": 1}, PRICE, form="standing",
                                     standing={"period_s": PERIOD}, deployment=body)
    world["p"].accept_lease(demand["lease_id"])
    if start:
        world["p"].start_lease(demand["lease_id"])
    return demand["lease_id"]


def _refused(call, status: int, words: str) -> None:
    with pytest.raises(MarketClientError) as caught:
        call()
    assert caught.value.status == status and words in caught.value.message, (caught.value.status, caught.value.message)


def test_a_roll_out_is_asked_by_the_tenant_and_ended_by_the_provider(world):
    p, t = world["p"], world["t"]
    lease = _lease(world)
    asked = t.request_rollout(lease, export_files=_files("second"))
    assert (asked["seq"], asked["kind"], asked["state"]) == (1, "rollout", "requested")
    assert asked["export"]["export_files"] == _files("second") and asked["export_sha256"].startswith("sha256:")
    # The provider sees it with the export to serve; an operator sees it without the files.
    (seen,) = p.rollouts(lease)
    assert seen["id"] == asked["id"] and seen["export"] == asked["export"]
    assert world["ops"].rollouts(lease)[0]["export"] is None
    _refused(lambda: t.request_rollout(lease, export_files=_files("third")), 409, "already has roll-out")
    _refused(lambda: t.report_rollout(lease, asked["id"], switched=True, export_digest=DIGEST["a"]), 403, "provider")
    _refused(lambda: world["rival"].report_rollout(lease, asked["id"], switched=False), 404, "no lease")
    _refused(lambda: world["stranger"].rollouts(lease), 404, "no lease")
    done = p.report_rollout(lease, asked["id"], switched=True, export_digest=DIGEST["a"], detail="switched")
    assert (done["state"], done["export_digest"]) == ("switched", DIGEST["a"]) and done["finished_at"] is not None
    _refused(lambda: p.report_rollout(lease, asked["id"], switched=False), 409, "is 'switched'")
    # A failed one leaves what was served as it was.
    failing = t.request_rollout(lease, export_files=_files("broken"))
    failed = p.report_rollout(lease, failing["id"], switched=False, detail="the new server exited: bad config")
    assert (failed["state"], failed["detail"]) == ("failed", "the new server exited: bad config")
    assert_audit_ok(world["market"])


def test_a_roll_back_returns_to_the_export_served_before_and_a_second_one_undoes_it(world):
    p, t = world["p"], world["t"]
    lease = _lease(world)
    _refused(lambda: t.request_rollout(lease, rollback=True), 409, "nothing to roll back to")
    second = t.request_rollout(lease, export_files=_files("second"))
    p.report_rollout(lease, second["id"], switched=True, export_digest=DIGEST["b"])
    back = t.request_rollout(lease, rollback=True)
    assert back["kind"] == "rollback" and back["export"]["export_files"] == _files("first")
    p.report_rollout(lease, back["id"], switched=True, export_digest=DIGEST["a"])
    again = t.request_rollout(lease, rollback=True)
    assert again["export"]["export_files"] == _files("second")
    withdrawn = t.withdraw_rollout(lease, again["id"])
    assert withdrawn["state"] == "withdrawn"
    _refused(lambda: p.report_rollout(lease, again["id"], switched=True, export_digest=DIGEST["b"]), 409,
             "is 'withdrawn'")
    assert [r["state"] for r in t.rollouts(lease)] == ["switched", "switched", "withdrawn"]


def test_bad_roll_outs_are_refused_and_change_nothing(world):
    t = world["t"]
    lease = _lease(world, start=False)
    before = fingerprint(world["market"])
    _refused(lambda: t.request_rollout(lease, export_files=_files("x")), 409, "is accepted")
    world["p"].start_lease(lease)
    before = fingerprint(world["market"])
    for body, words in (({}, "no files"), ({"rollback": True, "export_files": _files("x")}, "carries no export"),
                        ({"export_files": {"../up": "eA=="}}, "../up"),
                        ({"export_urls": {"model.safetensors": "ftp://x/y"}}, "http")):
        _refused(lambda body=body: t.request_rollout(lease, **body), 422, words)
    _refused(lambda: t.request_rollout(99_999, export_files=_files("x")), 404, "no lease")
    assert fingerprint(world["market"]) == before
    block = t.place_demand({"accelerator_kinds": ["l4"], "device_count": 1, "duration_s": 600}, PRICE)
    assert block["state"] == "open"  # no block listing: the block lease case is covered by the conflict below
    world["p"].create_listing(**listing(accelerator_kind="l4", price_per_device_hour=PRICE))
    block_lease = t.place_demand({"accelerator_kinds": ["l4"], "device_count": 1, "duration_s": 600}, PRICE)["lease_id"]
    _refused(lambda: t.request_rollout(block_lease, export_files=_files("x")), 409, "block lease")
    _refused(lambda: world["p"].report_rollout(lease, 12345, switched=False), 404, "no roll-out")
