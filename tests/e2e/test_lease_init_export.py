"""A block lease whose job continues a tenant's model, end to end over real HTTP with a real control plane:
the demand carries the export the job starts from (weights uploaded with it, the tokenizer fetched by the
provider from the tenant's URL), the agent lays it out in the lease's folder and points the spec's
`model.init.path` (a path on the tenant's machine) at that copy, the job runs in the sandbox, and the
delivered run's manifest records that it started from exactly the tenant's files. Beside it, a demand whose
spec names an export it does not carry is rejected with the field named and its escrow returned."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from runyard.market.jobs import init_export_body
from runyard.market.server import ServerThread
from runyard.market.service import Market, Settings
from runyard.market.verifiers import OperatorVerifier
from tests.control.helpers import require_sandbox

from .leases import ControlPlane, FileServer, parties, reason, until
from .tiny_export import CONTEXT, code_texts, make_tiny_export

pytestmark = pytest.mark.slow
PRICE = 36_000  # per device-hour: 10 minor units per device-second


def continue_spec(export_path: str) -> str:
    """A few steps that continue the export on the job's files: its corpus and some logged traffic."""
    return yaml.safe_dump({
        "name": "again", "seed": 7,
        "data": {"sources": [{"path": "corpus/*.txt"},
                             {"path": "traffic/*.jsonl", "format": "jsonl", "text_field": "text", "kind": "traffic"}],
                 "heldout_fraction": 0.1, "shard_tokens": 16384, "workers": 1},
        "model": {"init": {"from": "export", "path": export_path}, "context_length": CONTEXT},
        "train": {"steps": 4, "batch_size": 4}, "schedule": {"warmup_steps": 1},
        "stages": [{"name": "main", "gates": {"min_loss_drop": None}}],
        "eval": {"interval": 2, "batches": 1, "final_batches": 1, "prompts": ["def "], "sample_tokens": 4,
                 "must_beat_unigram": False, "min_response_loss_drop": None, "min_reward_accuracy": None,
                 "min_reward_margin": None, "min_task_score": 0.0},
        "checkpoint": {"interval": 2, "keep_last": 1},
        "resources": {"device": "cpu", "threads": 1},
    })


def test_a_lease_job_starts_from_the_export_its_demand_carries(tmp_path, short_dir):
    require_sandbox()
    export = make_tiny_export(tmp_path / "tenant" / "run")
    served = tmp_path / "served"
    served.mkdir()
    (served / "tokenizer.json").write_bytes((export / "tokenizer.json").read_bytes())
    files_server = FileServer(served)
    listed = [*json.loads((export / "runyard.json").read_text())["files"], "runyard.json"]
    market = Market.open(str(tmp_path / "market.db"), Settings(test_clock=True, dispute_window_s=30),
                         verifier=OperatorVerifier())
    with ServerThread(market) as server:
        ops, made = parties(market, server.url)
        farm, lab = made["farm"], made["lab"]
        farm.save_identity(tmp_path / "farm.json")
        farm.create_listing(accelerator_kind="cpu", devices_per_node=2, node_count=1, region="eu-west",
                            jurisdiction="eu", price_per_device_hour=PRICE,
                            available_until=ops.market_info()["now"] + 86400)
        ops.credit("lab", 2 * PRICE, "test funds")
        deliveries = short_dir / "deliveries"
        plane = ControlPlane(short_dir / "control", server.url, tmp_path / "farm.json", "--cpu-slots", "2",
                             "--usage-interval", "1", "--deliveries-root", str(deliveries),
                             "--allow-data-network", "127.0.0.0/8")
        try:
            traffic = "".join(json.dumps({"text": f"what is the weather like in town {i} this week"}) + "\n"
                              for i in range(60))
            data = {"corpus/json.txt": "".join(code_texts()).encode(), "traffic/requests.jsonl": traffic.encode()}
            uploaded = {name: (export / name).read_bytes() for name in listed if name != "tokenizer.json"}
            init = {"export_files": {k: base64.b64encode(v).decode() for k, v in uploaded.items()},
                    "export_urls": {"tokenizer.json": f"{files_server.url}/tokenizer.json"}}
            assert init_export_body(None, init["export_urls"]) == {"export_urls": init["export_urls"]}
            need = {"accelerator_kinds": ["cpu"], "device_count": 1, "duration_s": 3600}
            results = deliveries / "again"
            job = {"spec": continue_spec(str(export)), "results_to": str(results), "init_export": init,
                   "files": {k: base64.b64encode(v).decode() for k, v in data.items()}}
            demand = lab.place_demand(need, PRICE, job=job)
            # The same spec without the export it names: rejected before any work, the field named.
            bare = lab.place_demand(need, PRICE, job={k: v for k, v in job.items() if k != "init_export"})

            until(lambda: lab.lease(bare["lease_id"])["state"] == "rejected", 120)
            why = reason(market, bare["lease_id"], "rejected")
            assert "model.init.path" in why and "does not carry" in why, why
            manifest = until(lambda: (results / "manifest.json").is_file() and json.loads(
                (results / "manifest.json").read_text()), 300)
            started = manifest["init_weights"]["main"]
            assert started["from"] == "export"
            # Exactly the tenant's weights and tokenizer, one uploaded and one fetched by URL.
            assert started["sha256"]["model.safetensors"] == hashlib.sha256(uploaded["model.safetensors"]).hexdigest()
            assert started["sha256"]["tokenizer.json"] == hashlib.sha256(
                (export / "tokenizer.json").read_bytes()).hexdigest()
            assert (results / "export" / "model.safetensors").is_file()
            lease = lab.lease(demand["lease_id"])
            assert lease["job"]["init_export"] == init
            assert lab.lease(bare["lease_id"])["refunded"] == lab.lease(bare["lease_id"])["escrow_amount"]
        except BaseException:
            print(plane.log())
            raise
        finally:
            plane.stop()
            files_server.close()
    market.store.dispose()


@pytest.fixture
def short_dir():
    """A state directory with a short path (as tests/e2e/test_deployment.py's)."""
    path = Path(tempfile.mkdtemp(prefix="ry-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
