"""Failures and crashes with a real daemon: retry budgets per class, linked stages, cancel and
requeue, and SIGKILL of the daemon itself."""

import os
import time

import pytest

from runyard.control import procs

from .helpers import job

pytestmark = pytest.mark.slow


def test_retry_budgets_per_failure_class(daemon_factory):
    d = daemon_factory("--cpu-slots", "2", "--backoff", "0.1", "--infra-retries", "3", "--user-retries", "1")
    c = d.client
    infra, user, spec = c.submit([
        job("infra", "--fail-first", "2", "--fail-kill"),  # killed twice, then fine: within 3 infra retries
        job("user", "--fail-first", "5", "--fail-code", "1"),  # keeps failing: 1 retry, then final
        job("spec", "--exit", "2"),  # bad spec: never retried
    ])
    final = c.wait(infra["id"])
    assert final["state"] == "succeeded" and final["restart_count"] == 2
    assert [e["restart"] for e in d.events_of("start") if int(e["job"]) == infra["id"]] == [0, 1, 2]
    final = c.wait(user["id"])
    assert final["state"] == "failed" and final["failure"] == "user_error"
    assert "retry budget spent (2 user_error failures" in final["detail"]
    assert len([e for e in d.events_of("start") if int(e["job"]) == user["id"]]) == 2
    final = c.wait(spec["id"])
    assert final["state"] == "failed" and final["failure"] == "bad_spec" and final["attempt"] == 1
    history = c.job(infra["id"])["history"]
    assert [h["to_state"] for h in history].count("recovering") == 2
    assert any("infra" in h["reason"] and "restarting" in h["reason"] for h in history)


def test_a_failed_smoke_gate_stops_the_linked_later_stage(daemon_factory):
    d = daemon_factory("--cpu-slots", "2")
    c = d.client
    smoke, full = c.submit([job("run.smoke", "--exit", "3"), job("run.full", devices=2, after_previous=True)])
    assert full["depends_on"] == smoke["id"] and full["run_dir"] == smoke["run_dir"]
    assert c.wait(smoke["id"])["failure"] == "gate_failed"
    final = c.wait(full["id"])
    assert final["state"] == "failed" and final["failure"] == "dependency_failed"
    assert "gate_failed" in final["detail"] and final["attempt"] == 0
    assert [int(e["job"]) for e in d.events_of("start")] == [smoke["id"]]
    # And when the smoke stage passes, the later stage runs after it, in the same run directory.
    ok_smoke, ok_full = c.submit([job("ok.smoke", "--steps", "2"), job("ok.full", "--steps", "3", after_previous=True)])
    assert c.wait(ok_full["id"])["state"] == "succeeded"
    starts = {int(e["job"]): e["t"] for e in d.events_of("start")}
    done = {int(e["job"]): e["t"] for e in d.events_of("done")}
    assert starts[ok_full["id"]] > done[ok_smoke["id"]]


def test_cancel_and_requeue(daemon_factory):
    d = daemon_factory("--cpu-slots", "1", "--stop-grace", "5")
    c = d.client
    running = c.submit([job("long", "--steps", "60", "--step-s", "0.05")])[0]
    queued = c.submit([job("queued")])[0]
    d.wait_event(running["id"])
    pid = c.job(running["id"])["job"]["pid"]
    assert c.cancel(queued["id"])["state"] == "cancelled"
    assert c.cancel(running["id"])["state"] == "cancelling"
    final = c.wait(running["id"], timeout_s=20)
    assert final["state"] == "cancelled" and final["allocation"] == []
    assert not procs.is_alive(pid, None)
    # A cancelled job can be requeued; it continues from its checkpoint.
    c.requeue(running["id"])
    assert c.wait(running["id"], timeout_s=60)["state"] == "succeeded"
    starts = [e for e in d.events_of("start") if int(e["job"]) == running["id"]]
    assert len(starts) == 2 and starts[1]["step"] > 0


def test_sigkill_of_the_daemon_loses_and_duplicates_nothing(daemon_factory):
    d = daemon_factory("--cpu-slots", "2")
    c = d.client
    jobs = c.submit([job(f"j{i}", "--steps", "10", "--step-s", "0.1") for i in range(4)])
    d.wait_event(jobs[1]["id"])
    d.sigkill()  # mid-run: two jobs running, two pending
    running_pids = [p for j in jobs for p in procs.processes_of_job(procs.instance_id(d.state_dir), j["id"])]
    assert running_pids, "the jobs outlive the daemon"
    time.sleep(0.3)
    d.start()
    c = d.client
    for j in jobs:
        assert c.wait(j["id"], timeout_s=60)["state"] == "succeeded"
    starts = [int(e["job"]) for e in d.events_of("start")]
    assert sorted(starts) == sorted(j["id"] for j in jobs), "every job started exactly once"
    assert all(c.job(j["id"])["job"]["attempt"] == 1 for j in jobs)


def test_a_job_killed_while_the_daemon_was_down_is_restarted(daemon_factory):
    d = daemon_factory("--cpu-slots", "1", "--backoff", "0.1")
    c = d.client
    j = c.submit([job("victim", "--steps", "30", "--step-s", "0.05")])[0]
    d.wait_event(j["id"])
    d.sigkill()
    shim = [p for p in procs.processes_of_job(procs.instance_id(d.state_dir), j["id"]) if os.getpgid(p) == p]
    os.killpg(shim[0], 9)  # the whole job dies with no one watching
    d.start()
    final = d.client.wait(j["id"], timeout_s=60)
    assert final["state"] == "succeeded" and final["restart_count"] == 1
    assert any("infra" in h["reason"] for h in d.client.job(j["id"])["history"])
