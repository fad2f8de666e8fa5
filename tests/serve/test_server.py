"""The OpenAI-compatible API over real HTTP on loopback (uvicorn in a thread, httpx as the client)."""

from __future__ import annotations

import json

import httpx
import pytest

from runyard.http_thread import AppThread
from runyard.serve.engine import Generator
from runyard.serve.server import _StopScanner, create_app


@pytest.fixture()
def server(tokenizer, make_model):
    gen = Generator(make_model(tokenizer), tokenizer)
    with AppThread(create_app(gen, model_name="tiny"), lifespan="off") as srv, httpx.Client(
        base_url=srv.url, timeout=30
    ) as client:
        yield client, gen


def test_healthz(server):
    client, _ = server
    assert client.get("/healthz").json() == {"status": "ok", "model": "tiny"}


def test_completion_matches_the_generator(server):
    client, gen = server
    body = {"model": "tiny", "prompt": "def add(", "max_tokens": 12, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    expected = gen.generate("def add(", max_tokens=12, temperature=0)
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert out["choices"][0]["text"] == expected
    n_completion = len(gen.generate_ids(gen.encode("def add("), max_tokens=12, temperature=0))
    assert out["usage"] == {
        "prompt_tokens": len(gen.encode("def add(")),
        "completion_tokens": n_completion,
        "total_tokens": len(gen.encode("def add(")) + n_completion,
    }
    assert out["choices"][0]["finish_reason"] == ("length" if n_completion == 12 else "stop")


def test_streaming_sends_sse_chunks_that_add_up_to_the_completion(server):
    client, _ = server
    body = {"prompt": "import ", "max_tokens": 10, "temperature": 0.7, "seed": 5}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2  # pieces arrive separately, then a closing chunk with the reason
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stop_strings_cut_the_completion(server):
    client, gen = server
    full = gen.generate("class ", max_tokens=20, temperature=0, stop_at_eos=False)
    stop = full[3:5]
    r = client.post(
        "/v1/completions", json={"prompt": "class ", "max_tokens": 20, "temperature": 0, "stop": stop}
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop"


def test_bad_requests_get_openai_style_errors(server):
    client, _ = server
    r = client.post("/v1/completions", json={"prompt": "x", "temperature": 5})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "temperature"
    r = client.post("/v1/completions", json={"max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 404 and "tiny" in r.json()["error"]["message"]


def test_metrics_count_requests_and_latency(server):
    client, _ = server
    for _ in range(2):
        client.post("/v1/completions", json={"prompt": "def ", "max_tokens": 4, "temperature": 0})
    client.post("/v1/completions", json={"prompt": "x", "top_p": 0})
    metrics = client.get("/metrics").text
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    assert values["runyard_requests_total"] == "2"
    assert values["runyard_request_errors_total"] == "1"
    assert values["runyard_request_seconds_count"] == "2"
    assert float(values['runyard_request_seconds{quantile="0.5"}']) > 0
    assert float(values['runyard_time_to_first_token_seconds{quantile="0.99"}']) > 0


def test_stop_scanner_holds_back_a_possible_stop_prefix():
    s = _StopScanner(["END"])
    assert s.feed("abcE") == "abc"
    assert s.feed("N") == ""
    assert s.feed("Dx") == "" and s.stopped
    s = _StopScanner(["END"])
    assert s.feed("abE") == "ab" and s.feed("x") == "Ex" and s.flush() == ""
