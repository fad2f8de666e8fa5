"""End to end: train a model, serve it with request logging and retraining wired to a real control
plane; traffic of the training kind submits nothing, a switch to another kind of text records a drift
event and submits one retraining job, which runs on the logged traffic: the spec's prose filter
(`min_words: 50`) stays on its corpus, and the logged prompts, cleaned by the traffic filters, are used."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from runyard.control.client import ControlClient
from runyard.spec.job import load_spec
from runyard.system.http_thread import free_port
from runyard.system.processes import popen_dying_with_me

from ..e2e.conftest import TINY_SPEC, merge, runyard

pytestmark = pytest.mark.slow
NOTES = Path(__file__).parents[2] / "examples" / "data" / "notes.jsonl"


def excerpts(texts: list[str], n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        text = texts[int(rng.integers(len(texts)))]
        size = int(rng.integers(60, 300))
        start = int(rng.integers(0, max(1, len(text) - size)))
        out.append(text[start : start + size])
    return out


@pytest.fixture
def control(tmp_path):
    state = tmp_path / "control"
    with open(tmp_path / "daemon.log", "wb") as log:
        proc = popen_dying_with_me(
            [sys.executable, "-m", "runyard", "control", "start", "--foreground", "--state-dir", str(state),
             "--cpu-slots", "1"],
            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while not (state / "daemon.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
        time.sleep(0.05)
    yield str(state), ControlClient.for_state_dir(state)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


@pytest.fixture
def trained(tmp_path):
    spec = tmp_path / "spec.yaml"
    # The prose filter of a documentation corpus: no logged prompt has 50 words.
    spec.write_text(yaml.safe_dump(merge(TINY_SPEC, {"name": "served", "data": {"filters": {"min_words": 50}}})))
    run_dir = tmp_path / "run"
    runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", check=True, timeout=600)
    return spec, run_dir


def test_shifted_traffic_submits_one_retraining_job_that_runs(tmp_path, trained, control):
    spec, run_dir = trained
    control_url, client = control
    port = free_port()
    traffic = tmp_path / "traffic"
    with open(tmp_path / "serve.log", "wb") as log:
        server = popen_dying_with_me(
            [sys.executable, "-m", "runyard", "serve", str(run_dir), "--port", str(port), "--log-requests", str(traffic),
             "--retrain-spec", str(spec), "--control", control_url, "--drift-sustain", "10",
             "--retrain-min-logged", "30"],
            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if http.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never came up"
            time.sleep(0.1)

        def send(prompts: list[str]) -> dict:
            for prompt in prompts:
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                       "truncate_prompt_tokens": 48})
                assert r.status_code == 200, r.text
            deadline = time.monotonic() + 60
            while (status := http.get("/v1/drift").json())["pending"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            return status

        # Traffic of the training kind: the stdlib sources the model was trained on.
        sources = [Path(p).read_text() for p in sorted(glob.glob(f"{sysconfig.get_paths()['stdlib']}/email/*.py"))]
        quiet = send(excerpts(sources, 60, seed=0))
        assert quiet["requests_seen"] == 60 and quiet["events"] == [] and not quiet["drifting"], quiet
        assert client.jobs() == []

        # A switch to prose: an event within a few dozen requests, and one job.
        prose = [r["text"] for r in map(json.loads, NOTES.read_text().splitlines()) if len(r.get("text") or "") > 300]
        shifted = excerpts(prose, 100, seed=1)
        sent = 0
        while not (status := send(shifted[sent : sent + 5]))["events"]:
            sent += 5
            assert sent < len(shifted), f"100 prose requests made no drift event: {status}"
        event = status["events"][0]
        assert event["token_js"] > event["token_js_threshold"]
        deadline = time.monotonic() + 60
        while event["retrain"] is None:
            assert time.monotonic() < deadline, "the event never submitted its retraining job"
            time.sleep(0.1)
            event = http.get("/v1/drift").json()["events"][0]
        assert event["retrain"]["submitted"], event["retrain"]
        usable = event["retrain"]["traffic"]["records_usable"]
        assert usable >= 30 and status["retrain_policy"]["min_logged_records"] == 30
        [job_id] = event["retrain"]["jobs"]
        send(shifted[sent + 5 : sent + 30])  # drift goes on: no second job
        assert [j["id"] for j in client.jobs()] == [job_id]

        # The job's data includes the logged traffic, and it runs to the end.
        derived = load_spec(event["retrain"]["spec"])
        assert derived.data.sources[-1].path == str(traffic.resolve() / "*.jsonl")
        assert derived.data.sources[-1].format == "jsonl" and derived.data.sources[-1].kind == "traffic"
        assert derived.data.filters.min_words == 50  # the corpus keeps its prose filter
        final = client.wait(job_id, timeout_s=600, poll_s=1)
        assert final["state"] == "succeeded", client.logs(job_id)["text"][-3000:]
        base = json.loads((run_dir / "data" / "report.json").read_text())
        report = json.loads((Path(final["run_dir"]) / "data" / "report.json").read_text())
        # One sealed traffic segment beside the training files (the log is sealed when the job is submitted).
        assert report["input_files"] == base["input_files"] + 1
        # The logged prompts were used, not filtered out: counted as read, used and removed per reason.
        traffic_report = report["traffic"]
        assert traffic_report["records_read"] >= usable and 0 < traffic_report["records_used"] <= usable
        assert sum(traffic_report["removed"].values()) == traffic_report["records_read"] - traffic_report["records_used"]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    assert list(traffic.glob("*.jsonl")) and not list(traffic.glob("*.part"))  # sealed on shutdown
