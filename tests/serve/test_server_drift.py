"""Drift monitoring through the real HTTP server: in-distribution prompts stay quiet, shifted ones alert."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from runyard.http_thread import AppThread
from runyard.serve.drift import DriftMonitor, DriftReference
from runyard.serve.engine import Generator
from runyard.serve.server import create_app

from .conftest import TEXTS


@pytest.fixture()
def drift_server(tokenizer, make_model):
    vocab = tokenizer.get_vocab_size()
    counts = np.zeros(vocab, dtype=np.int64)
    for text in TEXTS:
        np.add.at(counts, tokenizer.encode(text).ids, 1)
    monitor = DriftMonitor(DriftReference([int(c) for c in counts]), window=40, min_requests=10, baseline=10)
    app = create_app(Generator(make_model(tokenizer), tokenizer), model_name="tiny", drift=monitor)
    with AppThread(app, lifespan="off") as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client


def complete(client, prompt):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


def test_drift_alerts_only_after_inputs_shift(drift_server):
    client = drift_server
    assert client.get("/v1/drift").json()["token_js"] is None  # too few requests yet
    for i in range(40):
        complete(client, TEXTS[i % 3])
    quiet = client.get("/v1/drift").json()
    assert quiet["enabled"] and quiet["drifting"] is False and quiet["token_js"] < 0.2, quiet
    for i in range(40):
        complete(client, f"ZQXJ-{i * 7919} ¿¿ ΩΩΩ ### ~~~ 0x{i:08x}")
    shifted = client.get("/v1/drift").json()
    assert shifted["drifting"] is True and shifted["token_js"] > quiet["token_js"]
    assert "runyard_drift_alert 1" in client.get("/metrics").text
