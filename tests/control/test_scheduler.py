"""The scheduling rules, on the pure `plan` function (the real-process tests are in test_daemon_*.py)."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from runyard.control.scheduler import Preempt, Reject, SchedulerConfig, Start, plan
from runyard.control.states import JobState
from runyard.control.store import Job
from tests.tiers import examples

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


@settings(max_examples=examples(200, fast=40), deadline=None)
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


# -- backfill past a job that fits now but must wait for a higher-priority reservation ---------------


def test_a_job_that_must_wait_blocks_nobody_beyond_its_own_reservation():
    """2 devices, one busy for an hour; A needs both, B (1 device, 2 h) would delay A, C (1 min) would not.
    B waits behind A's reservation; C starts (Slurm's backfill starts C too)."""
    global _dev
    _dev = itertools.count(0)
    busy = running(1, priority=9, limit=3600, started=0)
    a = mk(devices=2, priority=5, limit=1800)
    b = mk(devices=1, priority=3, limit=7200)
    c = mk(devices=1, priority=1, limit=60)
    assert plan(cfg(2, preemption=False), [a, b, c], [busy], now=0) == [Start(c.id, ["cpu:1"])]
    assert plan(cfg(2, preemption=False), [a, c], [busy], now=0) == [Start(c.id, ["cpu:1"])]
    # Without a time limit B would hold its device for ever: it waits, and still blocks nobody.
    b_unbounded = mk(devices=1, priority=3)
    assert plan(cfg(2, preemption=False), [a, b_unbounded, c], [busy], now=0) == [Start(c.id, ["cpu:1"])]


def test_a_reservation_is_placed_after_earlier_reservations_not_at_now():
    """B (1 device, 2 h) reserves after A's reservation ends (t=5400), so D, which would end at
    t=9000 on the device A leaves B, starts now only if it ends before A's reservation (it does not)."""
    global _dev
    _dev = itertools.count(0)
    busy = running(1, priority=9, limit=3600, started=0)
    a = mk(devices=2, priority=5, limit=1800)  # reserved [3600, 5400), both devices
    b = mk(devices=1, priority=3, limit=7200)  # reserved [5400, 12600), one device
    d = mk(devices=1, priority=2, limit=9000)  # would overlap A's reservation: waits
    e = mk(devices=1, priority=1, limit=3000)  # ends at 3000 < 3600: starts
    assert plan(cfg(2, preemption=False), [a, b, d, e], [busy], now=0) == [Start(e.id, ["cpu:1"])]


def test_the_concurrency_cap_is_part_of_the_timeline():
    """With one job slot left, a long job would take the slot the waiting head needs when its devices
    come back; a job that ends before then may take it."""
    global _dev
    _dev = itertools.count(0)
    holder = running(2, priority=9, limit=100, started=0)  # 2 of 3 devices until t=100
    head = mk(devices=3, priority=5, limit=50)
    long = mk(devices=1, priority=1, limit=500)
    short = mk(devices=1, priority=0, limit=50)
    actions = plan(cfg(3, preemption=False, max_concurrent=2), [head, long, short], [holder], now=10)
    assert actions == [Start(short.id, ["cpu:2"])]


def test_a_job_past_its_time_limit_is_still_preempted_for_a_higher_one():
    global _dev
    _dev = itertools.count(0)
    overdue = running(1, priority=0, limit=5, started=0)  # its time limit passed at t=5; still running
    high = mk(devices=1, priority=9)
    assert plan(cfg(1), [high], [overdue], now=100) == [Preempt(overdue.id, high.id)]


# -- properties, against a reference computed on a grid of whole time units ---------------------------
#
# Every time limit is a whole number of units and `now` is 0, so the free timeline is a list with one
# entry per unit: `used[t]` devices (and `slots[t]` jobs) in [t, t + 1). The reference places every job
# in queue order: it starts now if it fits now (free devices, the cap, and room on the grid for its
# whole time limit), else it reserves the first grid position with room for it.

NOW = 0
UNITS = 64  # longer than any time limit plus every job's reservation (at most 8 jobs of 6 units)


def _grid_fits(used, slots, at, length, devices, capacity, cap):
    end = UNITS if length is None else min(UNITS, at + length)
    return all(used[t] + devices <= capacity and (cap is None or slots[t] + 1 <= cap) for t in range(at, end))


def _grid_take(used, slots, at, length, devices):
    for t in range(at, UNITS if length is None else min(UNITS, at + length)):
        used[t] += devices
        slots[t] += 1


def _grid_earliest(used, slots, length, devices, capacity, cap):
    return next((t for t in range(UNITS - 8) if _grid_fits(used, slots, t, length, devices, capacity, cap)), None)


def _holders_grid(holders):
    used, slots = [0] * UNITS, [0] * UNITS
    for h in holders:
        if h.state == JobState.RUNNING:
            _grid_take(used, slots, 0, None if h.time_limit_s is None else int(h.started_at + h.time_limit_s), h.devices)
    return used, slots


holder_st = st.tuples(st.integers(1, 3), st.integers(0, 3), st.sampled_from([None, 1, 3, 6, 9]),
                      st.sampled_from([JobState.RUNNING, JobState.RUNNING, JobState.CANCELLING]))
waiting_st = st.tuples(st.integers(1, 4), st.integers(0, 3), st.sampled_from([None, 1, 2, 4, 6]), st.sampled_from("ab"))


def _scenario(held, waiting, capacity):
    global _dev
    _dev = itertools.count(0)
    holders = []
    for devices, priority, ends_at, state in held:
        h = running(devices, priority, limit=None if ends_at is None else ends_at + 5, started=-5)
        holders.append(mk(devices, priority, h.tenant, state, h.allocation, h.time_limit_s, h.started_at, id=h.id))
    jobs = [mk(d, p, tenant, limit=None if lim is None else float(lim)) for d, p, lim, tenant in waiting]
    n = max(capacity, sum(h.devices for h in holders))
    return holders, jobs, n


@settings(max_examples=examples(400, fast=60), deadline=None)
@given(held=st.lists(holder_st, max_size=3), waiting=st.lists(waiting_st, min_size=1, max_size=8),
       capacity=st.integers(2, 8), cap=st.sampled_from([None, None, 2, 3]),
       quota=st.sampled_from([None, 2, 4]), backfill=st.booleans())
def test_plan_starts_exactly_the_jobs_that_delay_no_higher_priority_reservation(
        held, waiting, capacity, cap, quota, backfill):
    holders, jobs, n = _scenario(held, waiting, capacity)
    quotas = {} if quota is None else {"a": quota}
    config = cfg(n, preemption=False, backfill=backfill, max_concurrent=cap, tenant_quotas=quotas)
    actions = plan(config, jobs, holders, now=NOW)
    starts = {a.job_id: a.devices for a in actions if isinstance(a, Start)}
    assert not any(isinstance(a, Preempt) for a in actions)

    held_devices = {d for h in holders for d in h.allocation}
    given = [d for devices in starts.values() for d in devices]
    assert len(given) == len(set(given)) and not set(given) & held_devices  # free devices, each once

    used, slots = _holders_grid(holders)
    free = n - len(held_devices)
    active = len(holders)
    tenant_used = {}
    for h in holders:
        tenant_used[h.tenant] = tenant_used.get(h.tenant, 0) + h.devices
    someone_waits = False
    for job in sorted(jobs, key=lambda j: (-j.priority, j.id)):
        length = None if job.time_limit_s is None else int(job.time_limit_s)
        if job.devices > n:
            assert Reject(job.id, f"asks for {job.devices} devices; this provider has {n}") in actions
            continue
        if quotas.get(job.tenant) is not None and tenant_used.get(job.tenant, 0) + job.devices > quotas[job.tenant]:
            assert job.id not in starts, "a job over its tenant's quota started"
            continue
        could_start = (free >= job.devices and (cap is None or active < cap) and (backfill or not someone_waits)
                       and _grid_fits(used, slots, 0, length, job.devices, n, cap))
        if could_start:
            assert job.id in starts, (
                f"job {job.id} could start now without delaying any higher-priority reservation, but waits")
            assert len(starts[job.id]) == job.devices
            _grid_take(used, slots, 0, length, job.devices)
            free -= job.devices
            active += 1
            tenant_used[job.tenant] = tenant_used.get(job.tenant, 0) + job.devices
        else:
            assert job.id not in starts, f"job {job.id} started but delays a higher-priority job's reservation"
            someone_waits = True
            at = _grid_earliest(used, slots, length, job.devices, n, cap)
            if at is not None:
                _grid_take(used, slots, at, length, job.devices)


@settings(max_examples=examples(400, fast=60), deadline=None)
@given(held=st.lists(holder_st, max_size=3), waiting=st.lists(waiting_st, min_size=1, max_size=8),
       capacity=st.integers(2, 8), cap=st.sampled_from([None, 2, 3]))
def test_the_head_of_the_queue_is_never_delayed(held, waiting, capacity, cap):
    """The highest-ranked job left waiting can start as early with everything this round started as
    with only the jobs ranked above it (which may take its devices: they outrank it)."""
    holders, jobs, n = _scenario(held, waiting, capacity)
    actions = plan(cfg(n, preemption=False, max_concurrent=cap), jobs, holders, now=NOW)
    starts = {a.job_id for a in actions if isinstance(a, Start)}
    ranked = sorted(jobs, key=lambda j: (-j.priority, j.id))
    head = next((j for j in ranked if j.id not in starts and j.devices <= n), None)
    if head is None:
        return
    length = None if head.time_limit_s is None else int(head.time_limit_s)

    def head_start(started_jobs):
        used, slots = _holders_grid(holders)
        for j in started_jobs:
            _grid_take(used, slots, 0, None if j.time_limit_s is None else int(j.time_limit_s), j.devices)
        return _grid_earliest(used, slots, length, head.devices, n, cap)

    ahead = [j for j in ranked[: ranked.index(head)] if j.id in starts]
    with_all = head_start([j for j in ranked if j.id in starts])
    with_ahead = head_start(ahead)
    assert with_ahead is None or (with_all is not None and with_all <= with_ahead), (
        f"the head (job {head.id}) could start at {with_ahead}, but the jobs started past it move it to {with_all}")
