"""The market, a provider's control plane with its agent, and a tenant, end to end over real HTTP, with
the market's store on SQLite and on PostgreSQL: the tenant's demand carries its job and its data
(files uploaded with it and a URL the provider fetches); it is matched, the agent accepts the lease
(signing the terms, which cover the job and its data), the job (a real tiny `runyard run`) runs on
the control plane inside the sandbox, signed usage is reported, the lease closes and settles, and
the tenant's `results_to` gets the run's results with its evaluation report (no checkpoints).
Beside it, leases the agent must refuse before any work: results to a URL scheme it cannot deliver
to or to a folder outside its delivery folders, a drop-folder spec (the fallback) that is invalid,
and hostile specs that name a provider file, the daemon's environment, a socket of the provider's
network, or a cache outside the lease -- each rejected with the reason, its escrow returned, and
nothing delivered; and a lease whose data URL cannot be fetched, which ends with that reason."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import sysconfig
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from runyard.control.client import ControlClient
from runyard.market import identity
from runyard.market.client import MarketClient
from runyard.market.schema import transitions
from runyard.market.server import ServerThread
from runyard.market.service import Market, Settings
from runyard.market.verifiers import OperatorVerifier
from tests.control.helpers import require_sandbox
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


# PostgreSQL in the full tier: the market on PostgreSQL is the fast tier's in tests/market.
@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.full)])
def market_url(request, tmp_path):
    if request.param == "sqlite":
        yield str(tmp_path / "market.db")
        return
    schemas = PgSchemas(pg_base_url())
    yield schemas.new_url()
    schemas.drop_all()


def _reason(market: Market, lease_id: int, state: str = "rejected") -> str:
    def read(conn, now):
        rows = conn.execute(transitions.select().where(transitions.c.entity == "lease",
                                                       transitions.c.entity_id == lease_id,
                                                       transitions.c.to_state == state)).mappings().all()
        return rows[0]["reason"] if rows else ""
    return market.read(read)


def _tenant_data(tmp_path: Path) -> tuple[dict[str, str], str]:
    """The tenant's data: the stdlib's json package uploaded with the demand, and a few email modules
    served as one text file over HTTP (on loopback: the provider allows that network for the test)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = {f"data/json/{p.name}": base64.b64encode(p.read_bytes()).decode()
             for p in sorted((stdlib / "json").glob("*.py"))}
    served = tmp_path / "served"
    served.mkdir()
    with open(served / "email.txt", "wb") as out:
        for p in sorted((stdlib / "email").glob("*.py"))[:8]:
            out.write(p.read_bytes())
    return files, str(served)


class _QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class _DataServer:
    """A real HTTP server the tenant's data URL points at."""

    def __init__(self, folder: str):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietFiles, directory=folder))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def test_lease_matched_accepted_run_reported_settled_and_delivered(tmp_path, market_url):
    require_sandbox()
    files, served = _tenant_data(tmp_path)
    data = _DataServer(served)
    market = Market.open(market_url, Settings(test_clock=True, dispute_window_s=60), verifier=OperatorVerifier())
    with ServerThread(market) as server:
        ops = MarketClient(server.url, token=identity.create_operator(market, "ops")["token"])
        provider, tenant = MarketClient(server.url), MarketClient(server.url)
        provider.register("cpu-farm", "provider")
        tenant.register("lab", "tenant")
        for name, party in (("cpu-farm", provider), ("lab", tenant)):
            party.request_verification("papers")
            ops.decide(name, True, "checked")
        provider.save_identity(tmp_path / "provider.json")
        provider.create_listing(accelerator_kind="cpu", devices_per_node=16, node_count=1, region="eu-west",
                                jurisdiction="eu", price_per_device_hour=PRICE,
                                available_until=ops.market_info()["now"] + 86400, start_class="immediate")
        ops.credit("lab", 36_000 * 12, "test funds")  # a dozen demands of 36,000 escrow each
        need = {"accelerator_kinds": ["cpu"], "device_count": 1, "duration_s": 3600}
        deliveries = tmp_path / "tenant"
        results = deliveries / "results"  # the tenant's directory, named in its demand
        url = f"{data.url}/email.txt"
        sources = {"data": {"sources": [{"path": "data/json/*.py"}, {"path": url}]}}
        spec_text = yaml.safe_dump(merge(TINY_SPEC, {"train": {"steps": 12}, **sources}))
        job = {"spec": spec_text, "results_to": str(results), "files": files, "data_urls": [url]}
        demand = tenant.place_demand(need, PRICE, job=job)
        assert demand["state"] == "matched" and demand["job"]["results_to"] == str(results)
        lease_id = demand["lease_id"]
        # Refused before any work: a results URL this provider cannot deliver to ...
        to_url = tenant.place_demand(need, PRICE, job={**job, "results_to": "https://bucket/x"})
        # ... a folder outside the provider's delivery folders ...
        elsewhere = tenant.place_demand(need, PRICE, job={**job, "results_to": str(tmp_path / "etc")})
        # ... a job-less demand whose drop-folder spec (the fallback) is not a valid job spec ...
        dropped = tenant.place_demand(need, PRICE)
        drop = tmp_path / "lease-jobs" / f"demand-{dropped['id']}"
        drop.mkdir(parents=True)
        (drop / "spec.yaml").write_text(yaml.safe_dump(merge(TINY_SPEC, {"train": {"steps": -1}})))
        # ... and hostile specs, each reaching for what the demand does not carry.
        (tmp_path / "provider-secrets.txt").write_text("PROVIDER SECRET")
        hostile = {
            "a provider file": ({"path": str(tmp_path / "provider-secrets.txt")}, {}),
            "the daemon's environment": ({"path": "/proc/self/environ"}, {}),
            "the provider's network": ({"path": f"{data.url}/../control/api-token"}, {}),
            "a write outside the lease": ({"path": "data/json/*.py"}, {"cache_dir": str(tmp_path / "cache")}),
        }
        hostile_demands = {}
        for case, (source, extra) in hostile.items():
            bad = yaml.safe_dump(merge(TINY_SPEC, {"data": {"sources": [source], **extra}}))
            folder = deliveries / case.replace(" ", "-").replace("'", "")
            hostile_demands[case] = (tenant.place_demand(need, PRICE, job={**job, "spec": bad,
                                                                             "results_to": str(folder)}), folder)
        # A lease whose data URL cannot be fetched is accepted, then ends with the reason.
        unfetchable = tenant.place_demand(need, PRICE, job={**job, "results_to": str(deliveries / "missing"),
                                                            "data_urls": [f"{data.url}/missing.txt"],
                                                            "spec": spec_text.replace(url, f"{data.url}/missing.txt")})

        state = tmp_path / "control"
        started = _runyard("control", "start", "--state-dir", str(state), "--cpu-slots", "2", "--market", server.url,
                           "--provider-key", str(tmp_path / "provider.json"), "--usage-interval", "1",
                           "--lease-jobs", str(tmp_path / "lease-jobs"), "--deliveries-root", str(deliveries),
                           "--allow-data-network", "127.0.0.0/8")
        assert started.returncode == 0, started.stderr + (state / "daemon.log").read_text()
        try:
            control = ControlClient.for_state_dir(state)
            refusals = [(to_url, "https://", None), (elsewhere, "outside this provider's delivery folders", None),
                        (dropped, "train.steps", None)]
            refusals += [(d, "a lease job reads only", folder) for d, folder in hostile_demands.values()]
            refusals[-1] = (refusals[-1][0], "data.cache_dir must be unset", refusals[-1][2])
            for refused, why, folder in refusals:
                assert _until(lambda r=refused: tenant.lease(r["lease_id"])["state"] == "rejected")
                reason = _reason(market, refused["lease_id"])
                assert why in reason, reason
                assert tenant.lease(refused["lease_id"])["refunded"] == tenant.lease(refused["lease_id"])["escrow_amount"]
                assert not control.jobs(lease=str(refused["lease_id"]))
                assert folder is None or not folder.exists(), "something was delivered for a refused lease"
                assert not (state / "agent" / f"lease-{refused['lease_id']}").exists()  # its spec and data are gone

            gone = unfetchable["lease_id"]
            assert _until(lambda: tenant.lease(gone)["state"] in ("terminated", "settled"))
            assert "a data URL could not be fetched" in _reason(market, gone, "terminated")
            assert "404" in _reason(market, gone, "terminated")
            # Nothing of the run, nothing of the provider's: at most the delivery's marker (when the agent
            # saw the job running before it failed, it delivers what the run left, which is nothing).
            missing = deliveries / "missing"
            delivered = sorted(p.name for p in missing.iterdir()) if missing.exists() else []
            assert delivered in ([], [".runyard-delivery.json"]), delivered

            jobs = _until(lambda: control.jobs(lease=str(lease_id)))
            assert jobs[0]["priority"] == 100 and jobs[0]["devices"] == 1
            assert jobs[0]["argv"][1:3] == ["-m", "runyard.control.sandbox"]  # it runs inside the sandbox
            folder = state / "agent" / f"lease-{lease_id}"
            assert jobs[0]["run_dir"] == str(folder / "work" / "run")
            assert _until(lambda: tenant.lease(lease_id)["state"] == "running")
            final = control.wait(jobs[0]["id"], timeout_s=180, poll_s=0.5)
            assert final["state"] == "succeeded", control.logs(final["id"])["text"][-3000:]
            assert "runyard sandbox: lease" in control.logs(final["id"])["text"]

            _until(lambda: (results / "eval" / "report.md").exists())
            report = json.loads((results / "eval" / "report.json").read_text())
            assert report and (results / "export" / "model.safetensors").exists()
            assert yaml.safe_load((results / "spec.yaml").read_text())["train"]["steps"] == 12
            assert (results / "manifest.json").exists() and list(results.glob("stages/*/metrics.jsonl"))
            assert not list(results.rglob("checkpoints")), "checkpoints stay with the provider"
            assert not list(results.rglob("*.pt")) and not list(results.rglob("*.log"))
            assert not (tmp_path / "lease-jobs" / f"demand-{demand['id']}").exists()  # the market carried it
            # It read the files the demand carried and the copy of the URL it names: nothing else.
            assert json.loads((results / "data" / "report.json").read_text())["input_files"] == len(files) + 1
            assert (folder / "urls" / "0-email.txt").read_bytes() == (Path(served) / "email.txt").read_bytes()

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
            data.close()
    market.store.dispose()
