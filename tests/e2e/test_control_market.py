"""The market, a provider's control plane with its agent, and a tenant, end to end over real HTTP, with
the market's store on SQLite and on PostgreSQL: the tenant's demand carries its job; it is matched,
the agent accepts the lease (signing the terms, which cover the job), the job (a real tiny
`runyard run`) runs on the control plane, signed usage is reported, the lease closes and settles,
and the tenant's `results_to` gets the run's results with its evaluation report (no checkpoints).
Beside it, two leases the agent must refuse before any work: one whose results go to a URL scheme
it cannot deliver to, and one without a job whose spec comes from the drop folder (the fallback)
and is invalid; both are rejected with the reason, and their escrow returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from runyard.control.client import ControlClient
from runyard.market.client import MarketClient
from runyard.market.schema import transitions
from runyard.market.server import ServerThread
from runyard.market.service import Market, Settings
from runyard.market.verifiers import OperatorVerifier
from tests.market.conftest import PgSchemas, pg_base_url

from .conftest import TINY_SPEC, merge

pytestmark = pytest.mark.slow
PRICE = 36_000  # per device-hour: 10 minor units per device-second, so seconds of work are billable


def _runyard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runyard", *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def _until(what, timeout_s: float = 120, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what.__doc__ or what}")
        time.sleep(poll_s)


@pytest.fixture(params=["sqlite", "postgres"])
def market_url(request, tmp_path):
    if request.param == "sqlite":
        yield str(tmp_path / "market.db")
        return
    schemas = PgSchemas(pg_base_url())
    yield schemas.new_url()
    schemas.drop_all()


def _rejection(market: Market, lease_id: int) -> str:
    def read(conn, now):
        rows = conn.execute(transitions.select().where(transitions.c.entity == "lease",
                                                       transitions.c.entity_id == lease_id,
                                                       transitions.c.to_state == "rejected")).mappings().all()
        return rows[0]["reason"] if rows else ""
    return market.read(read)


def test_lease_matched_accepted_run_reported_settled_and_delivered(tmp_path, market_url):
    market = Market.open(market_url, Settings(test_clock=True, dispute_window_s=60), verifier=OperatorVerifier())
    with ServerThread(market) as server:
        from runyard.market import identity

        ops = MarketClient(server.url, token=identity.create_operator(market, "ops")["token"])
        provider, tenant = MarketClient(server.url), MarketClient(server.url)
        provider.register("cpu-farm", "provider")
        tenant.register("lab", "tenant")
        for name, party in (("cpu-farm", provider), ("lab", tenant)):
            party.request_verification("papers")
            ops.decide(name, True, "checked")
        provider.save_identity(tmp_path / "provider.json")
        provider.create_listing(accelerator_kind="cpu", devices_per_node=4, node_count=1, region="eu-west",
                                jurisdiction="eu", price_per_device_hour=PRICE,
                                available_until=ops.market_info()["now"] + 86400, start_class="immediate")
        ops.credit("lab", 150_000, "test funds")  # four demands of 36,000 escrow each
        need = {"accelerator_kinds": ["cpu"], "device_count": 1, "duration_s": 3600}
        results = tmp_path / "tenant" / "results"  # the tenant's directory, named in its demand
        spec_text = yaml.safe_dump(merge(TINY_SPEC, {"train": {"steps": 12}}))
        demand = tenant.place_demand(need, PRICE, job={"spec": spec_text, "results_to": str(results)})
        assert demand["state"] == "matched" and demand["job"]["results_to"] == str(results)
        lease_id = demand["lease_id"]
        # Refused before any work: a results URL this provider cannot deliver to ...
        to_url = tenant.place_demand(need, PRICE, job={"spec": spec_text, "results_to": "https://bucket/x"})
        # ... a folder outside the provider's delivery folders ...
        elsewhere = tenant.place_demand(need, PRICE, job={"spec": spec_text, "results_to": str(tmp_path / "etc")})
        # ... and a job-less demand whose drop-folder spec (the fallback) is not a valid job spec.
        dropped = tenant.place_demand(need, PRICE)
        drop = tmp_path / "lease-jobs" / f"demand-{dropped['id']}"
        drop.mkdir(parents=True)
        (drop / "spec.yaml").write_text(yaml.safe_dump(merge(TINY_SPEC, {"train": {"steps": -1}})))

        state = tmp_path / "control"
        started = _runyard("control", "start", "--state-dir", str(state), "--cpu-slots", "2", "--market", server.url,
                           "--provider-key", str(tmp_path / "provider.json"), "--usage-interval", "1",
                           "--lease-jobs", str(tmp_path / "lease-jobs"), "--deliveries-root", str(tmp_path / "tenant"))
        assert started.returncode == 0, started.stderr + (state / "daemon.log").read_text()
        try:
            control = ControlClient.for_state_dir(state)
            for refused, why in ((to_url, "https://"), (elsewhere, "outside this provider's delivery folders"),
                                 (dropped, "train.steps")):
                assert _until(lambda r=refused: tenant.lease(r["lease_id"])["state"] == "rejected")
                assert why in _rejection(market, refused["lease_id"]), _rejection(market, refused["lease_id"])
                assert tenant.lease(refused["lease_id"])["refunded"] == tenant.lease(refused["lease_id"])["escrow_amount"]
                assert not control.jobs(lease=str(refused["lease_id"]))
            jobs = _until(lambda: control.jobs(lease=str(lease_id)))
            assert jobs[0]["priority"] == 100 and jobs[0]["devices"] == 1
            assert _until(lambda: tenant.lease(lease_id)["state"] == "running")
            final = control.wait(jobs[0]["id"], timeout_s=180, poll_s=0.5)
            assert final["state"] == "succeeded", control.logs(final["id"])["text"][-3000:]

            _until(lambda: (results / "eval" / "report.md").exists())
            report = json.loads((results / "eval" / "report.json").read_text())
            assert report and (results / "export" / "model.safetensors").exists()
            assert yaml.safe_load((results / "spec.yaml").read_text())["train"]["steps"] == 12
            assert (results / "manifest.json").exists() and list(results.glob("stages/*/metrics.jsonl"))
            assert not list(results.rglob("checkpoints")), "checkpoints stay with the provider"
            assert not list(results.rglob("*.pt")) and not list(results.rglob("*.log"))
            assert not (tmp_path / "lease-jobs" / f"demand-{demand['id']}").exists()  # the market carried it

            records = _until(lambda: tenant.usage(lease_id)["records"])
            assert all(r["evidence"].startswith("sha256:") for r in records)
            reported = sum(r["device_seconds"] for r in records)
            assert 0 < reported <= final["device_seconds"] + 1

            ops.advance_clock(3600)  # the window ends: the agent closes the lease
            assert _until(lambda: tenant.lease(lease_id)["state"] in ("window_closed", "settled"))
            ops.advance_clock(120)  # past the dispute window
            ops.sweep()
            lease = tenant.lease(lease_id)
            assert lease["state"] == "settled"
            charged = sum(r["device_seconds"] for r in tenant.usage(lease_id)["records"]) * PRICE // 3600
            assert lease["paid_provider"] + lease["paid_fee"] == charged > 0
            assert lease["refunded"] == lease["escrow_amount"] - charged
            assert ops.audit()["ok"]
        finally:
            _runyard("control", "stop", "--state-dir", str(state))
    market.store.dispose()
