"""The whole life in one loop, as a user runs it: examples/lifecycle/lifecycle.py (a market, a provider with
its control plane and agent, a tenant, all on loopback, SQLite) trains a model through a block lease,
serves it on a standing lease, switches its traffic from code to prose, and lets `runyard market
maintain` buy the retraining and roll it out. Checked against the market's own records: exactly one
retraining demand for the drift episode (and none for an episode while it was under way), its escrow
within the budget, no failed request across the roll-out, the new export's digest answering after
the switch and the old one never again, every lease settled, the ledger balanced to the minor unit,
and the model-costs report equal to the leases' settlements."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from sqlalchemy import select

from runyard.market.schema import accounts, leases
from runyard.market.service import Market
from runyard.market.verifiers import OperatorVerifier
from tests.control.helpers import require_sandbox

# Five minutes of three parties' processes on 2 cores: the full tier's (CI runs it). The fast tier keeps each
# part: the roll-out through the market (test_deployment_rollout.py), retraining through the market
# (tests/serve), the model costs (tests/market/test_model_costs.py).
pytestmark = [pytest.mark.slow, pytest.mark.full]
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "lifecycle" / "lifecycle.py"
BUDGET = 20_000


@pytest.fixture
def work():
    """A folder with a short path: a deployment's unix socket lives under it, and a socket path may not pass
    100 characters (pytest's tmp_path is too long)."""
    path = Path(tempfile.mkdtemp(prefix="ry-life-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_funded_model_is_trained_served_retrained_on_drift_and_rolled_out(work):
    require_sandbox()
    done = subprocess.run([sys.executable, str(SCRIPT), "--workdir", str(work)], capture_output=True, text=True,
                          timeout=1500)
    summary = json.loads((work / "summary.json").read_text())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert summary["loop_closed"] is True

    # One drift episode bought exactly one retraining, after the traffic turned to prose, within the budget.
    placed = [e for e in summary["episodes"] if e["outcome"].startswith("placed demand")]
    assert len(placed) == 1 and len(summary["retrainings"]) == 1
    assert all(e["outcome"].startswith(("placed demand", "a retraining is under way", "not placed"))
               for e in summary["episodes"])
    (retraining,) = summary["retrainings"]
    assert retraining["state"] == "rolled_out" and retraining["escrow"] <= BUDGET
    assert placed[0]["outcome"] == f"placed demand {retraining['demand_id']}"
    # ... and it came from the prose, not from the code the model was trained for.
    assert int(placed[0]["key"].rsplit("#", 1)[1]) > summary["prose_from_request"]

    # No request failed; the first export answered until the switch, the retrained one from then on.
    assert summary["failures"] == [] and summary["requests"] > 100
    runs = [digest for digest, _ in summary["exports_served"] if digest is not None]
    assert runs == [summary["first_digest"], summary["new_digest"]], summary["exports_served"]

    # The market's records: every lease settled, the audit holds, the costs are the settlements.
    market = Market.open(str(work / "market.db"), verifier=OperatorVerifier())
    try:
        rows = market.read(lambda conn, now: [dict(r) for r in conn.execute(
            select(leases).join(accounts, accounts.c.id == leases.c.tenant_id).where(accounts.c.name == "lab"))
            .mappings()])
    finally:
        market.store.dispose()
    assert len(rows) == 3 and {lease["state"] for lease in rows} == {"settled"}
    settled = sum(lease["paid_provider"] + lease["paid_fee"] for lease in rows)
    costs = summary["model_costs"]
    assert costs["charged"] == settled > 0
    (model,) = costs["models"]  # training, retraining and serving in one lineage
    assert model["model"] == "lifecycle" and len(model["training"]) == 2 and len(model["serving"]) == 1
    assert model["training_charged"] + model["serving_charged"] == model["charged"] == settled
    assert summary["statement_totals"]["reconciles"] is True and summary["audit_ok"] is True
