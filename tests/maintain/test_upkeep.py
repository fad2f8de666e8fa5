"""The tenant's upkeep (`runyard maintain`) against a real served model and a real market on loopback:
code traffic raises nothing; prose makes one drift episode, for which the maintainer mirrors the logged
traffic (PII-scrubbed at the source, each segment checked against its sha256) and places exactly one
funded demand; the same episode seen again, or by a maintainer started again from its state, places
nothing more; a second episode while that retraining is under way is recorded and buys nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runyard.maintain.endpoint_client import EndpointClient
from runyard.maintain.upkeep import Maintainer, Policy
from runyard.serve.server import ServeOptions, build_app
from runyard.system.http_thread import AppThread

from ..e2e.tiny_export import code_texts, make_tiny_export
from ..serve.test_retrain_market import ESCROW, PRICE, Traffic, World, excerpts, prose, retrain_spec


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return make_tiny_export(tmp_path_factory.mktemp("served") / "run")


@pytest.fixture
def world(tmp_path):
    made = World(tmp_path)
    yield made
    made.market.store.dispose()


def test_one_episode_buys_one_retraining_and_a_restart_buys_no_second(export, tmp_path, world):
    # The provider's side: the served model logs its traffic and hands it back; it retrains nothing itself.
    app, closers = build_app(export, ServeOptions(kv_cache_bytes=8 << 20, log_requests=tmp_path / "served-log",
                                                  share_traffic=True, drift_sustain_requests=10, drift_warmup=20))
    policy = Policy(lease_id=1, retrain_spec=retrain_spec(tmp_path), budget=ESCROW * 3 // 2, max_price=PRICE,
                    min_logged=20)
    state = tmp_path / "upkeep"
    try:
        with world.serving(), AppThread(app, name="model-server") as server:
            endpoint = EndpointClient(server.url, "the-tenant-token")
            upkeep = Maintainer(policy, state, world.lab, endpoint, export)
            traffic = Traffic(server.url)
            traffic.send(excerpts(code_texts(), 40, seed=0))
            upkeep.step()
            assert upkeep.state["episodes"] == [] and world.lab.demands() == []

            traffic.until_event(prose(150, seed=1), 1)
            traffic.send(["my number is +44 20 7946 0958, call me"])
            upkeep.step()
            (episode,) = upkeep.state["episodes"]
            (retraining,) = upkeep.state["retrainings"]
            [demand] = world.lab.demands()
            assert episode["outcome"] == f"placed demand {demand['id']}" == f"placed demand {retraining['demand_id']}"
            assert demand["escrow_amount"] == ESCROW == retraining["escrow"]
            mirrored = sorted((state / "traffic").glob("*.jsonl"))
            assert mirrored and all(len(p.stem) == 20 for p in mirrored)
            logged = [json.loads(line)["text"] for p in mirrored for line in p.read_text().splitlines()]
            assert len(logged) >= 20 and not any("7946 0958" in text for text in logged)
            job = world.lab.demand(demand["id"])["job"]
            assert "traffic/requests.jsonl" in job["files"]

            upkeep.step()  # the same episode, seen again
            assert len(world.lab.demands()) == 1 and len(upkeep.state["episodes"]) == 1

            again = Maintainer(policy, state, world.lab, endpoint, export)  # killed and started again
            again.step()
            assert len(world.lab.demands()) == 1 and again.state["retrainings"][0]["state"] == "placed"

            # Drift clears; a second episode while the first retraining is under way buys nothing.
            traffic.send(excerpts(code_texts(), 200, seed=2))
            traffic.until_event(prose(150, seed=3), 2)
            again.step()
            assert len(again.state["episodes"]) == 2 and len(world.lab.demands()) == 1
            assert again.state["episodes"][1]["outcome"].startswith("a retraining is under way")
            endpoint.close()
    finally:
        for thing in closers:
            thing.close()
