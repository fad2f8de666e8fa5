"""Scheduling with a real daemon and real job processes: priority order, gang, backfill, preemption."""

import pytest

from .helpers import job

pytestmark = pytest.mark.slow


def _x_after(steps: int) -> int:
    """What tests/control/jobscript.py computes in `steps` uninterrupted steps (its 'final weights')."""
    x = 7
    for step in range(steps):
        x = (x * 31 + step) % 1_000_003
    return x


def test_priority_order_under_contention(daemon_factory):
    d = daemon_factory("--cpu-slots", "1", "--no-preemption")
    c = d.client
    blocker = c.submit([job("blocker", "--steps", "8", "--step-s", "0.1")])[0]
    c.wait(blocker["id"], ("running",))
    queued = c.submit([job(f"p{p}", priority=p) for p in (0, 5, 1, 5, 3)])
    for j in queued:
        assert c.wait(j["id"], timeout_s=60)["state"] == "succeeded"
    order = [int(e["job"]) for e in d.events_of("start")]
    by_priority = sorted(queued, key=lambda j: (-j["priority"], j["id"]))
    assert order == [blocker["id"]] + [j["id"] for j in by_priority]


def test_gang_allocation_gets_all_devices_or_none(daemon_factory):
    d = daemon_factory("--devices", "cuda:0,cuda:1,cuda:2", "--no-preemption", "--no-backfill")
    c = d.client
    a = c.submit([job("a", "--steps", "6", "--step-s", "0.1", devices=2)])[0]
    c.wait(a["id"], ("running",))
    b = c.submit([job("b", "--steps", "1", devices=2)])[0]
    # One device is free but b asked for two: it must not start on part of its allocation.
    assert c.job(b["id"])["job"]["state"] == "pending"
    assert c.wait(b["id"])["state"] == "succeeded"
    starts = {int(e["job"]): e for e in d.events_of("start")}
    assert starts[b["id"]]["t"] > [e for e in d.events_of("done") if int(e["job"]) == a["id"]][0]["t"]
    for e in starts.values():
        devices = e["devices"].split(",")
        assert len(devices) == 2 and len(set(devices)) == 2
        assert e["cuda"] == ",".join(x.split(":")[1] for x in devices)


def test_backfill_fills_a_gap_without_delaying_the_waiting_job(daemon_factory):
    d = daemon_factory("--cpu-slots", "3", "--no-preemption")
    c = d.client
    holder = c.submit([job("holder", "--steps", "15", "--step-s", "0.1", devices=2, time_limit_s=30)])[0]
    c.wait(holder["id"], ("running",))
    big, short, unbounded = c.submit([
        job("big", devices=3, priority=5),  # waits for the holder's 2 devices plus the free one
        job("short", "--steps", "2", "--step-s", "0.1", time_limit_s=5),  # ends long before: backfills
        job("unbounded", "--steps", "1"),  # no time limit: it could delay big, so it waits
    ])
    assert c.wait(short["id"], timeout_s=30)["state"] == "succeeded"
    assert c.job(unbounded["id"])["job"]["state"] == "pending"
    for j in (big, unbounded):
        assert c.wait(j["id"], timeout_s=60)["state"] == "succeeded"
    order = [int(e["job"]) for e in d.events_of("start")]
    assert order == [holder["id"], short["id"], big["id"], unbounded["id"]]


def test_preemption_checkpoints_and_resumes_to_the_same_result(daemon_factory):
    d = daemon_factory("--cpu-slots", "1", "--stop-grace", "20")
    c = d.client
    low = c.submit([job("low", "--steps", "30", "--step-s", "0.05", priority=0)])[0]
    d.wait_event(low["id"])
    high = c.submit([job("high", "--steps", "2", priority=10)])[0]
    assert c.wait(high["id"])["state"] == "succeeded"
    final = c.wait(low["id"])
    assert final["state"] == "succeeded" and final["restart_count"] == 1 and final["attempt"] == 2
    low_events = [e for e in d.events_of() if int(e["job"]) == low["id"]]
    kinds = [e["kind"] for e in low_events]
    assert kinds == ["start", "preempted", "start", "done"]
    assert low_events[2]["restart"] == 1 and low_events[2]["step"] == low_events[1]["step"] > 0
    assert low_events[-1]["x"] == _x_after(30)  # the same final state as a run never preempted
    history = [(h["from_state"], h["to_state"]) for h in c.job(low["id"])["history"]]
    assert ("running", "preempted") in history and ("preempted", "pending") in history
    reasons = [h["reason"] for h in c.job(low["id"])["history"]]
    assert f"preempted by higher-priority job {high['id']}" in reasons
