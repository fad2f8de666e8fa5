"""A deployment's pieces on their own: laying out an export (refusing what reaches outside it), the
command that serves it, availability split at period closes without losing or inventing a probe, and
the agent's decisions (a deployment that failed before it served, a live server to restart)."""

from __future__ import annotations

import base64

import pytest

from runyard.control.deployment import (
    RETRY_POLICY,
    SERVE_PORT,
    failed_before_serving,
    job_request,
    lay_out,
    log_reason,
    report_windows,
    serve_command,
    should_restart,
)
from runyard.control.endpoint import Window
from runyard.control.lease_job import LeaseFolder
from runyard.control.retry import RetryPolicy
from runyard.control.states import JobState
from runyard.market.serving import deployment_body


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_an_export_is_laid_out_and_its_urls_fetched_into_it(tmp_path):
    folder = LeaseFolder(tmp_path / "lease-1")
    body, _ = deployment_body(files={"config.json": _b64(b"{}"), "tok/tokenizer.json": _b64(b"[]")},
                              urls={"model.safetensors": "https://models.example/m.safetensors"})
    fetch = lay_out(folder, body)
    assert (folder.export / "config.json").read_bytes() == b"{}"
    assert (folder.export / "tok" / "tokenizer.json").read_bytes() == b"[]"
    assert fetch == {"https://models.example/m.safetensors": "export/model.safetensors"}
    assert folder.work.is_dir() and not list(folder.files.iterdir())


@pytest.mark.parametrize("bad, words", [
    ({"export_files": {"../../etc/passwd": _b64(b"x")}}, "relative path"),
    ({"export_files": {"/abs": _b64(b"x")}}, "relative path"),
    ({"export_urls": {"a": "file:///etc/shadow"}}, "http"),
    ({"export_urls": {"a": "http://user:pw@host/x"}}, "credentials"),
    ({"export_files": {"a": _b64(b"x")}, "export_urls": {"a": "http://h/a"}}, "both"),
    ({}, "no files"),
])
def test_a_deployment_that_reaches_outside_its_export_is_refused(tmp_path, bad, words):
    with pytest.raises(ValueError, match=words):
        lay_out(LeaseFolder(tmp_path / "lease-2"), {"token_sha256": "sha256:" + "0" * 64, **bad})
    assert not (tmp_path / "lease-2" / "export").exists() or not list((tmp_path / "lease-2" / "export").iterdir())


def test_the_serving_command_and_its_job(tmp_path):
    folder = LeaseFolder(tmp_path / "lease-3")
    argv = serve_command(folder, {"serve": {"kv_cache_mb": 16, "model_name": "m", "max_batch": None}}, gpu=False)
    relay, serve = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    assert relay[1:] == ["-m", "runyard.control.serve_relay", str(folder.socket), str(SERVE_PORT)]
    assert serve[1:5] == ["-m", "runyard", "serve", str(folder.export)]
    assert serve[serve.index("--device") + 1] == "cpu" and serve[serve.index("--host") + 1] == "127.0.0.1"
    assert serve[serve.index("--kv-cache-mb") + 1] == "16" and "--max-batch" not in serve
    assert serve_command(folder, {}, gpu=True)[-1] == "cuda"
    request = job_request({"id": 3, "devices": 1, "tenant_id": 9}, argv, folder, 100)
    assert request["retry_policy"] == RETRY_POLICY and "time_limit_s" not in request
    RetryPolicy.from_dict(request["retry_policy"])  # the control plane accepts it


def test_availability_is_split_at_period_closes_without_losing_a_probe():
    seen = Window(probes=100, probes_ok=90, requests=7, latency_p50_ms=5, latency_p99_ms=9)
    parts = report_windows(start=550, end=1300, started_at=0, period_s=600, seen=seen)
    assert [(p.start, p.end) for p in parts] == [(550, 600), (600, 1200), (1200, 1300)]
    assert sum(p.probes for p in parts) == 100 and sum(p.probes_ok for p in parts) == 90
    assert sum(p.requests for p in parts) == 7
    for part in parts:
        assert part.probes_ok <= part.probes
        assert part.available_seconds == (part.end - part.start) * part.probes_ok // part.probes
    (whole,) = report_windows(start=10, end=70, started_at=0, period_s=600, seen=Window(probes=4, probes_ok=3))
    assert (whole.available_seconds, whole.probes, whole.probes_ok) == (45, 4, 3)
    (blind,) = report_windows(start=10, end=70, started_at=0, period_s=600, seen=Window())
    assert blind.available_seconds == 0  # no probe, no availability


def test_a_deployment_that_failed_before_it_served_ends_its_lease():
    assert failed_before_serving(JobState.RECOVERING, [[1.0, "user_error"]], ever_healthy=False)
    assert failed_before_serving(JobState.FAILED, [], ever_healthy=False)
    assert not failed_before_serving(JobState.RECOVERING, [[1.0, "infra"]], ever_healthy=False)  # the machine's fault
    # a model too large for the lease's memory never serves either: that is the tenant's to fix
    assert failed_before_serving(JobState.RECOVERING, [[1.0, "out_of_memory"]], ever_healthy=False)
    assert not failed_before_serving(JobState.FAILED, [[1.0, "user_error"]], ever_healthy=True)


def test_a_live_server_is_restarted_only_after_its_grace_and_a_long_sickness():
    assert should_restart(JobState.RUNNING, 0.0, unhealthy_for_s=61, now=400, startup_grace_s=300,
                          unhealthy_restart_s=60)
    assert not should_restart(JobState.RUNNING, 200.0, 61, 400, 300, 60)  # still loading its model
    assert not should_restart(JobState.RUNNING, 0.0, 30, 400, 300, 60)  # not sick for long enough
    assert not should_restart(JobState.RECOVERING, 0.0, 600, 4000, 300, 60)  # already being restarted


def test_the_reason_is_the_servers_own_words(tmp_path):
    log = tmp_path / "output.log"
    log.write_text("loading\nTraceback...\nrunyard: export /x: config.json is not a runyard export\nbye\n")
    assert log_reason(str(log)) == "runyard: export /x: config.json is not a runyard export"
    log.write_text("only this\n")
    assert log_reason(str(log)) == "only this"
    assert log_reason(str(tmp_path / "missing")) == "(no log)"
