"""Retraining through the market, over real HTTP on loopback: a model server (a tiny random export with the
drift reference of its code corpus) logging its traffic, a real market with a verified, funded tenant.
Traffic of the training kind places nothing; switching to prose makes one drift event and exactly one
funded demand, whose escrow is the demand's maximum cost and whose job carries the traffic, the served
export and the spec the provider will run; drift that goes on places nothing more; a second episode past
the maintenance budget places nothing and says why, and the spending survives a restart; the demand,
finding no capacity by its deadline, expires and its escrow returns. A market down at drift time is tried
again with backoff, every attempt on the event, and the demand is placed once it is back. A retraining
spec the provider would reject, and flags that do not go together, stop the server at start (exit 2)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from runyard.cli import main
from runyard.market.jobs import decode_files
from runyard.market.pricing import cost
from runyard.market.server import ServerThread
from runyard.market.service import Market, Settings
from runyard.market.verifiers import OperatorVerifier
from runyard.serve.errors import ServeConfigError
from runyard.serve.retrain_budget import BUDGET_FILE, MaintenanceBudget
from runyard.serve.retrain_job import TRAFFIC_FILE, env_lock_of, init_export_for, newest_records
from runyard.serve.server import ServeOptions, build_app
from runyard.system.http_thread import AppThread, free_port

from ..e2e.leases import parties, until
from ..e2e.tiny_export import CONTEXT, code_texts, make_tiny_export

NOTES = Path(__file__).parents[2] / "examples" / "data" / "notes.jsonl"
PRICE = 3_600  # the most a retraining pays per device-hour
DURATION = 600  # the spec's requirement: one cpu for ten minutes
ESCROW = cost(PRICE, 1, DURATION)  # 600: the most one retraining can cost


def excerpts(texts: list[str], n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        text = texts[int(rng.integers(len(texts)))]
        size = int(rng.integers(80, 300))
        start = int(rng.integers(0, max(1, len(text) - size)))
        out.append(text[start : start + size])
    return out


def prose(n: int, seed: int) -> list[str]:
    texts = [r["text"] for r in map(json.loads, NOTES.read_text().splitlines()) if len(r.get("text") or "") > 300]
    return excerpts(texts, n, seed)


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return make_tiny_export(tmp_path_factory.mktemp("served") / "run")


def retrain_spec(folder: Path, **patch) -> Path:
    """The spec the served model is retrained with: its corpus (a local file, uploaded with the demand),
    a few steps, and the requirement the demand states."""
    (folder / "corpus").mkdir(parents=True, exist_ok=True)
    (folder / "corpus" / "json.txt").write_text("".join(code_texts()))
    spec = {
        "name": "served", "seed": 7,
        "data": {"sources": [{"path": str(folder / "corpus" / "*.txt")}], "heldout_fraction": 0.1,
                 "shard_tokens": 16384, "workers": 1},
        "model": {"context_length": CONTEXT},
        "train": {"steps": 4, "batch_size": 4}, "schedule": {"warmup_steps": 1},
        "stages": [{"name": "main"}],
        "eval": {"interval": 2, "batches": 1, "final_batches": 1, "must_beat_unigram": False,
                 "min_response_loss_drop": None, "min_reward_accuracy": None, "min_reward_margin": None,
                 "min_task_score": 0.0},
        "resources": {"device": "cpu", "threads": 1,
                      "requirement": {"accelerator_kinds": ["cpu"], "device_count": 1, "duration_s": DURATION}},
        **patch,
    }
    path = folder / "retrain.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


class World:
    """A market on loopback (a fixed port, so it can be stopped and started again) and a funded tenant."""

    def __init__(self, tmp_path: Path):
        self.market = Market.open(str(tmp_path / "market.db"), Settings(test_clock=True),
                                  verifier=OperatorVerifier())
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.identity = tmp_path / "lab.json"
        with self.serving():
            self.ops, made = parties(self.market, self.url, providers=())
            self.lab = made["lab"]
            self.lab.save_identity(self.identity)
            self.ops.credit("lab", 10 * ESCROW, "maintenance funds")

    def serving(self) -> ServerThread:
        return ServerThread(self.market, port=self.port)

    def held(self) -> int:
        """What the tenant's demands hold in escrow."""
        return sum(d["escrow_amount"] for d in self.lab.demands() if d["state"] == "open")


@pytest.fixture
def world(tmp_path):
    made = World(tmp_path)
    yield made
    made.market.store.dispose()


def serve(export: Path, tmp_path: Path, world: World, **options) -> tuple[AppThread, list]:
    settings = dict(log_requests=tmp_path / "traffic", retrain_spec=retrain_spec(tmp_path), retrain_via="market",
                    market_url=world.url, identity=world.identity, budget=ESCROW * 3 // 2, max_price=PRICE,
                    drift_sustain_requests=10, drift_warmup=20, retrain_min_logged=20,
                    retrain_results_to=str(tmp_path / "deliveries"))
    app, closers = build_app(export, ServeOptions(**{**settings, **options}))
    return AppThread(app, name="model-server"), closers


class Traffic:
    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, timeout=60)

    def send(self, prompts: list[str]) -> dict:
        for prompt in prompts:
            r = self.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                        "truncate_prompt_tokens": 48})
            assert r.status_code == 200, r.text
        return until(lambda: (lambda s: s if s["pending"] == 0 else None)(self.http.get("/v1/drift").json()), 60)

    def until_event(self, prompts: list[str], events: int) -> dict:
        """Send `prompts` five at a time until /v1/drift lists `events` events."""
        for i in range(0, len(prompts), 5):
            status = self.send(prompts[i : i + 5])
            if len(status["events"]) >= events:
                return status
        raise AssertionError(f"{len(prompts)} prompts made no event {events}: {status}")

    def outcome(self, index: int) -> dict:
        """The event's retraining outcome, once it has one."""
        return until(lambda: self.http.get("/v1/drift").json()["events"][index]["retrain"], 60)


def test_drift_places_one_funded_demand_and_the_budget_caps_the_next(export, tmp_path, world):
    code = excerpts(code_texts(), 400, seed=0)
    with world.serving():
        server, _ = serve(export, tmp_path, world)
        with server:
            traffic = Traffic(server.url)
            quiet = traffic.send(code[:40])
            assert quiet["events"] == [] and world.lab.demands() == []
            policy = quiet["retrain_policy"]
            assert policy["via"] == "market" and policy["escrow_per_retraining"] == ESCROW
            assert policy["budget"]["spent"] == 0 and policy["budget"]["budget"] == ESCROW * 3 // 2

            # A switch to prose: one event, one demand, funded with the most it can cost.
            status = traffic.until_event(prose(150, seed=1), 1)
            outcome = traffic.outcome(0)
            assert outcome["submitted"] is True, outcome
            [demand] = world.lab.demands()
            assert demand["id"] == outcome["demand_id"] and demand["state"] == "open"
            assert demand["escrow_amount"] == outcome["escrow"] == ESCROW == world.held()
            assert demand["max_price_per_device_hour"] == PRICE
            assert outcome["attempts"] == [{"at": outcome["attempts"][0]["at"], "demand_id": demand["id"]}]
            # Its job: the derived spec, the newest logged traffic, the served export to start from.
            job = world.lab.demand(demand["id"])["job"]
            spec = yaml.safe_load(job["spec"])
            assert spec["model"]["init"] == {"from": "export", "path": str(export.resolve())}
            assert spec["data"]["sources"][0]["path"] == "sources/0/*.txt"
            assert spec["data"]["sources"][-1]["path"] == "traffic/*.jsonl"
            assert spec["data"]["sources"][-1]["kind"] == "traffic"
            files = decode_files(job["files"])
            logged = [json.loads(line)["text"] for line in files[TRAFFIC_FILE].decode().splitlines()]
            assert len(logged) == outcome["records_carried"] == status["logged_requests"] >= 20
            uploaded = decode_files(job["init_export"]["export_files"])
            assert uploaded["model.safetensors"] == (export / "model.safetensors").read_bytes()
            assert "drift_sample.safetensors" not in uploaded  # not what a start from the export reads
            assert job["results_to"] == str(tmp_path / "deliveries" / spec["name"])
            assert Path(outcome["spec"]).read_text() == job["spec"]

            # Drift goes on: the same episode places nothing more.
            status = traffic.send(prose(30, seed=2))
            assert len(status["events"]) == 1 and len(world.lab.demands()) == 1

            # Drift clears, then a second episode: past the budget, nothing placed, the reason recorded.
            status = traffic.send(code[40:240])
            assert not status["drifting"], status["reason"]
            traffic.until_event(prose(150, seed=3), 2)
            refused = traffic.outcome(1)
            assert refused["submitted"] is False
            assert refused["reason"].startswith(f"not placed: the demand's escrow {ESCROW} would take")
            assert refused["budget"]["spent"] == ESCROW and refused["budget"]["left"] == ESCROW // 2
            assert len(world.lab.demands()) == 1 and world.held() == ESCROW

        # The spending survives a restart: a new server over the same log sees the period's charge.
        restarted, closers = serve(export, tmp_path, world)
        with restarted:
            assert httpx.get(f"{restarted.url}/v1/drift").json()["retrain_policy"]["budget"]["spent"] == ESCROW
        record = json.loads((tmp_path / BUDGET_FILE).read_text())
        assert [(c["amount"], c["state"], c["demand_id"]) for c in record["charges"]] == [(ESCROW, "placed", demand["id"])]

        # No provider has capacity: past its deadline the demand expires and its escrow returns.
        def available() -> int:
            return world.lab.balances()["accounts"][0]["available"]

        assert available() == 10 * ESCROW - ESCROW
        world.ops.advance_clock(3600 + 1)
        world.ops.sweep()
        assert world.lab.demand(demand["id"])["state"] == "expired"
        assert world.held() == 0 and available() == 10 * ESCROW
        audit = world.ops.audit()
        assert audit["ok"], audit["violations"]


def test_a_market_down_at_drift_time_is_retried_and_the_demand_placed_once_back(export, tmp_path, world):
    server, _ = serve(export, tmp_path, world)  # the market is not serving: nothing is asked of it at start
    with server:
        traffic = Traffic(server.url)
        traffic.send(excerpts(code_texts(), 40, seed=0))
        traffic.until_event(prose(150, seed=1), 1)
        outcome = until(lambda: (lambda o: o if o and len(o.get("attempts", [])) >= 2 else None)(
            traffic.http.get("/v1/drift").json()["events"][0]["retrain"]), 60)
        assert outcome["submitted"] is False and outcome["placing"] is True
        assert all("unreachable" in a["error"] for a in outcome["attempts"]), outcome["attempts"]
        assert outcome["escrow"] == ESCROW and "next_attempt_at" in outcome
        with world.serving():  # the market is back: the same demand is placed, once
            placed = until(lambda: (lambda o: o if o.get("submitted") else None)(
                traffic.http.get("/v1/drift").json()["events"][0]["retrain"]), 60)
            assert len(placed["attempts"]) >= 3 and placed["attempts"][-1] == {
                "at": placed["attempts"][-1]["at"], "demand_id": placed["demand_id"]}
            assert [d["id"] for d in world.lab.demands()] == [placed["demand_id"]]
            assert world.held() == ESCROW
    assert MaintenanceBudget(tmp_path / BUDGET_FILE, ESCROW, 30 * 86400).period(time.time()).spent == ESCROW


def run_cli(capsys, *args: str) -> tuple[int, str]:
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("patch", "flags", "message"),
    [
        ({"data": {"sources": [{"path": "{stdlib}/json/*.py"}]}}, [],
         "data.sources[0].path '{stdlib}/json/*.py' reaches outside"),
        ({"data": {"sources": [{"path": "/nowhere/*.txt"}]}}, [], "data.sources[0].path '/nowhere/*.txt' matches no file"),
        ({"data": {"cache_dir": "/srv/cache"}}, [], "data.cache_dir must be unset"),
        ({"train": {"steps": -1}}, [], "train.steps"),
        ({}, ["--retrain-via", "market"], "--retrain-via market needs --market, --identity, --budget"),
        ({}, ["--budget", "100"], "--budget belong(s) to --retrain-via market"),
        ({}, ["--retrain-deadline-s", "60"], "--retrain-deadline-s belong(s) to --retrain-via market"),
        ({}, ["--retrain-via", "market", "--market", "http://127.0.0.1:9", "--identity", "ID", "--budget", "100",
              "--control", "http://127.0.0.1:9"], "--control is where --retrain-via control submits"),
        ({}, ["--retrain-via", "market", "--market", "http://127.0.0.1:9", "--identity", "ID", "--budget", "100",
              "--max-price", "3600"], "is more than the whole --budget 100"),
    ],
)
def test_a_retraining_the_provider_would_reject_is_refused_at_start(capsys, export, tmp_path, world, patch, flags,
                                                                     message):
    spec = retrain_spec(tmp_path)
    raw = yaml.safe_load(spec.read_text())
    for key, value in patch.items():
        raw[key] = {**raw.get(key, {}), **value}
    spec.write_text(yaml.safe_dump(raw))
    flags = [str(world.identity) if f == "ID" else f for f in flags]
    market = [] if flags else ["--retrain-via", "market", "--market", world.url, "--identity", str(world.identity),
                               "--budget", str(ESCROW)]
    code, err = run_cli(capsys, "serve", str(export), "--log-requests", str(tmp_path / "traffic"),
                        "--retrain-spec", str(spec), *market, *flags)
    assert code == 2, err
    assert message in err, err


def test_the_newest_records_that_fit_travel(tmp_path):
    (tmp_path / "requests-1.jsonl").write_text("".join(json.dumps({"text": f"old {i}"}) + "\n" for i in range(5)))
    (tmp_path / "requests-2.jsonl").write_text("".join(json.dumps({"text": f"new {i}"}) + "\n" for i in range(5)))
    line = len(json.dumps({"text": "new 0"}) + "\n")
    data, n = newest_records(tmp_path, 7 * line)
    assert n == 7 and [json.loads(x)["text"] for x in data.decode().splitlines()] == \
        ["old 3", "old 4", "new 0", "new 1", "new 2", "new 3", "new 4"]
    assert newest_records(tmp_path, line - 1) == (b"", 0)


def test_an_export_too_large_to_upload_goes_by_url_and_the_runs_lock_travels(export, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(export, run / "export")
    provenance = json.loads((run / "export" / "runyard.json").read_text())
    (run / "export" / "drift_sample.safetensors").write_bytes(b"\0" * (300 << 10))  # as a trained export's
    provenance["files"]["drift_sample.safetensors"] = "0" * 64
    (run / "export" / "runyard.json").write_text(json.dumps(provenance))
    with pytest.raises(ServeConfigError, match=r"--retrain-export-url BASE"):
        init_export_for(run / "export")
    fetched = init_export_for(run / "export", "https://files.example/served/export/")
    assert fetched == {"export_urls": {name: f"https://files.example/served/export/{name}"
                                       for name in [*provenance["files"], "runyard.json"]}}
    assert env_lock_of(run / "export") is None
    (run / "env").mkdir()
    (run / "env" / "requirements.txt").write_text("torch==2.5.1\n")
    (run / "env" / "environment.json").write_text('{"python": "3.12"}')
    assert env_lock_of(run / "export") == {"requirements": "torch==2.5.1\n", "environment": '{"python": "3.12"}'}
