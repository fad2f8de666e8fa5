"""A roll-out with real servers (`serve_relay` + `runyard serve` of tiny random models) behind a real
endpoint: a client sending requests all through the switch sees no failure and then the new export's
answers; a new export that does not load is never switched to and the old one keeps serving."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from runyard.control.deployment import serve_command
from runyard.control.endpoint import Endpoint
from runyard.control.lease_job import LeaseFolder
from runyard.control.rollout import (
    RelayServer,
    RollOut,
    export_digest,
    history,
    record,
    roll_back_target,
    roll_out,
)
from runyard.market.serving import token_digest
from runyard.model.hf.export import export_model
from runyard.system.http_thread import free_port
from tests.model.small_model import make_model, tokenizer, tokenizer_path  # noqa: F401 (fixtures)

TOKEN = "rye_the-tenants-own-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture()
def exports(tmp_path, tokenizer, tokenizer_path, make_model):  # noqa: F811
    """Two tiny exports of different random models."""
    return [export_model(make_model(tokenizer, seed=seed), make_model(tokenizer, seed=seed).cfg, tokenizer_path,
                         tmp_path / f"run{seed}" / "export", extra_config={"run_name": f"tiny{seed}"})
            for seed in (0, 1)]


@pytest.fixture()
def servers(tmp_path):
    """start(export) -> a RelayServer serving it under the export's digest as its model name."""
    folder = LeaseFolder(tmp_path / "lease-1")
    folder.create()
    made: list[RelayServer] = []

    def start(export: Path) -> RelayServer:
        n = len(made)
        socket = folder.work / f"s{n}.sock"
        argv = serve_command(folder, {"serve": {"model_name": export_digest(export), "kv_cache_mb": 8}}, gpu=False,
                             port=free_port(), export=export, socket=socket)
        made.append(RelayServer(argv, socket, folder.work / f"serve-{n}.log"))
        return made[-1]

    yield start
    for server in made:
        server.stop()


def _complete(client: httpx.Client, url: str) -> httpx.Response:
    return client.post(f"{url}/v1/completions", json={"prompt": "def add", "max_tokens": 4, "temperature": 0},
                       headers=AUTH, timeout=60)


class Traffic:
    """A client thread sending completions one after another, counting failures and which model answered."""

    def __init__(self, url: str):
        self.url, self.failures, self.models = url, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                try:
                    answer = _complete(client, self.url)
                    if answer.status_code != 200:
                        self.failures.append(f"{answer.status_code}: {answer.text[:200]}")
                    else:
                        self.models.append(answer.json()["model"])
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def _serving(endpoint: Endpoint, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not endpoint.probe_once():
        assert time.monotonic() < deadline, "the first server never answered healthy"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_roll_out_under_traffic_fails_no_request_and_serves_the_new_export(exports, servers, tmp_path):
    old_export, new_export = exports
    old = servers(old_export)
    endpoint = Endpoint(old.socket, token_digest(TOKEN), probe_interval_s=0.2).start()
    try:
        _serving(endpoint)
        with Traffic(endpoint.url) as traffic:
            while len(traffic.models) < 3:
                time.sleep(0.05)
            result, now = roll_out(endpoint, new_export, lambda: servers(new_export), old,
                                   health_timeout_s=120, drain_timeout_s=30)
            after = len(traffic.models)
            while len(traffic.models) < after + 3:
                assert not traffic.failures, traffic.failures
                time.sleep(0.05)
        assert result.ok and result.drained and result.left_in_flight == 0, result
        assert now is not old and not old.running() and now.running()
        assert traffic.failures == []
        old_digest, new_digest = export_digest(old_export), export_digest(new_export)
        assert old_digest != new_digest and result.digest == new_digest
        assert traffic.models[0] == old_digest and traffic.models[-1] == new_digest
        # once the new one answers, the old one never does again: one switch, no flapping
        first_new = traffic.models.index(new_digest)
        assert set(traffic.models[first_new:]) == {new_digest}
        with httpx.Client() as client:
            assert _complete(client, endpoint.url).json()["model"] == new_digest
        assert endpoint.in_flight(old.socket) == 0
    finally:
        endpoint.stop()


@pytest.mark.slow
def test_a_roll_out_to_an_export_that_fails_to_load_keeps_the_old_one_serving(exports, servers, tmp_path):
    old_export, good = exports
    broken = tmp_path / "broken" / "export"
    broken.mkdir(parents=True)
    for path in good.iterdir():
        if path.is_file():
            (broken / path.name).write_bytes(path.read_bytes())
    weights = next(p for p in broken.iterdir() if p.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a truncated upload
    old = servers(old_export)
    endpoint = Endpoint(old.socket, token_digest(TOKEN), probe_interval_s=0.2).start()
    try:
        _serving(endpoint)
        with Traffic(endpoint.url) as traffic:
            result, now = roll_out(endpoint, broken, lambda: servers(broken), old, health_timeout_s=120)
            time.sleep(0.5)
        assert not result.ok and now is old and old.running()
        assert "exited before it served" in result.detail, result.detail
        assert endpoint.socket_path == old.socket
        assert traffic.failures == [] and set(traffic.models) == {export_digest(old_export)}
        log = tmp_path / "rollouts.jsonl"
        record(log, result)
        (entry,) = history(log)
        assert entry["ok"] is False and entry["export"] == str(broken) and entry["detail"] == result.detail
    finally:
        endpoint.stop()


def test_a_directory_that_is_no_export_is_refused_before_anything_starts(tmp_path, servers):
    started = []
    result, now = roll_out(Endpoint(tmp_path / "s.sock", token_digest(TOKEN)), tmp_path,
                           lambda: started.append(1), old=None)
    assert not result.ok and "is not a runyard export" in result.detail and now is None and not started


def test_a_roll_back_returns_to_the_export_served_before(tmp_path):
    log = tmp_path / "rollouts.jsonl"
    with pytest.raises(ValueError, match="nothing to roll back to"):
        roll_back_target("/e/first", history(log))
    record(log, RollOut(True, "/e/second", "sha256:2", "switched"))
    record(log, RollOut(False, "/e/broken", "sha256:3", "the new server exited before it served"))
    assert roll_back_target("/e/first", history(log)) == "/e/first"  # a refused roll-out changed nothing
    record(log, RollOut(True, "/e/first", "sha256:1", "switched"))  # rolled back
    assert roll_back_target("/e/first", history(log)) == "/e/second"
    assert [e["ok"] for e in history(log)] == [True, False, True]
