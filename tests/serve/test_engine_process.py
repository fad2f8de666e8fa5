"""The engine core in a process of its own (serve/engine_process.py, serve/engine_core.py): the same
completions as the engine in-process, through the real app; a killed core fails what was in flight and
the replica's health (never a hang) until a new core serves, or for good when it keeps dying; a bad export
is refused by name; the core dies with its server."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from runyard.model.hf.export import ExportError, export_model
from runyard.serve import engine_process
from runyard.serve.batch_engine import BatchEngine
from runyard.serve.engine_core import CoreOptions, read_frame, write_frame
from runyard.serve.engine_process import EngineProcess
from runyard.serve.errors import EngineUnavailable, InvalidRequest, QueueFull
from runyard.serve.openai_api import create_app
from runyard.serve.sampling import SamplingParams
from runyard.serve.sequence import SeqEvent
from runyard.system.http_thread import AppThread
from runyard.system.processes import is_zombie_or_gone
from tests.e2e.faults import children
from tests.serve.served import start_served

OPTIONS = CoreOptions(kv_cache_bytes=8 * 1024 * 1024, max_batch=8)


@pytest.fixture()
def export(tmp_path, tokenizer, tokenizer_path, make_model):
    # A long context: a sequence then runs for seconds, long enough to be killed or closed mid-generation.
    model = make_model(tokenizer, context_length=8192)
    return model, export_model(model, model.cfg, tokenizer_path, tmp_path / "run" / "export")


@pytest.fixture()
def core(export, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    engine = EngineProcess(export[1], OPTIONS, max_queue=4)
    yield engine
    engine.close()


def test_the_core_serves_what_the_engine_in_process_serves(export, core, tokenizer):
    model, _ = export
    prompts = [tokenizer.encode(p).ids for p in ("def add(", "import ", "class Thing", "for i in")]
    params = [SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=9, temperature=0.9, seed=7),
              SamplingParams(max_tokens=12, temperature=0, logprobs=2), SamplingParams(max_tokens=6, stop=("\n",))]
    expected = BatchEngine(model, tokenizer, kv_cache_bytes=OPTIONS.kv_cache_bytes, max_batch=8).generate(prompts, params)
    app = create_app(core, "tiny", max_body_bytes=64 * 1024)
    with AppThread(app, lifespan="off") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=60)
        texts = ["def add(", "import ", "class Thing", "for i in"]
        got = [client.completions.create(model="tiny", prompt=texts[0], max_tokens=12, temperature=0),
               client.completions.create(model="tiny", prompt=texts[1], max_tokens=9, temperature=0.9, seed=7),
               client.completions.create(model="tiny", prompt=texts[2], max_tokens=12, temperature=0, logprobs=2),
               client.completions.create(model="tiny", prompt=texts[3], max_tokens=6, stop=["\n"], seed=1)]
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=texts[0], max_tokens=12, temperature=0, stream=True))
        health = httpx.get(srv.url + "/healthz").json()
    for r, done in zip(got[:3], expected[:3], strict=True):
        assert r.choices[0].text == done.text and r.choices[0].finish_reason == done.finish_reason
        assert r.usage.completion_tokens == len(done.token_ids)
    assert got[2].choices[0].logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected[2].logprobs],
                                                                      abs=1e-5)
    assert "\n" not in got[3].choices[0].text
    assert streamed == expected[0].text
    assert health["status"] == "ok" and health["kv_slots"] == core.n_slots and health["running"] == 0


def test_a_frame_larger_than_the_pipe_buffer_arrives_whole():
    read_end, write_end = os.pipe()
    payload = ("events", [SeqEvent("s", 1, "x" * 1_000_000, None, None, 1, 1)], (None, 1.0))
    with os.fdopen(read_end, "rb") as source, os.fdopen(write_end, "wb") as out:
        writer = threading.Thread(target=lambda: (write_frame(out, payload), write_frame(out, ("close",))))
        writer.start()
        assert read_frame(source) == payload and read_frame(source) == ("close",)
        writer.join()
        out.close()
        assert read_frame(source) is None


def test_a_bad_prompt_and_a_full_queue_are_refused_here_before_the_core_sees_them(core):
    with pytest.raises(InvalidRequest, match=r"prompt token ids must be in \[0, "):
        core.submit("bad", [core.vocab_size], SamplingParams(), lambda event: None)
    with pytest.raises(InvalidRequest, match="the model's context is"):
        core.submit("long", [1] * core.context_length, SamplingParams(), lambda event: None)
    with pytest.raises(QueueFull, match="bound 4"):
        core.check_admission(5)
    core.check_admission(4)


def _kill_mid_generation(core: EngineProcess) -> list:
    """Start a long generation, SIGKILL the core while it runs; the sequence's events once it has ended."""
    events, ended = [], threading.Event()

    def sink(event):
        events.append(event)
        if event.finish_reason is not None:
            ended.set()

    core.submit("long", [1, 2, 3], SamplingParams(max_tokens=100_000, temperature=0), sink)
    deadline = time.monotonic() + 60
    while core.running_count() == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(core.proc.pid, signal.SIGKILL)
    assert ended.wait(30), "the sequence in flight never ended"
    return events


def test_a_killed_core_fails_what_was_in_flight_and_the_replica_is_unhealthy_until_a_new_core_serves(core):
    killed = core.proc.pid
    app = create_app(core, "tiny", max_body_bytes=64 * 1024)
    with AppThread(app, lifespan="off") as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        events = _kill_mid_generation(core)
        # Asked at once: a new core takes a second or more to import torch and load.
        health = http.get("/healthz")
        refused = http.post("/v1/completions", json={"model": "tiny", "prompt": "def", "max_tokens": 2})
        assert health.status_code == 503 and "signal 9" in health.json()["error"], health.text
        assert refused.status_code == 503 and "restarting" in refused.json()["error"]["message"]
        deadline = time.monotonic() + 60
        while http.get("/healthz").status_code != 200:
            assert time.monotonic() < deadline, "no new core"
            time.sleep(0.05)
        served = http.post("/v1/completions", json={"model": "tiny", "prompt": "def", "max_tokens": 3,
                                                    "temperature": 0})
    assert events[-1].finish_reason == "error" and events[-1].completion_tokens == len(events) - 1
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3
    assert core.proc.pid != killed and core.failure is None
    assert core.running_count() == 0 and core.queue_depth() == 0


def test_a_core_that_keeps_dying_is_left_dead_and_says_how_it_ended(core, monkeypatch):
    monkeypatch.setattr(engine_process, "MAX_RESTARTS", 0)
    events = _kill_mid_generation(core)
    assert events[-1].finish_reason == "error"
    assert core.failure == "the engine process exited (signal 9)"
    with pytest.raises(EngineUnavailable, match="signal 9"):
        core.submit("after", [1], SamplingParams(), lambda event: None)


def test_close_ends_the_sequences_in_flight_as_abort_and_the_core_exits(export, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    engine = EngineProcess(export[1], OPTIONS)
    finished = []
    engine.submit("s", [1, 2], SamplingParams(max_tokens=100_000, temperature=0),
                  lambda event: finished.append(event.finish_reason) if event.finish_reason else None)
    while engine.running_count() == 0:
        time.sleep(0.01)
    # A terminal's Ctrl-C or a supervisor's SIGTERM to the group reaches the core too: the server ends it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(engine.proc.pid, sig)
    time.sleep(0.2)
    assert engine.proc.poll() is None and engine.failure is None and not finished
    engine.close()
    assert finished == ["abort"]
    with pytest.raises(EngineUnavailable, match="shutting down"):  # never a sequence nobody will end
        engine.submit("late", [1], SamplingParams(), lambda event: None)
    assert engine.proc.returncode == 0 and engine.failure is None


def test_a_corrupt_export_is_refused_naming_the_file_and_leaves_no_process(export, monkeypatch):
    _, export_dir = export
    weights = next(export_dir.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-16])
    children_before = children(os.getpid())
    with pytest.raises(ExportError, match=weights.name):
        EngineProcess(export_dir, OPTIONS)
    assert children(os.getpid()) == children_before


def test_the_core_dies_with_a_killed_server(export):
    server, _ = start_served(export[1], "--kv-cache-mb", "8")
    try:
        cores = children(server.pid)
        assert len(cores) == 1
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        deadline = time.monotonic() + 10
        while not all(is_zombie_or_gone(pid) for pid in cores):
            assert time.monotonic() < deadline, "the engine core outlived its server"
            time.sleep(0.05)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
