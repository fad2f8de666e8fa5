"""Reproduce anywhere, through the market: a tenant's demand carries its job and its environment lock;
two providers, each a real control plane with its agent, run the same job in sequence. Each agent
builds the job's environment from the lock (the build's untrusted half confined in the sandbox,
cached by the lock's hash: the second provider, sharing the first one's cache as two providers on
one host would, finds it built) and runs the job inside it, inside the sandbox; each delivery
carries the reproduction inputs (spec, manifest with its data fingerprints, the environment lock,
the metrics); `runyard compare` on the two deliveries says the result held, bitwise (same CPU,
same build). A lock the provider cannot install is refused before any work, its reason named and
its escrow returned."""

from __future__ import annotations

import base64
import json
import sysconfig
from pathlib import Path

import pytest
import yaml

from runyard.cli.market_demand import read_env_lock
from runyard.market.server import ServerThread
from runyard.market.service import Market, Settings
from runyard.market.verifiers import OperatorVerifier
from runyard.reproduce.lock import read_lock, write_lock
from tests.control.helpers import require_sandbox

from .conftest import TINY_SPEC, merge
from .leases import ControlPlane, parties, reason, runyard, until

# The full tier (two environments built in the sandbox, two runs: the slowest test here). The fast tier keeps
# the parts: an environment rebuilt from a lock (tests/reproduce), a lease's job run in the sandbox and
# delivered (test_control_market), `runyard compare` (tests/reproduce/test_compare.py).
pytestmark = [pytest.mark.slow, pytest.mark.full]
PRICE = 3600


def test_the_same_job_on_two_providers_in_its_own_environment_compares_bitwise(tmp_path):
    require_sandbox()
    market = Market.open(str(tmp_path / "market.db"), Settings(test_clock=True, dispute_window_s=30),
                         verifier=OperatorVerifier())
    planes = []
    with ServerThread(market) as server:
        ops, made = parties(market, server.url, providers=("farm-a", "farm-b"))
        tenant = made["lab"]
        now = ops.market_info()["now"]
        for name, region in (("farm-a", "eu-west"), ("farm-b", "us-east")):
            made[name].save_identity(tmp_path / f"{name}.json")
            made[name].create_listing(accelerator_kind="cpu", devices_per_node=2, node_count=1, region=region,
                                      jurisdiction=region.split("-")[0], price_per_device_hour=PRICE,
                                      available_until=now + 86400)
        ops.credit("lab", 1_000_000, "test funds")

        # The tenant's environment, locked; and a lock no provider here can install (Python 2.7).
        locked = runyard("env", "lock", "--out", str(tmp_path / "lock"), timeout=600)
        assert locked.returncode == 0, locked.stderr
        lock = read_env_lock(tmp_path / "lock")
        bad = read_lock(tmp_path / "lock")
        bad.python = {**bad.python, "major_minor": "2.7", "version": "2.7.18", "interpreter_tag": "cp27"}
        write_lock(tmp_path / "bad-lock", bad)

        stdlib = Path(sysconfig.get_paths()["stdlib"])
        data = {f"data/{p.name}": base64.b64encode(p.read_bytes()).decode() for p in sorted((stdlib / "json").glob("*.py"))}
        spec = yaml.safe_dump(merge(TINY_SPEC, {"train": {"steps": 8}, "data": {"sources": [{"path": "data/*.py"}]}}))
        envs = tmp_path / "envs"  # one cache on this host, shared by the two providers
        for name in ("farm-a", "farm-b"):
            planes.append(ControlPlane(tmp_path / name, server.url, tmp_path / f"{name}.json", "--cpu-slots", "1",
                                       "--usage-interval", "1", "--deliveries-root", str(tmp_path / name / "out"),
                                       "--lease-env-cache", str(envs)))
        try:
            deliveries = {}
            for name, region in (("farm-a", "eu-west"), ("farm-b", "us-east")):  # in sequence
                results = tmp_path / name / "out" / "tiny"
                job = {"spec": spec, "results_to": str(results), "files": data, "env_lock": lock}
                demand = tenant.place_demand({"accelerator_kinds": ["cpu"], "device_count": 1, "duration_s": 3600,
                                              "allowed_regions": [region]}, PRICE, job=job)
                assert tenant.lease(demand["lease_id"])["provider_id"] == made[name].me()["id"]
                until(lambda r=results: (r / "eval" / "report.json").exists(), 900)
                deliveries[name] = results
                jobs = planes[-1 if name == "farm-b" else 0].client().jobs(lease=str(demand["lease_id"]))
                log = planes[-1 if name == "farm-b" else 0].client().logs(jobs[0]["id"])["text"]
                assert ("environment built" if name == "farm-a" else "reused from") in log, log[-3000:]

            a, b = deliveries["farm-a"], deliveries["farm-b"]
            for delivered in (a, b):  # the reproduction inputs travel with the results
                for rel in ("spec.yaml", "manifest.json", "env/requirements.txt", "env/environment.json",
                            "stages/main/metrics.jsonl", "eval/report.json"):
                    assert (delivered / rel).is_file(), rel
                assert json.loads((delivered / "manifest.json").read_text())["data"]["fingerprint"]
                assert not list(delivered.rglob("checkpoints"))
            ran = {d.name: d.version for d in read_lock(a / "env").distributions}
            assert ran == {d.name: d.version for d in read_lock(tmp_path / "lock").distributions}  # the tenant's versions
            assert (a / "env" / "requirements.txt").read_text() == (b / "env" / "requirements.txt").read_text()

            compared = runyard("compare", str(a), str(b), "--out", str(tmp_path / "comparison"), timeout=300)
            assert compared.returncode == 0, compared.stdout + compared.stderr
            report = json.loads((tmp_path / "comparison" / "report.json").read_text())
            assert report["verdict"] == "bitwise", report
            assert report["weights"]["equal"] and report["environment_differences"] == []
            # The same inputs, seen as the same: each provider ran the tenant's spec as written (in the
            # demand's files), so neither the spec's hash nor the data's keys name a provider's folders.
            assert report["input_differences"] == [], report["input_differences"]
            assert yaml.safe_load((a / "spec.yaml").read_text())["data"]["sources"][0]["path"] == "data/*.py"
            assert "BITWISE" in compared.stdout

            # A lock neither provider can install: refused before any work, the escrow returned.
            refused = tenant.place_demand({"accelerator_kinds": ["cpu"], "device_count": 1, "duration_s": 3600},
                                          PRICE, job={"spec": spec, "results_to": str(tmp_path / "farm-a" / "out" / "x"),
                                                      "files": data, "env_lock": read_env_lock(tmp_path / "bad-lock")})
            until(lambda: tenant.lease(refused["lease_id"])["state"] == "rejected", 120)
            why = reason(market, refused["lease_id"], "rejected")
            assert "cannot be satisfied" in why and "2.7" in why, why
            lease = tenant.lease(refused["lease_id"])
            assert lease["refunded"] == lease["escrow_amount"]
            assert ops.audit()["ok"]
        except BaseException:
            for plane in planes:
                print(plane.log())
            raise
        finally:
            for plane in planes:
                plane.stop()
    market.store.dispose()
