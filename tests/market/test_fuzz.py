"""A fuzzer against the live market: schemathesis generates requests for every operation of the
market's own OpenAPI document (valid and invalid, every parameter), sends them to a real server on
loopback as the role each operation is for, and checks that none answers a 5xx and that every answer
matches the document: its status code is one the document lists for that operation, its content
type the documented one, its body the documented schema. Afterwards every invariant of the store
still holds. Bounded: a fixed number of examples per operation (a minute or two on a slow machine in
the fast tier). test_documented_statuses.py drives the paths every operation shares on purpose."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from runyard.market.api import create_app
from runyard.market.operations import BY_NAME, OPERATIONS
from runyard.market.server import ServerThread
from tests.tiers import examples

from .helpers import HOUR, assert_audit_ok, listing, new_party, open_market, operator_client, requirement

EXAMPLES = examples(25, fast=3)  # per operation; every operation is fuzzed in both tiers
# One worker runs the module: the audit test checks the store the fuzzing tests wrote.
pytestmark = pytest.mark.xdist_group("market_fuzz")
# No 5xx, and every answer's status code, content type and body are the ones the document lists.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
PROVIDER_OPERATIONS = {
    "create_listing", "withdraw_listing", "accept_lease", "reject_lease", "start_lease", "close_lease",
    "report_usage", "contest", "report_availability", "publish_endpoint",
}  # fmt: skip


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A market with some history (a running block lease with a usage record, a running standing lease
    with an availability record) and a token per role."""
    market = open_market(str(tmp_path_factory.mktemp("fuzz") / "market.db"))
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        provider = new_party(server.url, "prov", "provider", ops).client
        tenant = new_party(server.url, "lab", "tenant", ops).client
        ops.credit("lab", 100_000, "seed")
        provider.create_listing(**listing())
        lease_id = tenant.place_demand(requirement(), 300)["lease_id"]
        provider.accept_lease(lease_id)
        started = provider.start_lease(lease_id)["started_at"]
        ops.advance_clock(HOUR)
        provider.report_usage(lease_id, 1, started, started + 600, 2400)
        # The standing listing ends six hours on: a fuzzed clock jump (up to ten years) ends its lease
        # there instead of renewing it through every period since, which one sweep cannot do in the
        # client's 10 s.
        provider.create_listing(**listing(accelerator_kind="l4", available_until=market.now() + 6 * HOUR,
                                          form="standing", standing={
            "period_s": 600, "availability_bps": 9950, "credits": [{"below_bps": 9950, "credit_bps": 1000}]}))
        standing = tenant.place_demand({"accelerator_kinds": ["l4"], "device_count": 1}, 300, form="standing",
                                       standing={"period_s": 600, "term_periods": 2})["lease_id"]
        provider.accept_lease(standing)
        begun = provider.start_lease(standing)["started_at"]
        ops.advance_clock(300)
        provider.report_availability(standing, 1, begun, begun + 200, 190, 20, 19, 4)
        tokens = {"operator": ops.token, "provider": provider.token, "tenant": tenant.token}
        yield {"market": market, "url": server.url, "tokens": tokens}
    market.store.dispose()


@pytest.fixture(scope="module")
def market_schema(live):
    return schemathesis.openapi.from_dict(create_app(live["market"]).openapi())


@pytest.mark.slow
@pytest.mark.parametrize("name", [op.name for op in OPERATIONS])
def test_no_operation_answers_5xx(name, live, market_schema):
    op = BY_NAME[name]
    role = "operator" if op.auth == "operator" else "provider" if op.name in PROVIDER_OPERATIONS else "tenant"
    operation = market_schema.find_operation_by_id(name)

    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(case):
        print("CASE", name, case.body, case.headers)
        headers = dict(case.headers or {})
        if op.auth != "none":
            headers["Authorization"] = f"Bearer {live['tokens'][role]}"
        case.call_and_validate(
            base_url=live["url"], headers=headers, checks=CHECKS
        )

    fuzz()


@pytest.mark.slow
def test_the_audit_holds_after_fuzzing(live):
    assert_audit_ok(live["market"])
