"""A demand carries its job (spec text and where results go) over real HTTP, on both backends: stored
with the demand, shown on the lease to its tenant and provider only, covered by the provider's signed
acceptance, and refused with a clear 4xx (changing nothing) when it is oversized or not a YAML mapping."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from runyard.market.client import MarketClientError
from runyard.market.jobs import MAX_DEMAND_BODY_BYTES, MAX_SPEC_BYTES, job_sha256
from runyard.market.payloads import lease_terms
from runyard.market.schema import metadata
from runyard.market.server import ServerThread
from runyard.market.signing import sign
from runyard.market.store import MIGRATIONS_DIR, Store

from .helpers import (
    assert_audit_ok,
    fingerprint,
    listing,
    new_party,
    open_market,
    operator_client,
    requirement,
)

SPEC = "name: tiny\nseed: 7\ntrain:\n  steps: 3\n"
JOB = {"spec": SPEC, "results_to": "/srv/results/lab-1"}


@pytest.fixture
def world(store_url):
    """A server, an operator, two verified providers (p1 lists capacity) and two funded tenants."""
    market = open_market(store_url)
    with ServerThread(market) as server:
        ops = operator_client(market, server.url)
        p1, p2 = (new_party(server.url, n, "provider", ops).client for n in ("p-one", "p-two"))
        t1, t2 = (new_party(server.url, n, "tenant", ops).client for n in ("t-one", "t-two"))
        for name in ("t-one", "t-two"):
            ops.credit(name, 50_000, "opening balance")
        p1.create_listing(**listing(price_per_device_hour=300))
        yield {"market": market, "ops": ops, "p1": p1, "p2": p2, "t1": t1, "t2": t2}
    assert_audit_ok(market)
    market.store.dispose()


def test_job_is_stored_and_seen_by_the_lease_parties_only(world):
    ops, p1, p2, t1, t2 = (world[k] for k in ("ops", "p1", "p2", "t1", "t2"))
    demand = t1.place_demand(requirement(), 300, job=JOB)
    assert demand["job"] == JOB and demand["state"] == "matched"
    assert t1.demand(demand["id"])["job"] == JOB
    lease_id = demand["lease_id"]
    for party in (t1, p1):
        lease = party.lease(lease_id)
        assert lease["job"] == JOB
        assert lease["job_sha256"] == lease["terms"]["job_sha256"] == job_sha256(JOB)
        assert [x["job"] for x in party.leases() if x["id"] == lease_id] == [JOB]
    assert [x["job"] for x in p1.leases(state="offered")] == [JOB]  # the provider sees it before accepting

    # Nobody else reads it: another tenant or provider gets 404 or an empty list ...
    for call in (lambda: t2.lease(lease_id), lambda: p2.lease(lease_id), lambda: t2.demand(demand["id"])):
        with pytest.raises(MarketClientError) as err:
            call()
        assert err.value.status == 404
    assert t2.leases() == [] and p2.leases() == [] and t2.demands() == []
    # ... and an operator sees the lease and the demand but not the job (only its digest).
    assert "job" not in ops.lease(lease_id) and ops.lease(lease_id)["job_sha256"] == job_sha256(JOB)
    assert all("job" not in x for x in ops.leases() + ops.demands())
    assert JOB["spec"] not in str(ops.leases()) + str(ops.demands()) + str(ops.demand(demand["id"]))

    # The acceptance signs the job: a signature over another job's digest is refused, changing nothing.
    forged = sign(
        p1.private_key, lease_terms({**p1.lease(lease_id), "job_sha256": "sha256:" + "0" * 64}, "USD")
    )
    before = fingerprint(world["market"])
    with pytest.raises(MarketClientError) as err:
        p1.request("POST", f"/v1/leases/{lease_id}/accept", {"signature": forged}, key="forged-accept")
    assert err.value.status == 422 and err.value.code == "signature_invalid"
    assert fingerprint(world["market"]) == before
    assert p1.accept_lease(lease_id)["state"] == "accepted"


def test_demand_without_job_has_none(world):
    demand = world["t1"].place_demand(requirement(), 300)
    assert demand["job"] is None
    lease = world["p1"].lease(demand["lease_id"])
    assert lease["job"] is None and lease["job_sha256"] is None and lease["terms"]["job_sha256"] is None
    assert world["p1"].accept_lease(lease["id"])["state"] == "accepted"


BAD_JOBS = {
    "oversized spec": ({"spec": "name: x\n" + "#" * MAX_SPEC_BYTES, "results_to": "/r"}, 422, "job.spec"),
    "body over the limit": ({"spec": "name: x\n#" + "x" * MAX_DEMAND_BODY_BYTES, "results_to": "/r"}, 413, None),
    "multibyte over the limit": (
        {"spec": "name: " + "é" * (MAX_SPEC_BYTES // 2 + 1), "results_to": "/r"},
        422,
        "bytes",
    ),
    "invalid YAML": ({"spec": "name: [unclosed\nseed: 1\n", "results_to": "/r"}, 422, "not valid YAML"),
    "YAML scalar": ({"spec": "just words", "results_to": "/r"}, 422, "mapping"),
    "YAML list": ({"spec": "- a\n- b\n", "results_to": "/r"}, 422, "mapping"),
    "empty mapping": ({"spec": "{}", "results_to": "/r"}, 422, "mapping"),
    "relative results_to": ({"spec": SPEC, "results_to": "results/x"}, 422, "absolute path"),
    "results_to with ..": ({"spec": SPEC, "results_to": "/srv/../etc"}, 422, ".."),
    "results_to control chars": ({"spec": SPEC, "results_to": "/srv/x\n"}, 422, "control"),
    "no results_to": ({"spec": SPEC}, 422, "results_to"),
    "unknown field": ({**JOB, "priority": 1}, 422, "priority"),
}


@pytest.mark.parametrize("case", sorted(BAD_JOBS))
def test_bad_job_is_refused_and_changes_nothing(world, case):
    job, status, words = BAD_JOBS[case]
    t1 = world["t1"]
    balances = t1.balances()
    before = fingerprint(world["market"])
    with pytest.raises(MarketClientError) as err:
        t1.place_demand(requirement(), 300, job=job)
    assert err.value.status == status, err.value
    assert words is None or words in err.value.message, err.value.message
    assert fingerprint(world["market"]) == before
    assert t1.balances() == balances and t1.demands() == []


def test_upgrade_from_0001_keeps_demands_and_adds_the_job_columns(empty_store_url):
    """A store made by revision 0001 (before jobs) upgrades in place; its demands read as job-less."""
    store_url = empty_store_url
    store = Store(store_url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    with store.engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0001")
        columns = [c["name"] for c in inspect(conn).get_columns("demands")]
        assert "job_spec" not in columns
    store.dispose()
    market = open_market(store_url)  # migrates to head
    with market.store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), metadata) == []
        head = ScriptDirectory.from_config(config).get_current_head()
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head
    market.store.dispose()
