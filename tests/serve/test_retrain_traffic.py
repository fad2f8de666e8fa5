"""Logged traffic in a retraining: its own data path (a `kind: traffic` source with request filters, not the
spec's prose rules), the data report's counts of logged records read, used and removed per reason, and the
policy that submits no retraining holding too few of them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from runyard.data.pipeline import prepare_data
from runyard.serve.drift import DriftMonitor
from runyard.serve.request_log import RequestLog
from runyard.serve.retrain import TOKEN_ENV, Retrainer
from runyard.serve.watch import TrafficWatch
from tests.data.data_fixtures import spec_for, write_corpus

from ..e2e.conftest import TINY_SPEC, merge
from .test_watch import PII_PROMPT, drift_reference

PROSE = {"min_words": 50}  # the prose filter of the issue: no prompt has 50 words


def logged(directory, prompts: list[str]) -> RequestLog:
    log = RequestLog(directory)
    for prompt in prompts:
        log.append(prompt)
    log.seal()
    return log


def prompts() -> list[str]:
    distinct = [f"how do I close the queue number {i} after the last worker exits" for i in range(20)]
    return [*distinct, *distinct[:5], "hi", PII_PROMPT + " about my account"]  # 5 repeats, one too short


def test_a_traffic_source_keeps_the_prompts_the_prose_filter_removes(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=20)
    log = logged(tmp_path / "traffic", prompts())

    # As a plain source the spec's prose filter removes every logged prompt (the failure).
    plain = {k: v for k, v in log.source().items() if k in ("path", "format", "text_field")}
    spec = spec_for(str(corpus / "*.txt"), filters=PROSE)
    spec = spec.model_copy(update={"sources": [*spec.sources, type(spec.sources[0])(**plain)]})
    before = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "cache").stats
    assert before["removed"]["too_few_words"] == len(prompts()) and "traffic" not in before

    # As a traffic source: its own filters (a floor of 3 words), exact repeats removed, PII scrubbed.
    spec = spec_for(str(corpus / "*.txt"), filters=PROSE)
    spec = spec.model_copy(update={"sources": [*spec.sources, type(spec.sources[0])(**log.source())]})
    report_dir = tmp_path / "report"
    stats = prepare_data(spec, seed=0, report_dir=report_dir, cache_dir=tmp_path / "cache").stats
    traffic = stats["traffic"]
    assert traffic["records_read"] == 27
    assert traffic["removed"] == {"exact_duplicate": 5, "too_few_words": 1}
    assert traffic["records_used"] == 21 == traffic["records_train"] + traffic["records_heldout"]
    assert stats["removed"].get("too_few_words", 0) == 0  # data.filters removed no corpus document, nor any prompt
    [row] = [r for r in stats["sources"] if r["kind"] == "traffic"]
    assert row["own_filters"] and row["filters"]["min_words"] == 3
    assert row["removal_samples"]["too_few_words"][0]["text"] == "hi"
    corpus_row = stats["sources"][0]
    assert corpus_row["read"] == 20 and corpus_row["used"] == 20 and not corpus_row["own_filters"]
    md = (report_dir / "report.md").read_text()
    assert "Logged requests: 27 read, 21 used" in md and "exact_duplicate 5" in md
    assert json.loads((report_dir / "report.json").read_text())["traffic"] == traffic


@pytest.fixture
def retrain_spec(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(merge(TINY_SPEC, {"name": "served", "data": {"filters": PROSE}})))
    return path


def test_too_few_usable_logged_records_is_refused_then_retried_as_the_log_grows(tmp_path, retrain_spec, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "t0ken")
    log = RequestLog(tmp_path / "traffic")
    # Nothing listens on port 9: a submission that gets past the policy fails there, naming the control plane.
    retrainer = Retrainer(retrain_spec, "http://127.0.0.1:9", tmp_path / "export", log, min_logged=100)
    reference = drift_reference()
    probs = reference.token_counts / reference.token_counts.sum()
    rng = np.random.default_rng(1)
    watch = TrafficWatch(DriftMonitor(reference, scales=(20, 100)), log, retrainer, check_every=5, sustain_requests=20)
    try:
        assert watch.status()["retrain_policy"]["min_logged_records"] == 100
        assert watch.status()["retrain_policy"]["traffic_filters"]["min_words"] == 3
        for i in range(60):
            watch.observe(f"an ordinary request, number {i}", rng.choice(100, size=30, p=probs).tolist())
        sent = 0
        while not watch.status()["events"]:
            watch.observe("the same shifted request", rng.integers(90, 100, size=30).tolist())
            watch.flush()
            sent += 1
            assert sent < 100, "sustained shifted traffic never made an event"
        watch.flush()
        outcome = watch.status()["events"][0]["retrain"]
        # 60 distinct records, then one shifted prompt repeated: too few usable records, said with the counts.
        assert outcome["submitted"] is False
        assert outcome["reason"].startswith("not submitted: 61 usable logged records, 100 needed")
        assert outcome["traffic"]["removed"] == {"exact_duplicate": 60 + sent - 61}
        assert retrainer.specs_dir.exists() is False and watch.retrains == 0  # nothing written, nothing sent
        for i in range(60):  # drift goes on with distinct prompts: the policy is asked again as the log grows
            watch.observe(f"shifted request {i} about the weather", rng.integers(90, 100, size=30).tolist())
        watch.flush()
        outcome = watch.status()["events"][0]["retrain"]
        assert "error" in outcome and "127.0.0.1:9" in outcome["error"], outcome  # past the policy: tried to submit
        assert len(watch.status()["events"]) == 1 and watch.retrains == 1
    finally:
        watch.close()
