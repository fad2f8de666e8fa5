"""A model's life through the market, end to end over real HTTP with a real control plane: a tenant
trains a tiny model through a block lease (its job runs in the provider's sandbox and the results,
export included, are delivered), then deploys that export through a standing lease: the provider's
agent fetches it, serves it with `runyard serve` inside the lease's sandbox (no network but the
relay's socket), starts the lease once it answers, and publishes an endpoint that admits only the
tenant's token. The tenant's OpenAI client completes through it; the serving process is killed once
(availability dips, the control plane restarts it, the endpoint answers again); the tenant gives
notice, the period closes and settles, and the charge and the credit are exactly what the signed
availability records give, the rest of the escrow returned, the audit holding. Beside it, a
deployment whose export does not load ends its lease with the server's own words and its whole
escrow back."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import sysconfig
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from runyard.market.server import ServerThread
from runyard.market.service import Market, Settings
from runyard.market.serving import deployment_body
from runyard.market.standing import period_figures
from runyard.market.verifiers import OperatorVerifier
from tests.control.helpers import require_sandbox

from .conftest import TINY_SPEC, merge
from .leases import ControlPlane, FileServer, parties, reason, serve_processes, until

pytestmark = pytest.mark.slow
PRICE = 36_000  # per device-hour: 10 minor units per device-second
PERIOD = 600
CREDITS = [{"below_bps": 9950, "credit_bps": 1000}, {"below_bps": 9000, "credit_bps": 2500}]
WINDOW = 30  # the dispute window


def _serving_pids(export_dir: Path) -> list[int]:
    """The `runyard serve` processes serving `export_dir`."""
    return [pid for pid, export in serve_processes() if export == str(export_dir)]


@pytest.fixture
def short_dir():
    """A state directory with a short path: a deployment's unix socket lives under it, and a socket path
    may not pass 100 characters (pytest-xdist's per-worker tmp_path, popen-gwN/..., is too long)."""
    path = Path(tempfile.mkdtemp(prefix="ry-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_train_through_a_block_lease_then_serve_through_a_standing_lease(tmp_path, short_dir):
    require_sandbox()
    market = Market.open(str(tmp_path / "market.db"), Settings(test_clock=True, dispute_window_s=WINDOW, fee_bps=250),
                         verifier=OperatorVerifier())
    plane = None
    served = tmp_path / "served"
    served.mkdir()
    files = FileServer(served)
    with ServerThread(market) as server:
        ops, made = parties(market, server.url)
        farm, lab = made["farm"], made["lab"]
        farm.save_identity(tmp_path / "farm.json")
        now = ops.market_info()["now"]
        farm.create_listing(accelerator_kind="cpu", devices_per_node=1, node_count=1, region="eu-west",
                            jurisdiction="eu", price_per_device_hour=PRICE, available_until=now + 86400)
        farm.create_listing(accelerator_kind="cpu", devices_per_node=1, node_count=2, region="eu-west",
                            jurisdiction="eu", price_per_device_hour=PRICE, available_until=now + 86400,
                            form="standing", standing={"period_s": PERIOD, "availability_bps": 9950,
                                                       "credits": CREDITS, "notice_s": 0})
        ops.credit("lab", 2_000_000, "test funds")
        deliveries = tmp_path / "deliveries"
        plane = ControlPlane(short_dir / "control", server.url, tmp_path / "farm.json", "--cpu-slots", "2",
                             "--usage-interval", "1", "--probe-interval", "0.5", "--deliveries-root",
                             str(deliveries), "--allow-data-network", "127.0.0.0/8")
        try:
            # 1. Train through a block lease: the results, export included, are delivered.
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            data = {f"data/{p.name}": base64.b64encode(p.read_bytes()).decode()
                    for p in sorted((stdlib / "json").glob("*.py"))}
            spec = yaml.safe_dump(merge(TINY_SPEC, {"train": {"steps": 8}, "data": {"sources": [{"path": "data/*.py"}]}}))
            results = deliveries / "tiny"
            lab.place_demand({"accelerator_kinds": ["cpu"], "device_count": 1, "duration_s": 3600}, PRICE,
                             job={"spec": spec, "results_to": str(results), "files": data})
            until(lambda: (results / "export" / "model.safetensors").exists(), 300)
            export = results / "export"

            # 2. Deploy it through a standing lease: the export travels by URL; the token stays with the tenant.
            (served / "export").symlink_to(export)
            urls = {p.name: f"{files.url}/export/{p.name}" for p in sorted(export.iterdir()) if p.is_file()}
            body, token = deployment_body(urls=urls, serve={"kv_cache_mb": 16, "model_name": "tiny-served"})
            standing = lab.place_demand({"accelerator_kinds": ["cpu"], "device_count": 1}, PRICE, form="standing",
                                        standing={"period_s": PERIOD}, deployment=body)
            lease_id = standing["lease_id"]
            # ... and one whose export does not load (its config is not an export's).
            broken, _ = deployment_body(files={"config.json": base64.b64encode(b"{}").decode()})
            refused = lab.place_demand({"accelerator_kinds": ["cpu"], "device_count": 1}, PRICE, form="standing",
                                       standing={"period_s": PERIOD}, deployment=broken)

            lease = until(lambda: (lambda x: x if x["state"] == "running" and x["endpoint_url"] else None)(
                lab.lease(lease_id)), 300)
            assert lease["started_at"] is not None and lease["deployment_sha256"].startswith("sha256:")
            endpoint = lease["endpoint_url"]
            assert httpx.get(f"{endpoint}/v1/models").status_code == 401  # only the tenant's token
            assert httpx.get(f"{endpoint}/v1/models", headers={"Authorization": "Bearer guess"}).status_code == 401
            client = openai.OpenAI(base_url=f"{endpoint}/v1", api_key=token, max_retries=0)
            assert [m.id for m in client.models.list().data] == ["tiny-served"]
            done = client.completions.create(model="tiny-served", prompt="def ", max_tokens=6, seed=1)
            assert done.choices[0].text and done.usage.completion_tokens > 0
            chunks = list(client.completions.create(model="tiny-served", prompt="import ", max_tokens=4, stream=True))
            assert chunks and any(c.choices and c.choices[0].text for c in chunks)

            # The broken deployment never served: its lease ended with the server's words.
            until(lambda: lab.lease(refused["lease_id"])["state"] in ("terminated", "settled"), 240)
            why = reason(market, refused["lease_id"], "terminated")
            assert "the deployment did not start" in why and "runyard:" in why, why

            # 3. Kill the serving process once: the dip shows, the control plane restarts it.
            control = plane.client()
            (job,) = control.jobs(lease=str(lease_id))
            assert job["argv"][1:3] == ["-m", "runyard.control.sandbox"]  # served inside the sandbox
            folder = short_dir / "control" / "agent" / f"lease-{lease_id}"
            (pid,) = until(lambda: _serving_pids(folder / "export"))
            before = max((r["seq"] for r in lab.usage(lease_id)["records"]), default=0)
            os.kill(pid, signal.SIGKILL)
            until(lambda: control.job(job["id"])["job"]["restart_count"] >= 1, 120)
            dip = until(lambda: next((r["seq"] for r in lab.usage(lease_id)["records"]
                                      if r["seq"] > before and r["probes_ok"] < r["probes"]), None), 120)
            until(lambda: _answers(client), 240)
            # ... and the agent's probes see it healthy again (a record after the dip with every probe answered).
            until(lambda: any(r["seq"] > dip and 0 < r["probes_ok"] == r["probes"]
                              for r in lab.usage(lease_id)["records"]), 120)
            assert _serving_pids(folder / "export") not in ([], [pid])

            # 4. Notice, the period's close, settlement: charge and credit are what the records give.
            lab.give_notice(lease_id, "done with the demo")
            ops.advance_clock(lease["window_end"] - ops.market_info()["now"])
            ops.sweep()
            until(lambda: lab.lease(lease_id)["state"] == "window_closed")
            until(lambda: control.job(job["id"])["job"]["state"] == "cancelled", 120)  # the agent stopped the server
            until(lambda: (lambda r: r and r[-1]["interval_end"] == lease["window_end"])(lab.usage(lease_id)["records"]))
            ops.advance_clock(WINDOW + 1)
            ops.sweep()
            settled = lab.lease(lease_id)
            assert settled["state"] == "settled"
            records = lab.usage(lease_id)["records"]
            assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
            assert sum(r["interval_end"] - r["interval_start"] for r in records) == PERIOD  # the whole period, once
            assert sum(r["requests"] for r in records) >= 3  # the evidence: the tenant's requests were counted
            available = sum(r["device_seconds"] for r in records)
            want = period_figures(lease["period_price"], 1, PERIOD, PERIOD, available, 9950, CREDITS, 250)
            (period,) = lab.lease_periods(lease_id)
            print(f"period: {len(records)} records, availability {want.availability_bps} bps, price "
                  f"{lease['period_price']}, charge {want.charge}, credit {want.credit}, fee {want.fee}, "
                  f"provider {want.provider}, refund {want.refund}")
            for r in records:  # what the numbers come from: (seconds, available, probes, healthy, requests)
                print("record", r["seq"], r["interval_end"] - r["interval_start"], r["device_seconds"], r["probes"],
                      r["probes_ok"], r["requests"])
            assert want.availability_bps < 10_000  # the kill shows in the records
            assert (period["charge"], period["credit"], period["paid_provider"], period["paid_fee"], period["refunded"]) \
                == (want.charge, want.credit, want.provider, want.fee, want.refund)
            assert (settled["paid_provider"], settled["paid_fee"], settled["credited"], settled["refunded"]) == \
                (want.provider, want.fee, want.credit, want.refund)
            if want.availability_bps < 9950:
                assert want.credit > 0
            broken_lease = lab.lease(refused["lease_id"])
            assert broken_lease["refunded"] == broken_lease["escrow_amount"] and broken_lease["paid_provider"] == 0
            assert lab.statement()["totals"]["reconciles"]
            audit = ops.audit()
            assert audit["ok"], audit["violations"]
        except BaseException:
            print(plane.log())
            raise
        finally:
            plane.stop()
            files.close()
    market.store.dispose()


def _answers(client: openai.OpenAI) -> bool:
    try:
        return bool(client.completions.create(model="tiny-served", prompt="x", max_tokens=2).choices)
    except openai.OpenAIError:
        return False



