"""Every status the market answers is one its OpenAPI document lists for that operation, in the error
envelope the document names. The fuzzer (test_fuzz.py) checks this over generated requests; here the
paths every operation shares are driven on purpose, against a real server: no credentials, a role
that may not call it, an id that does not exist, a body too large for its route, a body that is not
strict JSON, and an empty request."""

from __future__ import annotations

import re

import httpx
import pytest

from runyard.market.api import DEFAULT_MAX_BODY, create_app
from runyard.market.jobs import MAX_DEMAND_BODY_BYTES
from runyard.market.operations import OPERATIONS, Operation
from runyard.market.server import ServerThread

from .helpers import assert_audit_ok, fingerprint, new_party, open_market, operator_client

MISSING_ID = 987_654_321


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    market = open_market(str(tmp_path_factory.mktemp("statuses") / "market.db"))
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        tokens = {
            "operator": ops.token,
            "provider": new_party(server.url, "prov", "provider", ops).client.token,
            "tenant": new_party(server.url, "lab", "tenant", ops).client.token,
        }
        yield {"market": market, "url": server.url, "tokens": tokens, "doc": create_app(market).openapi()}
    market.store.dispose()


def _path(op: Operation) -> str:
    return re.sub(r"{(\w+)}", lambda m: str(MISSING_ID) if m[1].endswith("_id") else "nope", op.path)


def _probes(op: Operation, tokens: dict[str, str]) -> list[tuple[str, dict[str, str], bytes]]:
    """(what, headers, body) for each shared path of `op`."""
    limit = MAX_DEMAND_BODY_BYTES if op.path == "/v1/demands" else DEFAULT_MAX_BODY
    caller = "operator" if op.auth == "operator" else "tenant"
    auth = {"Authorization": f"Bearer {tokens[caller]}"} if op.auth in ("account", "operator") else {}
    key = {"Idempotency-Key": f"probe-{op.name}"} if op.key else {}
    json_type = {"Content-Type": "application/json"}
    probes = [
        ("an empty request", {**auth, **key}, b""),
        ("a body that is not UTF-8", {**auth, **key, **json_type}, b'{"a": "\xff"}'),
        ("a key twice", {**auth, **key, **json_type}, b'{"a": 1, "a": 2}'),
        ("a body too large", {**auth, **key, **json_type}, b" " * (limit + 1)),
        ("an empty object", {**auth, **key, **json_type}, b"{}"),
    ]
    if op.auth in ("account", "operator", "rail"):
        probes.append(("no credentials", key, b""))
        probes.append(("an unknown token", {"Authorization": "Bearer ryk_nope", **key}, b""))
    if op.auth == "operator":
        probes.append(("a tenant's token", {"Authorization": f"Bearer {tokens['tenant']}", **key}, b""))
    if op.auth == "account":
        other = {"Authorization": f"Bearer {tokens['provider']}"}
        probes.append(("a provider's token", {**other, **key, **json_type}, b"{}"))
    return probes


@pytest.mark.parametrize("op", OPERATIONS, ids=[op.name for op in OPERATIONS])
def test_every_answer_on_the_shared_paths_is_documented(op, live):
    documented = live["doc"]["paths"][op.path][op.method.lower()]["responses"]
    before = fingerprint(live["market"]) if op.method == "POST" else None
    with httpx.Client(base_url=live["url"], timeout=30) as http:
        for what, headers, body in _probes(op, live["tokens"]):
            answer = http.request(op.method, _path(op), headers=headers, content=body)
            where = f"{op.name} ({op.method} {op.path}) with {what}"
            assert str(answer.status_code) in documented, (
                f"{where} answered {answer.status_code}, not in the document's {sorted(documented)}: {answer.text[:300]}"
            )
            assert answer.headers["content-type"].startswith("application/json"), where
            if answer.status_code >= 400:
                envelope = answer.json()
                assert isinstance(envelope, dict) and {"error", "message"} <= envelope.keys(), (where, envelope)
                schema = documented[str(answer.status_code)]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorOut"}, where
    if before is not None and op.name not in ("register", "advance_clock", "set_fee", "sweep"):
        # None of the probes carries a valid body, token and key at once: nothing changed.
        assert fingerprint(live["market"])["counts"] == before["counts"], op.name


def test_the_audit_holds_after_the_probes(live):
    assert_audit_ok(live["market"])
