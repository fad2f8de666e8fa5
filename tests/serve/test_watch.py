"""Request logging (scrubbed, sealed segments the data stage reads), sustained-drift events, and the
retraining spec derived on an event."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter

import numpy as np
import yaml

from runyard.data.sources import iter_file_documents, list_source_files
from runyard.serve.drift import DriftMonitor, DriftReference
from runyard.serve.request_log import RequestLog
from runyard.serve.retrain import derive_spec, spec_supports_init
from runyard.serve.server import chat_framing
from runyard.serve.watch import TrafficWatch
from runyard.spec.data import SourceSpec
from runyard.spec.job import parse_spec
from runyard.system.processes import popen_dying_with_me

# Real-looking PII: the scrubber leaves documentation addresses (example.com, 555-01xx, private ranges) alone.
PII_PROMPT = "mail jane.doe@gmail.com or call +1 415-867-5309 from 81.2.69.160"


def documents(source: dict) -> list[str]:
    spec = SourceSpec(**{k: v for k, v in source.items()})
    counts: Counter = Counter()
    return [text for f in list_source_files(spec, 0) for _, text in iter_file_documents(spec, f, counts)]


def test_request_log_is_scrubbed_and_readable_by_the_data_stage(tmp_path):
    log = RequestLog(tmp_path / "traffic", segment_records=2)
    for text in [PII_PROMPT, "plain prompt", "third one"]:
        log.append(text)
    # Two records make a sealed segment; the third waits in an open .part the data stage ignores.
    assert documents(log.source()) == ["mail <EMAIL> or call <PHONE> from <IP>", "plain prompt"]
    assert log.scrubbed == Counter({"email": 1, "phone": 1, "ip_address": 1})
    assert log.sealed_records() == 2
    log.seal()
    assert documents(log.source())[-1] == "third one"
    assert not list((tmp_path / "traffic").glob("*.part"))


CHILD = """
import sys, time
from runyard.serve.request_log import RequestLog
log = RequestLog(sys.argv[1], segment_records=1000)
for i in range(3):
    log.append(f"prompt {i}")
log._file.write('{"text": "torn')
log._file.flush()
print("ready", flush=True)
time.sleep(60)
"""


def test_a_killed_servers_segment_is_recovered_without_its_torn_line(tmp_path):
    directory = tmp_path / "traffic"
    child = popen_dying_with_me([sys.executable, "-c", CHILD, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert documents({"path": str(directory / "*.jsonl"), "format": "jsonl"}) == []  # nothing sealed yet
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert len(list(directory.glob("*.part"))) == 1
    log = RequestLog(directory)  # a new server on the same directory
    assert documents(log.source()) == ["prompt 0", "prompt 1", "prompt 2"]
    assert not list(directory.glob("*.part"))


def drift_reference() -> DriftReference:
    rng = np.random.default_rng(0)
    probs = np.r_[np.full(50, 0.018), np.full(50, 0.002)]
    probs /= probs.sum()
    docs = [rng.choice(100, size=300, p=probs) for _ in range(40)]
    counts = np.bincount(np.concatenate(docs), minlength=100)
    return DriftReference.from_documents(counts, docs, seed=0)


def test_sustained_drift_records_one_event_and_rearms(tmp_path):
    rng = np.random.default_rng(1)
    reference = drift_reference()
    probs = reference.token_counts / reference.token_counts.sum()
    log = RequestLog(tmp_path / "traffic")
    watch = TrafficWatch(DriftMonitor(reference, scales=(20, 100)), log, check_every=5, sustain_requests=20)
    try:
        for _ in range(60):
            watch.observe("in distribution", rng.choice(100, size=30, p=probs).tolist())
        watch.flush()
        status = watch.status()
        assert status["requests_seen"] == 60 and not status["drifting"] and status["events"] == []
        shifted_seen = 0
        while not watch.status()["events"]:
            watch.observe("shifted", rng.integers(90, 100, size=30).tolist())  # the rare tail only
            watch.flush()
            shifted_seen += 1
            assert shifted_seen < 100, "sustained shifted traffic never made an event"
        event = watch.status()["events"][0]
        # Drift is judged every 5 requests and must hold for 20 of them.
        assert event["requests_seen"] - event["drift_since_request"] >= 20
        assert event["token_js"] > event["token_js_threshold"] and event["retrain"] is None
        # What drifted, named: the statistic, its window and rate, the tokens that moved it, example prompts.
        assert event["statistic"] == "token_js_bits" and event["window_requests"] in (20, 100)
        assert event["false_alarm_rate"] == 0.01 and event["null_draws"] >= 399
        assert {t["token_id"] for t in event["moved_tokens"][:3]} <= set(range(90, 100))
        assert event["divergent_prompts"][0]["text"] == "shifted"
        for _ in range(40):  # still drifting: no second event
            watch.observe("shifted", rng.integers(90, 100, size=30).tolist())
        watch.flush()
        assert len(watch.status()["events"]) == 1
        assert watch.status()["logged_requests"] == 60 + shifted_seen + 40
    finally:
        watch.close()
    assert len(documents(log.source())) == 60 + shifted_seen + 40


def test_watch_without_drift_still_logs(tmp_path):
    watch = TrafficWatch(None, RequestLog(tmp_path / "t"))
    watch.observe("hello", [1])
    watch.flush()
    watch.close()
    assert watch.status()["requests_seen"] == 1 and watch.status()["windows"] == []


def test_retraining_spec_adds_the_traffic_and_starts_from_the_export(tmp_path):
    base = {
        "name": "docs", "seed": 3,
        "data": {"sources": [{"path": "corpus/*.md"}, {"path": "{stdlib}/json/*.py"}, {"path": "/abs/x.txt"}]},
        "stages": [{"name": "main"}],
    }
    traffic = {"path": str(tmp_path / "traffic" / "*.jsonl"), "format": "jsonl", "text_field": "text"}
    derived = derive_spec(base, "docs-retrain-1", traffic, tmp_path / "export", tmp_path)
    assert derived["name"] == "docs-retrain-1" and base["name"] == "docs"  # the base is not changed
    assert [s["path"] for s in derived["data"]["sources"]] == [
        str(tmp_path / "corpus" / "*.md"), "{stdlib}/json/*.py", "/abs/x.txt", traffic["path"]]
    if spec_supports_init():
        assert derived["model"]["init"] == {"from": "export", "path": str((tmp_path / "export").resolve())}
    else:  # issue 11 is not in this runyard yet: the job trains as its spec says
        assert "init" not in derived.get("model", {})
    parse_spec(derived)  # a valid spec
    yaml.safe_dump(derived)


def test_status_is_json():
    watch = TrafficWatch(DriftMonitor(drift_reference(), scales=(20,), warmup=25), None)
    for _ in range(20):
        watch.observe("x", list(range(30)))
    watch.flush()
    status = watch.status()
    assert not status["judged"] and status["reason"] == "warming up: 20 of 25 requests seen" and status["windows"] == []
    for _ in range(5):
        watch.observe("x", list(range(30)))
    watch.flush()
    watch.close()
    status = json.loads(json.dumps(watch.status()))
    assert status["requests_seen"] == 25 and status["windows"][0]["requests"] == 20 and status["judged"]
    assert status["distinct_prompts"] == 1 and status["divergent_prompts"][0]["times_in_window"] == 20


def test_a_smoke_test_of_forty_short_repeated_prompts_raises_no_event():
    """The server's defaults (judged every 5 requests, a 50-request warm-up, 20 requests sustained): an
    OpenAI-client smoke test is never judged, however unlike training its one prompt is."""
    watch = TrafficWatch(DriftMonitor(drift_reference()), None, check_every=5, sustain_requests=20)
    try:
        for _ in range(40):
            watch.observe("Say hello.", [97, 98, 99])
        watch.flush()
        status = watch.status()
    finally:
        watch.close()
    assert status["requests_seen"] == 40 and status["events"] == [] and not status["drifting"]
    assert not status["judged"] and status["reason"] == "warming up: 40 of 50 requests seen"


def test_chat_framing_is_measured_from_the_template_and_recognised_in_prompts(tmp_path, tokenizer):
    """The tokens a chat template wraps around one user turn, measured at startup; a chat prompt then
    carries them as framing, which the null keeps verbatim instead of judging them as text."""
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}### user:\n{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}### reply:\n{% endif %}")
    encode = lambda text: tokenizer.encode(text).ids  # noqa: E731
    framing = chat_framing(tmp_path, encode)
    assert tokenizer.decode(framing[0]) == "### user:\n" and tokenizer.decode(framing[1]) == "\n### reply:\n"
    assert chat_framing(tmp_path / "none", encode) is None  # no template: prompts are judged unframed
    reference = drift_reference()
    vocab = len(reference.token_counts)
    framing = ([i % vocab for i in framing[0]], [i % vocab for i in framing[1]])
    monitor = DriftMonitor(reference, framing=framing, warmup=0)
    monitor.observe(framing[0] + [1, 2, 3] + framing[1])
    monitor.observe([1, 2, 3])
    framed, plain = monitor.window
    assert (framed.prefix, framed.suffix) == (len(framing[0]), len(framing[1])) and (plain.prefix, plain.suffix) == (0, 0)
