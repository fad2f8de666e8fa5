"""One definition per operation: every operation in `runyard.market.operations` is a route of the
API (with its method, path, auth and idempotency header as defined), a method of the client, a
verb of the CLI where it names one, and the closed sets the API documents are the state machines'."""

from __future__ import annotations

import argparse
import typing

import pytest

from runyard.cli import market_admin, market_trade
from runyard.market import api, errors, responses
from runyard.market.api import HANDLERS, create_app
from runyard.market.client import MarketClient
from runyard.market.models import LeaseStateName
from runyard.market.operations import OPERATIONS
from runyard.market.states.demand import DEMAND
from runyard.market.states.dispute import DISPUTE
from runyard.market.states.identity import IDENTITY
from runyard.market.states.lease import LEASE
from runyard.market.states.listing import LISTING
from runyard.market.states.period import PERIOD
from runyard.market.states.record import RECORD

from .helpers import open_market


@pytest.fixture(scope="module")
def openapi(tmp_path_factory):
    market = open_market(str(tmp_path_factory.mktemp("ops") / "m.db"))
    try:
        yield create_app(market).openapi()
    finally:
        market.store.dispose()


def test_every_operation_is_a_route_as_defined(openapi):
    assert set(HANDLERS) == {op.name for op in OPERATIONS}
    routes = {
        spec["operationId"]: (method.upper(), path, spec)
        for path, methods in openapi["paths"].items()
        for method, spec in methods.items()
    }
    assert set(routes) == {op.name for op in OPERATIONS}
    for op in OPERATIONS:
        method, path, spec = routes[op.name]
        assert (method, path) == (op.method, op.path)
        headers = {p["name"]: p for p in spec.get("parameters", []) if p["in"] == "header"}
        if op.key == "required":
            assert headers["Idempotency-Key"]["required"] is True, op.name
        elif op.key is None:
            assert "Idempotency-Key" not in headers, op.name
        assert ("security" in spec) == (op.auth != "none"), op.name
        assert str(op.status) in spec["responses"]
        for code in op.errors:
            assert spec["responses"][str(code)]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorOut"
            }, (op.name, code)
    schemes = openapi["components"]["securitySchemes"]
    assert schemes["HTTPBearer"]["scheme"] == "bearer" and schemes["APIKeyHeader"]["name"] == "Runyard-Rail-Signature"


def test_every_operation_is_a_client_method_and_a_verb():
    for op in OPERATIONS:
        method = getattr(MarketClient, op.name)
        assert callable(method), op.name
    parser = argparse.ArgumentParser()
    verbs = parser.add_subparsers(dest="verb")
    market_admin.add_verbs(verbs)
    market_trade.add_verbs(verbs)
    for op in OPERATIONS:
        if op.cli is not None:
            args = [*op.cli, *("7" for _ in op.path_params)]
            required = {
                "withdraw": ["--amount", "1", "--payout-method-id", "1"],
                "add_payout_method": ["--rail", "test", "--destination", "x"],
                "place_demand": ["--max-price", "1"],
                "register": ["name", "--role", "tenant"],
                "create_listing": ["--accelerator-kind", "cpu", "--devices-per-node", "1", "--node-count", "1",
                                   "--region", "r", "--jurisdiction", "j", "--price-per-device-hour", "1",
                                   "--available-until", "2030-01-01T00:00:00"],
                "accept_lease": [], "report_usage": ["--seq", "1", "--interval-start", "1", "--interval-end", "2",
                                                     "--device-seconds", "1"],
                "submit_measurement": ["--interval-start", "1", "--interval-end", "2", "--device-seconds", "1"],
                "terminate_lease": ["--reason-code", "other"], "dispute": ["--reason", "x"],
                "contest": ["--reason", "x"], "request_verification": [],
                "report_availability": ["--seq", "1", "--interval-start", "1", "--interval-end", "2",
                                        "--available-seconds", "1", "--probes", "1", "--probes-ok", "1"],
                "submit_probes": ["--interval-start", "1", "--interval-end", "2", "--available-seconds", "1",
                                  "--probes", "1", "--probes-ok", "1"],
                "publish_endpoint": ["--endpoint-url", "http://h:1"],
                "request_rollout": ["runs/x"],  # the export to upload
            }.get(op.name, [])  # fmt: skip
            if op.name == "register":
                args = ["register"]
            assert parser.parse_args([*args, *required]).handler, op.name
    # The verb beside an operation's own: a roll-back names no export.
    assert parser.parse_args(["deployment", "rollback", "7"]).handler
    for op in OPERATIONS:
        if op.admin is not None:
            assert parser.parse_args(["admin", op.admin, "--db", "x", *_admin_required(op.name)]).handler
        if op.auth == "operator":
            assert op.admin is not None or op.name == "advance_clock", op.name


def _admin_required(name: str) -> list[str]:
    return {
        "decide": ["acct", "--approve", "--reason", "x"],
        "credit": ["--account", "a", "--amount", "1", "--reason", "x"],
        "resolve_dispute": ["7", "--outcome", "upheld", "--reason", "x"],
        "set_fee": ["--fee-bps", "10"],
        "decide_held_earnings": ["7", "--decision", "refund", "--reason", "x"],
    }.get(name, [])


def test_documented_state_sets_are_the_state_machines():
    assert set(typing.get_args(LeaseStateName)) == LEASE.states
    for literal, machine in (
        (responses.DemandState, DEMAND),
        (responses.DisputeState, DISPUTE),
        (responses.AccountState, IDENTITY),
        (responses.ListingState, LISTING),
        (responses.RecordState, RECORD),
        (responses.PeriodState, PERIOD),
    ):
        assert set(typing.get_args(literal)) == machine.states, machine.entity


def test_error_codes_are_documented():
    codes = {
        cls.code for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.MarketError)
    }
    codes |= {"internal"}
    assert codes <= set(typing.get_args(responses.ErrorCode))
    assert api.ERROR_TEXT.keys() >= {c for op in OPERATIONS for c in op.errors}
