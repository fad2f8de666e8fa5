"""The market's web console over real HTTP (uvicorn on loopback, httpx as the browser): who may see
each page and use each form, the session cookie, CSRF on every POST, idempotent forms, and pages that
show what the API shows. The browser test (test_console_browser.py) drives the same pages in Chromium."""

from __future__ import annotations

import re

import httpx
import pytest

from runyard.market.server import ServerThread
from runyard.system.web_sessions import COOKIE_NAME

from .helpers import fingerprint, listing, new_party, open_market, operator_client

PAGES = ["/console/tenant", "/console/provider", "/console/operator", "/console/demands/1", "/console/leases/1"]
FORMS = ["/console/demands", "/console/demands/1/cancel", "/console/fund", "/console/operator/accounts/1/decision",
         "/console/operator/disputes/1/resolve", "/console/operator/credit", "/console/sign-out"]  # fmt: skip


def field(html: str, name: str, form_id: str | None = None) -> str:
    """The value of a hidden field (in the form with id `form_id`, if given)."""
    if form_id is not None:
        html = html[html.index(f'id="{form_id}"'):]
    return re.search(rf'name="{name}" value="([^"]+)"', html).group(1)


def sign_in(url: str, token: str) -> httpx.Client:
    browser = httpx.Client(base_url=url)
    csrf = field(browser.get("/console/sign-in").text, "csrf")
    r = browser.post("/console/sign-in", data={"csrf": csrf, "token": token})
    assert r.status_code == 303, r.text
    return browser


@pytest.fixture
def world(url_factory):
    """A test market with an operator, two verified tenants (one with a matched lease) and a provider."""
    market = open_market(url_factory("sqlite", migrated=True))
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        provider = new_party(server.url, "gpus", "provider", operator=ops)
        alice = new_party(server.url, "alice", "tenant", operator=ops)
        bob = new_party(server.url, "bob", "tenant", operator=ops)
        ops.credit("alice", 100_000, "wire")
        provider.client.create_listing(**listing(price_per_device_hour=200))
        demand = alice.client.place_demand({"accelerator_kinds": ["h100-80gb"], "device_count": 2,
                                            "duration_s": 3600}, 300)  # fmt: skip
        assert demand["state"] == "matched"
        yield {"market": market, "url": server.url, "ops": ops, "provider": provider, "alice": alice, "bob": bob,
               "demand": demand}  # fmt: skip
    market.store.dispose()


def test_every_page_needs_a_session_and_every_form_its_csrf_token(world):
    anonymous = httpx.Client(base_url=world["url"])
    for page in [*PAGES, "/console/"]:
        r = anonymous.get(page)
        assert (r.status_code, r.headers["location"]) == (303, "/console/sign-in"), page
    before = fingerprint(world["market"])
    for form in FORMS:
        assert anonymous.post(form, data={"csrf": "guess", "idempotency_key": "k"}).status_code == 403, form
    # Signed in, but without the session's token (what a cross-site form would send): refused, nothing changed.
    alice = sign_in(world["url"], world["alice"].client.token)
    for form in FORMS:
        r = alice.post(form, data={"idempotency_key": "k", "amount": "10", "approve": "yes", "reason": "x"})
        assert r.status_code == 403 and "CSRF" in r.text, form
        wrong = alice.post(form, data={"csrf": "not-the-token", "idempotency_key": "k", "amount": "10"})
        assert wrong.status_code == 403, form
    assert fingerprint(world["market"]) == before
    assert alice.get("/console/tenant").status_code == 200  # still signed in: the refused posts did nothing


def test_sign_in_sets_a_strict_cookie_and_a_bad_token_is_refused(world):
    browser = httpx.Client(base_url=world["url"])
    first = browser.get("/console/sign-in")
    csrf = field(first.text, "csrf")
    anonymous_id = browser.cookies[COOKIE_NAME]
    assert browser.post("/console/sign-in", data={"csrf": csrf, "token": "ryk_wrong"}).status_code == 401
    assert browser.post("/console/sign-in", data={"token": world["alice"].client.token}).status_code == 403
    r = browser.post("/console/sign-in", data={"csrf": csrf, "token": world["alice"].client.token})
    assert (r.status_code, r.headers["location"]) == (303, "/console/tenant")
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    assert world["alice"].client.token not in cookie and world["alice"].client.token not in r.headers["location"]
    assert browser.cookies[COOKIE_NAME] != anonymous_id  # a fresh session id once signed in (no fixation)
    page = browser.get("/console/tenant")
    assert page.status_code == 200 and "alice (tenant, verified)" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert world["alice"].client.token not in page.text
    # Signing out ends the session on the server: the old cookie no longer opens anything.
    old = browser.cookies[COOKIE_NAME]
    assert browser.post("/console/sign-out", data={"csrf": field(page.text, "csrf")}).status_code == 303
    stale = httpx.Client(base_url=world["url"], cookies={COOKIE_NAME: old})
    assert stale.get("/console/tenant").headers["location"] == "/console/sign-in"


def test_each_role_sees_its_own_pages_and_only_its_own_things(world):
    alice = sign_in(world["url"], world["alice"].client.token)
    bob = sign_in(world["url"], world["bob"].client.token)
    provider = sign_in(world["url"], world["provider"].client.token)
    ops = sign_in(world["url"], world["ops"].token)
    demand_id, lease_id = world["demand"]["id"], world["demand"]["lease_id"]
    expected = {
        alice: {"/console/tenant": 200, "/console/provider": 403, "/console/operator": 403,
                f"/console/demands/{demand_id}": 200, f"/console/leases/{lease_id}": 200},
        bob: {"/console/tenant": 200, "/console/provider": 403, "/console/operator": 403,
              f"/console/demands/{demand_id}": 404, f"/console/leases/{lease_id}": 404},
        provider: {"/console/tenant": 403, "/console/provider": 200, "/console/operator": 403,
                   f"/console/demands/{demand_id}": 404, f"/console/leases/{lease_id}": 200},
        ops: {"/console/tenant": 403, "/console/provider": 403, "/console/operator": 200,
              f"/console/demands/{demand_id}": 200, f"/console/leases/{lease_id}": 200},
    }  # fmt: skip
    for browser, pages in expected.items():
        for page, status in pages.items():
            assert browser.get(page).status_code == status, (page, status)
    # The API answers the same for the same principal.
    for party, status in ((world["bob"], 404), (world["alice"], 200)):
        r = httpx.get(f"{world['url']}/v1/leases/{lease_id}",
                      headers={"Authorization": f"Bearer {party.client.token}"})  # fmt: skip
        assert r.status_code == status
    assert bob.get(f"/console/leases/{2**70}").status_code == 404
    # Bob's page lists none of alice's things.
    bob_page = bob.get("/console/tenant").text
    assert "no demands yet" in bob_page and "no leases yet" in bob_page
    # An operator's action by a tenant is refused by the API's own operator check.
    page = alice.get("/console/tenant").text
    r = alice.post("/console/operator/credit", data={"csrf": field(page, "csrf"), "idempotency_key": "k1",
                                                     "account": "alice", "amount": "5", "reason": "gift"})  # fmt: skip
    assert r.status_code == 403


def test_pages_show_what_the_api_returns(world):
    alice = sign_in(world["url"], world["alice"].client.token)
    page = alice.get("/console/tenant").text
    available = world["alice"].client.balances()["accounts"][0]["available"]
    assert f">{available:,}<" in page
    lease = world["alice"].client.lease(world["demand"]["lease_id"])
    detail = alice.get(f"/console/leases/{lease['id']}").text
    assert f'id="lease-state">{lease["state"]}<' in detail
    provider = sign_in(world["url"], world["provider"].client.token)
    assert f"/console/leases/{lease['id']}" in provider.get("/console/provider").text


def test_a_demand_form_applies_once_and_a_bad_one_names_its_field(world):
    alice = sign_in(world["url"], world["alice"].client.token)
    page = alice.get("/console/tenant").text
    form = {"csrf": field(page, "csrf"), "idempotency_key": field(page, "idempotency_key", "demand-form"),
            "accelerator_kinds": "a100-80gb", "device_count": "1", "duration_h": "2", "max_price_per_device_hour": "150",
            "start_classes": ["queued"]}  # fmt: skip
    first = alice.post("/console/demands", data=form, follow_redirects=True)
    assert first.status_code == 200 and 'id="demand-state">open<' in first.text, first.text[-1500:]
    again = alice.post("/console/demands", data=form, follow_redirects=True)  # a double submit: same key
    assert again.status_code == 200
    assert len(world["alice"].client.demands()) == 2  # the fixture's and this one, once
    bad = alice.post("/console/demands", data={**form, "idempotency_key": "other", "device_count": "two"})
    assert bad.status_code == 422 and "device_count" in bad.text
    none = alice.post("/console/demands", data={**form, "idempotency_key": "third", "start_classes": []})
    assert none.status_code == 422 and "start_classes" in none.text


def test_test_rail_funding_applies_once_and_only_on_a_test_market(world, url_factory):
    bob = sign_in(world["url"], world["bob"].client.token)
    page = bob.get("/console/tenant").text
    form = {"csrf": field(page, "csrf"), "idempotency_key": field(page, "idempotency_key", "fund-form"), "amount": "7000"}
    assert bob.post("/console/fund", data=form).status_code == 303
    assert bob.post("/console/fund", data=form).status_code == 303  # resubmitted: the same rail event
    assert world["bob"].client.balances()["accounts"][0]["available"] == 7000
    # A market without a test clock is a real one: no funding form, and a forged post is refused.
    real = open_market(url_factory("sqlite", migrated=True), test_clock=False)
    with ServerThread(real) as server:
        ops = operator_client(real, server.url)
        carol = new_party(server.url, "carol", "tenant", operator=ops)
        browser = sign_in(server.url, carol.client.token)
        page = browser.get("/console/tenant").text
        assert 'id="fund-form"' not in page
        r = browser.post("/console/fund", data={"csrf": field(page, "csrf"), "idempotency_key": "k", "amount": "9"})
        assert r.status_code == 403
        assert sum(a["available"] for a in carol.client.balances()["accounts"]) == 0
    real.store.dispose()


def test_an_operator_verifies_and_credits_through_forms(world):
    dave = new_party(world["url"], "dave", "tenant")
    dave.client.request_verification("papers")
    ops = sign_in(world["url"], world["ops"].token)
    page = ops.get("/console/operator").text
    assert "dave" in page and "every invariant holds" in page
    decided = ops.post(f"/console/operator/accounts/{dave.id}/decision",
                       data={"csrf": field(page, "csrf"), "approve": "yes", "reason": "papers checked"},
                       follow_redirects=True)  # fmt: skip
    assert decided.status_code == 200 and "dave is verified" in decided.text
    assert dave.client.verify_status() == "verified"
    form = {"csrf": field(page, "csrf"), "idempotency_key": field(page, "idempotency_key", "credit-form"),
            "account": "dave", "amount": "1234", "reason": "wire"}  # fmt: skip
    assert ops.post("/console/operator/credit", data=form).status_code == 303
    assert ops.post("/console/operator/credit", data=form).status_code == 303  # same key: once
    assert dave.client.balances()["accounts"][0]["available"] == 1234
