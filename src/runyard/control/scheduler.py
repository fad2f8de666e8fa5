"""Scheduling decisions: which pending jobs start on which devices, and which running jobs to preempt.

A pure function of the queue and the current allocations (no I/O), so it is tested and benchmarked
on its own. The rules, in order:

- Queue order is priority (higher first), then submission order (FIFO inside a priority).
- Gang allocation: a job gets all the devices it asks for at once, or none.
- A job that fits starts, unless it would delay a higher-priority job that is waiting (below).
- A waiting job that does not fit may preempt *running* jobs of strictly lower priority
  (lowest priority first, then the most recently started, which has the least work to lose).
- Otherwise it holds a reservation (EASY backfill): from the running jobs' time limits we know
  when enough devices free up for it (its shadow time); a later job may start now only if it ends
  before the shadow time, or uses devices the waiting job will not need even then.
- The concurrency cap and per-tenant device quotas are hard limits; a job held by its tenant's
  quota does not block other tenants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from runyard.control.states import JobState
from runyard.control.store import Job


@dataclass(frozen=True)
class Start:
    job_id: int
    devices: list[str]


@dataclass(frozen=True)
class Preempt:
    job_id: int
    for_job: int


@dataclass(frozen=True)
class Reject:
    job_id: int
    detail: str


@dataclass
class SchedulerConfig:
    inventory: list[str]  # device ids: "cuda:0", "cpu:3"...
    max_concurrent: int | None = None
    tenant_quotas: dict[str, int] = field(default_factory=dict)  # tenant -> max devices held at once
    preemption: bool = True
    backfill: bool = True


def queue_order(jobs: Sequence[Job]) -> list[Job]:
    """Priority first (higher wins), FIFO (job id) inside a priority."""
    return sorted(jobs, key=lambda j: (-j.priority, j.id))


def _expected_end(job: Job, now: float) -> float:
    if job.state in (JobState.PREEMPTED, JobState.CANCELLING):
        return now  # already told to stop
    if job.time_limit_s is None or job.started_at is None:
        return math.inf
    return job.started_at + job.time_limit_s


def plan(
    config: SchedulerConfig, pending: Sequence[Job], holders: Sequence[Job], now: float
) -> list[Start | Preempt | Reject]:
    """Decide this round. `pending` are eligible pending jobs; `holders` hold devices now."""
    actions: list[Start | Preempt | Reject] = []
    held = {d for h in holders for d in h.allocation}
    free = [d for d in config.inventory if d not in held]
    active = len(holders)
    tenant_used: dict[str, int] = {}
    for h in holders:
        tenant_used[h.tenant] = tenant_used.get(h.tenant, 0) + h.devices
    # Devices that will come back soon (jobs told to stop) and are not yet promised to a waiting job.
    releasing = sum(h.devices for h in holders if h.state in (JobState.PREEMPTED, JobState.CANCELLING))
    victims = sorted(
        (h for h in holders if h.state == JobState.RUNNING),
        key=lambda h: (h.priority, -(h.started_at or 0.0), -h.id),
    )
    # Ends of the jobs holding devices, soonest first: (time, devices), for shadow times.
    ends = sorted((_expected_end(h, now), h.devices) for h in holders)
    reservations: list[list[float]] = []  # [shadow_time, extra_devices] per waiting job
    capacity = len(config.inventory)

    for job in queue_order(pending):
        if job.devices > capacity:
            actions.append(Reject(job.id, f"asks for {job.devices} devices; this provider has {capacity}"))
            continue
        quota = config.tenant_quotas.get(job.tenant)
        if quota is not None and tenant_used.get(job.tenant, 0) + job.devices > quota:
            continue  # held by its own tenant's quota; blocks nobody else
        cap_ok = config.max_concurrent is None or active < config.max_concurrent
        if cap_ok and len(free) >= job.devices and _backfill_ok(job, reservations, now, config):
            chosen, free = free[: job.devices], free[job.devices :]
            actions.append(Start(job.id, chosen))
            ends.append((now + job.time_limit_s if job.time_limit_s is not None else math.inf, job.devices))
            ends.sort()
            active += 1
            tenant_used[job.tenant] = tenant_used.get(job.tenant, 0) + job.devices
            continue
        # It waits. Count devices already on their way back, then preempt lower-priority work.
        short = job.devices - len(free) - releasing
        if config.preemption:
            chosen_victims: list[Job] = []
            gained = 0
            for v in victims:
                if short - gained <= 0 and cap_ok:
                    break
                if v.priority >= job.priority:
                    break  # victims are sorted by priority: nobody further is lower
                chosen_victims.append(v)
                gained += v.devices
                cap_ok = True  # a victim's slot in the concurrency cap comes back too
            if chosen_victims and short - gained <= 0:
                for v in chosen_victims:
                    actions.append(Preempt(v.id, job.id))
                    victims.remove(v)
                    ends = [e for e in ends if e != (_expected_end(v, now), v.devices)] + [(now, v.devices)]
                    ends.sort()
                releasing += gained
        # Reserve for it: nobody may backfill in a way that delays it.
        promised = min(releasing, max(0, job.devices - len(free)))
        releasing -= promised
        reservations.append(_shadow(job.devices, len(free), ends, now))
    return actions


def _shadow(need: int, free_now: int, ends: list[tuple[float, int]], now: float) -> list[float]:
    """[time when `need` devices are free, devices to spare at that time]."""
    available = free_now
    if available >= need:
        return [now, float(available - need)]
    for end, devices in ends:
        available += devices
        if available >= need:
            return [end, float(available - need)]
    return [math.inf, 0.0]


def _backfill_ok(job: Job, reservations: list[list[float]], now: float, config: SchedulerConfig) -> bool:
    """A job may start past waiting higher-priority jobs only if it delays none of them."""
    if not reservations:
        return True
    if not config.backfill:
        return False
    job_end = now + job.time_limit_s if job.time_limit_s is not None else math.inf
    for shadow, extra in reservations:
        if job_end > shadow and job.devices > extra:
            return False
    for r in reservations:  # it will hold spare devices past the shadow time: those are used up
        if job_end > r[0]:
            r[1] -= job.devices
    return True
