"""The scheduling rules, on the pure `plan` function (the real-process tests are in test_daemon_*.py)."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from runyard.control.scheduler import Preempt, Reject, SchedulerConfig, Start, plan
from runyard.control.states import JobState
from runyard.control.store import Job

_ids = itertools.count(1)


def mk(devices=1, priority=0, tenant="t", state=JobState.PENDING, allocation=(), limit=None, started=None, id=None):
    return Job(id=id or next(_ids), name="j", tenant=tenant, priority=priority, devices=devices, argv=["x"], env={},
               run_dir="", log_path="", depends_on=None, time_limit_s=limit, retry_policy={}, lease_id=None,
               state=state, failure=None, detail=None, restart_count=0, attempt=0, allocation=list(allocation),
               pid=None, pid_start_time=None, backend_id=None, exit_code=None, failures=[], next_start_at=None,
               signalled_at=None, attempt_started_at=None, submitted_at=0.0, started_at=started, ended_at=None)


def running(devices, priority=0, limit=None, started=0.0, tenant="t"):
    alloc = [f"cpu:{next(_dev)}" for _ in range(devices)]
    return mk(devices, priority, tenant, JobState.RUNNING, alloc, limit, started)


_dev = itertools.count(0)


def cfg(n, **kw):
    return SchedulerConfig(inventory=[f"cpu:{i}" for i in range(n)], **kw)


def started(actions):
    return [a.job_id for a in actions if isinstance(a, Start)]


def test_priority_then_fifo():
    a, b, c, d = mk(priority=0), mk(priority=5), mk(priority=5), mk(priority=1)
    actions = plan(cfg(3), [a, b, c, d], [], now=0)
    assert started(actions) == [b.id, c.id, d.id]


def test_gang_all_devices_or_none_and_distinct():
    big, small = mk(devices=3, priority=1), mk(devices=2)
    actions = plan(cfg(4, backfill=False), [big, small], [], now=0)
    assert [a for a in actions if isinstance(a, Start)] == [Start(big.id, ["cpu:0", "cpu:1", "cpu:2"])]
    # 2 free, a 3-device job waits whole; it is never given part of what it asked for.
    global _dev
    _dev = itertools.count(0)
    holder = running(2)
    waiting = mk(devices=3)
    assert plan(cfg(4, preemption=False, backfill=False), [waiting], [holder], now=0) == []


def test_backfill_only_where_it_delays_no_waiting_job():
    global _dev
    _dev = itertools.count(0)
    holder = running(2, limit=100, started=0)  # frees 2 devices at t=100
    big = mk(devices=4, priority=9)  # waits for t=100
    short = mk(devices=1, limit=50)  # ends at 60 < 100: fills the gap
    long = mk(devices=1, limit=500)  # would still hold a device the big job needs at t=100
    unbounded = mk(devices=1)
    actions = plan(cfg(4, preemption=False), [big, short, long, unbounded], [holder], now=10)
    assert started(actions) == [short.id]
    assert plan(cfg(4, preemption=False, backfill=False), [big, short], [holder], now=10) == []


def test_backfill_may_use_devices_the_waiting_job_will_not_need():
    global _dev
    _dev = itertools.count(0)
    holder = running(3, limit=100, started=0)
    waiting = mk(devices=2, priority=9)  # at t=100 there are 5 free, it needs 2: 3 to spare... but only 2 free now
    extra = mk(devices=1)  # no time limit, but uses a device to spare
    actions = plan(cfg(5, preemption=False), [waiting, extra], [holder], now=10)
    # waiting fits now (2 free): it starts; extra then has nothing left
    assert started(actions) == [waiting.id]
    _dev = itertools.count(0)
    holder2 = running(4, limit=100, started=0)
    waiting2 = mk(devices=3, priority=9)  # 1 free now; 5 at t=100, 2 to spare
    extra2 = mk(devices=1)
    assert started(plan(cfg(5, preemption=False), [waiting2, extra2], [holder2], now=10)) == [extra2.id]


def test_preemption_picks_lowest_priority_then_newest_and_only_what_is_needed():
    global _dev
    _dev = itertools.count(0)
    old_low = running(1, priority=0, started=1)
    new_low = running(1, priority=0, started=5)
    mid = running(1, priority=3, started=0)
    high = mk(devices=1, priority=9)
    actions = plan(cfg(3), [high], [old_low, new_low, mid], now=10)
    assert actions == [Preempt(new_low.id, high.id)]
    # Once the victim is stopping, the next round waits for it instead of preempting more.
    stopping = mk(1, 0, "t", JobState.PREEMPTED, new_low.allocation)
    assert plan(cfg(3), [high], [old_low, stopping, mid], now=11) == []
    # Nobody of equal or higher priority is preempted.
    equal = mk(devices=3, priority=3)
    assert not any(isinstance(a, Preempt) and a.job_id == mid.id for a in plan(cfg(3), [equal], [old_low, new_low, mid], 10))


def test_quota_cap_and_no_capacity():
    a1, a2, b = mk(tenant="a"), mk(tenant="a"), mk(tenant="b")
    assert started(plan(cfg(4, tenant_quotas={"a": 1}), [a1, a2, b], [], now=0)) == [a1.id, b.id]
    assert started(plan(cfg(4, max_concurrent=2), [a1, a2, b], [], now=0)) == [a1.id, a2.id]
    huge = mk(devices=9)
    assert plan(cfg(4), [huge], [], now=0) == [Reject(huge.id, "asks for 9 devices; this provider has 4")]


jobs_st = st.lists(st.tuples(st.integers(1, 4), st.integers(0, 3), st.sampled_from([None, 5.0, 50.0])),
                   min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(pending=jobs_st, held=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 3), st.sampled_from([None, 20.0])),
                                      max_size=3), backfill=st.booleans())
def test_no_lower_priority_job_starts_while_a_higher_one_that_fits_waits(pending, held, backfill):
    global _dev
    _dev = itertools.count(0)
    holders = [running(d, p, limit=lim, started=0) for d, p, lim in held]
    n = max(8, sum(h.devices for h in holders))
    jobs = [mk(d, p, limit=lim) for d, p, lim in pending]
    actions = plan(cfg(n, preemption=False, backfill=backfill), jobs, holders, now=1)
    starts = {a.job_id: a for a in actions if isinstance(a, Start)}
    rank = {j.id: (-j.priority, j.id) for j in jobs}
    assert len({d for a in starts.values() for d in a.devices}) == sum(len(a.devices) for a in starts.values())
    for waiting in (j for j in jobs if j.id not in starts):
        later = [i for i in starts if rank[i] > rank[waiting.id]]
        if not later:
            continue
        assert backfill, "without backfill nothing starts past a waiting job"
        # The jobs ranked after it are not why it waits: without them it would still wait.
        ahead = [j for j in jobs if rank[j.id] <= rank[waiting.id]]
        alone = plan(cfg(n, preemption=False, backfill=backfill), ahead, holders, now=1)
        assert waiting.id not in {a.job_id for a in alone if isinstance(a, Start)}
