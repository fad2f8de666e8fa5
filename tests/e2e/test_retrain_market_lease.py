"""A retraining demand as `MarketRetrainer` places it runs on a real provider: matched, accepted by the
agent (the job the provider's rules allow, as the server checked at start), run in the sandbox from the
served export it carries on the logged traffic it carries, and delivered; the run's manifest records that
it started from exactly the served weights, and its data report counts the carried traffic."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from runyard.market.server import ServerThread
from runyard.market.service import Market, Settings
from runyard.market.verifiers import OperatorVerifier
from runyard.serve.request_log import RequestLog
from runyard.serve.retrain_budget import MaintenanceBudget
from runyard.serve.retrain_market import MarketRetrainer
from tests.control.helpers import require_sandbox
from tests.serve.test_retrain_market import ESCROW, PRICE, prose, retrain_spec

from .leases import ControlPlane, parties, until
from .tiny_export import make_tiny_export

pytestmark = pytest.mark.slow


@pytest.fixture
def short_dir():
    """A state directory with a short path (as tests/e2e/test_deployment.py's)."""
    path = Path(tempfile.mkdtemp(prefix="ry-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_retraining_demand_runs_on_a_provider_from_the_served_export(tmp_path, short_dir):
    require_sandbox()
    export = make_tiny_export(tmp_path / "served" / "run")
    log = RequestLog(tmp_path / "traffic")
    for prompt in prose(40, seed=1):
        log.append(prompt)
    market = Market.open(str(tmp_path / "market.db"), Settings(test_clock=True, dispute_window_s=30),
                         verifier=OperatorVerifier())
    with ServerThread(market) as server:
        ops, made = parties(market, server.url)
        farm, lab = made["farm"], made["lab"]
        farm.save_identity(tmp_path / "farm.json")
        farm.create_listing(accelerator_kind="cpu", devices_per_node=1, node_count=1, region="eu-west",
                            jurisdiction="eu", price_per_device_hour=PRICE,
                            available_until=ops.market_info()["now"] + 86400)
        ops.credit("lab", 2 * ESCROW, "maintenance funds")
        deliveries = short_dir / "deliveries"
        plane = ControlPlane(short_dir / "control", server.url, tmp_path / "farm.json", "--cpu-slots", "1",
                             "--usage-interval", "1", "--deliveries-root", str(deliveries))
        try:
            retrainer = MarketRetrainer(retrain_spec(tmp_path), export, log, lab,
                                        MaintenanceBudget(tmp_path / "budget.json", ESCROW, 86400),
                                        max_price=PRICE, results_to=str(deliveries), min_logged=20)
            placed = retrainer.submit()
            assert placed["submitted"] and placed["escrow"] == ESCROW and placed["lease_id"] is not None
            results = deliveries / Path(placed["spec"]).stem
            manifest = until(lambda: (results / "manifest.json").is_file() and json.loads(
                (results / "manifest.json").read_text()), 300)
            started = manifest["init_weights"]["main"]
            assert started["from"] == "export"
            assert started["sha256"]["model.safetensors"] == hashlib.sha256(
                (export / "model.safetensors").read_bytes()).hexdigest()
            report = json.loads((results / "data" / "report.json").read_text())
            assert report["traffic"]["records_read"] == placed["records_carried"] == 40
            assert report["traffic"]["records_used"] > 0
            assert (results / "export" / "model.safetensors").is_file()
            lease = lab.lease(placed["lease_id"])  # it runs until its window ends; its escrow is the demand's
            assert lease["escrow_amount"] == ESCROW and lease["job"]["init_export"]["export_files"]
        except BaseException:
            print(plane.log())
            raise
        finally:
            plane.stop()
    market.store.dispose()
