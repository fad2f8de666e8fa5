"""Hostile input over real HTTP, on both backends: non-finite numbers anywhere in a JSON body, ids
beyond 64 bits in paths, degenerate and reused keys, an operator revoking itself, demands that
could never match. Each gets a clear 4xx (never a 500) and changes nothing."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from sqlalchemy.exc import IntegrityError

from runyard.market import identity, payloads
from runyard.market.client import MarketClient, MarketClientError
from runyard.market.errors import Conflict
from runyard.market.rails import SIGNATURE_HEADER, signature_header
from runyard.market.server import ServerThread
from runyard.market.signing import b64encode, sign
from runyard.market.store import Store

from .helpers import (
    RAIL,
    assert_audit_ok,
    fingerprint,
    listing,
    new_party,
    open_market,
    operator_client,
    requirement,
)

BIG = str(2**63)


@pytest.fixture
def world(store_url):
    market = open_market(store_url)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        provider = new_party(server.url, "prov", "provider", ops).client
        tenant = new_party(server.url, "lab", "tenant", ops).client
        ops.credit("lab", 50_000, "seed")
        provider.create_listing(**listing())
        yield {"market": market, "url": server.url, "ops": ops, "p": provider, "t": tenant}
    assert_audit_ok(market)
    market.store.dispose()


def _post(world, who: str, path: str, raw: bytes, key: str | None = "k") -> httpx.Response:
    headers = {"Authorization": f"Bearer {world[who].token}", "Content-Type": "application/json"}
    if key:
        headers["Idempotency-Key"] = key
    return httpx.post(world["url"] + path, content=raw, headers=headers)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_anywhere_get_422(world, number):
    before = fingerprint(world["market"])
    bodies = [
        ("t", "/v1/demands", f'{{"requirement": {{"device_count": {number}}}, "max_price_per_device_hour": 5}}'),
        ("t", "/v1/demands", f'{{"requirement": {{}}, "max_price_per_device_hour": 5, "x": [1, {{"y": {number}}}]}}'),
        ("ops", "/v1/admin/credit", f'{{"account": "lab", "amount": {number}, "reason": "r"}}'),
        ("ops", "/v1/admin/fee", f'{{"fee_bps": {number}}}'),
        ("p", "/v1/leases/1/usage", f'{{"seq": 1, "interval_start": 0, "interval_end": 1, "device_seconds": {number}, "signature": "x"}}'),
        ("t", "/v1/accounts/me/verification", f'{{"evidence": {number}}}'),
    ]  # fmt: skip
    for who, path, raw in bodies:
        response = _post(world, who, path, raw.encode())
        assert response.status_code == 422, (path, response.text)
        assert response.json()["error"] == "invalid_request" and response.json()["message"]
    response = httpx.post(
        world["url"] + "/v1/accounts", content=f'{{"name": "x", "role": "tenant", "public_key": {number}}}',
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    assert response.status_code == 422
    assert fingerprint(world["market"]) == before


def test_ids_beyond_64_bits_get_4xx(world):
    before = fingerprint(world["market"])
    auth = {"Authorization": f"Bearer {world['t'].token}"}
    gets = [f"/v1/leases/{BIG}", f"/v1/demands/{BIG}", f"/v1/leases/{BIG}/usage", f"/v1/leases/{2**64}"]
    for path in gets:
        response = httpx.get(world["url"] + path, headers=auth)
        assert response.status_code == 422, (path, response.text)
    posts = [
        ("t", f"/v1/leases/{BIG}/settle", b""), ("t", f"/v1/usage/{BIG}/ack", b"{}"),
        ("t", f"/v1/demands/{BIG}/cancel", b""), ("t", f"/v1/usage/{BIG}/dispute", b'{"reason": "x"}'),
        ("ops", f"/v1/admin/disputes/{BIG}/resolve", b'{"outcome": "upheld", "reason": "x"}'),
        ("p", f"/v1/listings/{BIG}/withdraw", b""), ("t", f"/v1/disputes/{BIG}/withdraw", b""),
    ]  # fmt: skip
    for who, path, raw in posts:
        response = _post(world, who, path, raw)
        assert response.status_code == 422, (path, response.text)
    for account in (BIG, str(2**80)):
        response = _post(world, "ops", f"/v1/admin/accounts/{account}/decision", b'{"approve": true, "reason": "x"}', None)
        assert response.status_code == 404, response.text
    assert fingerprint(world["market"]) == before


def test_degenerate_and_reused_keys_are_refused(world):
    before = fingerprint(world["market"])
    p = 2**255 - 19
    degenerate = [bytes([1] + [0] * 31), bytes(32), (p - 1).to_bytes(32, "little"), (p + 1).to_bytes(32, "little")]
    for raw in degenerate:
        with pytest.raises(MarketClientError) as err:
            MarketClient(world["url"]).register(f"bad-{raw[0]}", "tenant", b64encode(raw))
        assert err.value.status == 422 and "public_key" in err.value.message, err.value
    taken = world["t"].me()["public_key"]
    with pytest.raises(MarketClientError) as err:
        MarketClient(world["url"]).register("copycat", "tenant", taken)
    assert err.value.status == 409 and "already registered" in err.value.message
    assert fingerprint(world["market"]) == before


def test_an_operator_cannot_revoke_itself_and_a_revoked_one_has_no_power(world):
    ops = world["ops"]
    me = ops.me()
    with pytest.raises(MarketClientError) as err:
        ops.decide(str(me["id"]), False, "oops")
    assert err.value.status == 403
    other = MarketClient(world["url"], token=identity.create_operator(world["market"], "ops-2")["token"])
    other.decide(str(me["id"]), False, "revoked by a colleague")
    with pytest.raises(MarketClientError) as err:
        ops.audit()
    assert err.value.status == 403 and err.value.code == "not_verified"
    assert other.audit()["ok"]


def test_demands_that_could_never_match_are_refused(world):
    before = fingerprint(world["market"])
    for req, words in (
        (requirement(allowed_regions=[]), "allowed_regions"),
        (requirement(allowed_regions=["x" * 65]), "allowed_regions"),
        (requirement(min_interconnect_gbps=10**6), "min_interconnect_gbps"),
    ):
        with pytest.raises(MarketClientError) as err:
            world["t"].place_demand(req, 300)
        assert err.value.status == 422 and words in err.value.message and "never match" in err.value.message
    assert fingerprint(world["market"]) == before


def test_only_contention_is_retried(tmp_path):
    """A unique-key violation is a 409 at once; it is not retried as if it were contention."""
    store = Store(str(tmp_path / "s.db"))
    calls = []

    def violate(conn):
        calls.append(1)
        raise IntegrityError("INSERT ...", {}, Exception("UNIQUE constraint failed"))

    with pytest.raises(Conflict):
        store.write(violate)
    assert len(calls) == 1
    store.dispose()



def _with_duplicate(body: dict, key: str, value: object) -> bytes:
    """`body` as JSON with `key` given a second time (`value`) just after its first appearance."""
    text = json.dumps(body, separators=(",", ":"))
    first = f'"{key}":{json.dumps(body[key])}'
    assert first in text
    return text.replace(first, f"{first},\"{key}\":{json.dumps(value)}", 1).encode()


def test_a_duplicate_key_on_a_signed_usage_report_is_refused(world):
    t, p = world["t"], world["p"]
    lease_id = t.place_demand(requirement(), 300)["lease_id"]
    p.accept_lease(lease_id)
    p.start_lease(lease_id)
    lease = p.lease(lease_id)
    start = lease["started_at"]
    payload = payloads.usage_record(lease_id, 1, start, start + 60, 60)
    body = {k: v for k, v in payload.items() if k not in ("type", "lease_id")}
    body["signature"] = sign(p.private_key, payload)
    before = fingerprint(world["market"])
    for key, value in (("device_seconds", 7_200_000), ("seq", 2), ("signature", "forged")):
        response = _post(world, "p", f"/v1/leases/{lease_id}/usage", _with_duplicate(body, key, value), key)
        assert response.status_code == 422, response.text
        assert response.json()["error"] == "invalid_request" and "twice" in response.json()["message"]
    assert fingerprint(world["market"]) == before
    assert p.usage(lease_id)["records"] == []


def test_a_duplicate_key_on_a_signed_rail_event_is_refused(world):
    lab = world["t"].me()["id"]
    event = {"id": "evt-dup", "type": "deposit.succeeded", "account_id": lab, "amount": 1, "currency": "USD"}
    before = fingerprint(world["market"])
    for key, value in (("amount", 100_000), ("account_id", lab + 1), ("id", "evt-other")):
        raw = _with_duplicate(event, key, value)
        headers = {SIGNATURE_HEADER: signature_header(RAIL.secret, raw, int(time.time())),
                   "Content-Type": "application/json"}  # fmt: skip
        response = httpx.post(world["url"] + "/v1/rails/test/events", content=raw, headers=headers)
        assert response.status_code == 422, response.text
        assert response.json()["error"] == "invalid_request" and "twice" in response.json()["message"]
    assert fingerprint(world["market"]) == before
    # The same event without the duplicate, signed the same way, is applied (so the refusal was the key).
    raw = json.dumps(event).encode()
    headers = {SIGNATURE_HEADER: signature_header(RAIL.secret, raw, int(time.time())), "Content-Type": "application/json"}
    assert httpx.post(world["url"] + "/v1/rails/test/events", content=raw, headers=headers).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b'{"evidence": "caf\xe9"}',  # Latin-1, not UTF-8
        b"\xff\xfe{\x00}\x00",  # UTF-16 with a byte-order mark
        b'\xef\xbb\xbf{"evidence": "x"}',  # UTF-8 with a byte-order mark
        b'{"evidence": "x"',  # unparseable
        b"[" * 30_000 + b"]" * 30_000,  # nested beyond the parser's depth
    ],
)
@pytest.mark.parametrize("content_type", ["application/json", None, "text/plain"])
def test_bodies_that_are_not_strict_json_get_422_in_the_envelope(world, raw, content_type):
    before = fingerprint(world["market"])
    headers = {"Authorization": f"Bearer {world['t'].token}"}
    if content_type:
        headers["Content-Type"] = content_type
    for path in ("/v1/accounts/me/verification", "/v1/rails/test/events", "/v1/accounts"):
        response = httpx.post(world["url"] + path, content=raw, headers=headers)
        assert response.status_code == 422, (path, response.text)
        out = response.json()
        assert set(out) <= {"error", "message", "detail"} and "detail" not in out or isinstance(out["detail"], dict)
        assert out["error"] == "invalid_request" and out["message"], out
    assert fingerprint(world["market"]) == before


def test_the_openapi_document_lists_422_for_every_post_with_a_body(world):
    document = httpx.get(world["url"] + "/openapi.json").json()
    posts = [(path, spec["post"]) for path, spec in document["paths"].items() if "post" in spec]
    with_body = [(path, op) for path, op in posts if "requestBody" in op]
    assert len(with_body) >= 20
    for path, op in with_body:
        answer = op["responses"]["422"]
        assert answer["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorOut"}, path
        assert "strict UTF-8 JSON" in answer["description"], path
