"""Scheduling decisions: which pending jobs start on which devices, and which running jobs to preempt.

A pure function of the queue and the current allocations (no I/O), so it is tested and benchmarked
on its own. The rules, in order:

- Queue order is priority (higher first), then submission order (FIFO inside a priority).
- Gang allocation: a job gets all the devices it asks for at once, or none.
- A job that fits starts, unless it would delay a higher-priority job that is waiting (below).
- A waiting job that does not fit may preempt *running* jobs of strictly lower priority
  (lowest priority first, then the most recently started, which has the least work to lose).
- Otherwise it holds a reservation (backfill, as Slurm's sched/backfill does it): on the projected
  free timeline (`timeline.py`: the running jobs give their devices back at the end of their time
  limits, and every job started or reserved earlier in this pass is taken out of it) it gets the
  earliest interval with room for its whole time limit. A later job may start now only where the
  timeline has room for it over its own time limit, so it delays no higher-priority job; a job that
  cannot start now does not block the jobs after it beyond its own reservation.
- A job without a time limit holds its devices for ever on the timeline; a reservation that can never
  begin (the devices it needs never come back) blocks nobody.
- The concurrency cap and per-tenant device quotas are hard limits; the cap is part of the timeline
  (a job slot per job), a job held by its tenant's quota does not block other tenants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from runyard.control.states import JobState
from runyard.control.store import Job
from runyard.control.timeline import INF, FreeTimeline


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


class Queued(Protocol):
    """What the scheduler reads of a waiting job (a `Job`, or the store's lighter `QueuedJob`)."""

    @property
    def id(self) -> int: ...
    @property
    def tenant(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def devices(self) -> int: ...
    @property
    def time_limit_s(self) -> float | None: ...


Q = TypeVar("Q", bound=Queued)


def queue_order(jobs: Sequence[Q]) -> list[Q]:
    """Priority first (higher wins), FIFO (job id) inside a priority."""
    return sorted(jobs, key=lambda j: (-j.priority, j.id))


def plan(
    config: SchedulerConfig, pending: Sequence[Queued], holders: Sequence[Job], now: float
) -> list[Start | Preempt | Reject]:
    """Decide this round. `pending` are eligible pending jobs; `holders` hold devices now."""
    actions: list[Start | Preempt | Reject] = []
    capacity = len(config.inventory)
    held = {d for h in holders for d in h.allocation}
    free = [d for d in config.inventory if d not in held]
    active = len(holders)
    cap = config.max_concurrent
    tenant_used: dict[str, int] = {}
    for h in holders:
        tenant_used[h.tenant] = tenant_used.get(h.tenant, 0) + h.devices
    ends = {h.id: _expected_end(h, now) for h in holders}
    # Jobs already told to stop give their devices (and slots) back "now" on the timeline, though
    # they are not free yet: a job waiting for them holds them by its reservation at `now`.
    timeline = FreeTimeline(now, len(free), None if cap is None else cap - active,
                            [(ends[h.id], h.devices) for h in holders])
    victims = sorted((h for h in holders if h.state == JobState.RUNNING),
                     key=lambda h: (h.priority, -_attempt_start(h), -h.id))
    someone_waits = False

    for job in queue_order(pending):
        if job.devices > capacity:
            actions.append(Reject(job.id, f"asks for {job.devices} devices; this provider has {capacity}"))
            continue
        quota = config.tenant_quotas.get(job.tenant)
        if quota is not None and tenant_used.get(job.tenant, 0) + job.devices > quota:
            continue  # held by its own tenant's quota; blocks nobody else
        duration = INF if job.time_limit_s is None else job.time_limit_s
        if (len(free) >= job.devices and (cap is None or active < cap)
                and (config.backfill or not someone_waits)
                and timeline.fits(now, now + duration, job.devices)):
            chosen, free = free[: job.devices], free[job.devices :]
            actions.append(Start(job.id, chosen))
            timeline.take(now, now + duration, job.devices)
            active += 1
            tenant_used[job.tenant] = tenant_used.get(job.tenant, 0) + job.devices
            continue
        someone_waits = True
        start = timeline.earliest(job.devices, duration)
        if start > now and config.preemption:
            start = _preempt_for(job, duration, start, victims, ends, timeline, now, actions)
        if start != INF:
            timeline.take(start, start + duration, job.devices)  # its reservation
    return actions


def _attempt_start(job: Job) -> float:
    """When the job's current attempt began (its time limit counts from there)."""
    if job.attempt_started_at is not None:
        return job.attempt_started_at
    return job.started_at if job.started_at is not None else 0.0


def _expected_end(job: Job, now: float) -> float:
    """When a holder gives its devices back, by its time limit (`INF` without one)."""
    if job.state in (JobState.PREEMPTED, JobState.CANCELLING):
        return now  # already told to stop
    if job.time_limit_s is None or (job.attempt_started_at is None and job.started_at is None):
        return INF
    # A job past its time limit still holds its devices: it ends "any moment", but not now.
    return max(_attempt_start(job) + job.time_limit_s, math.nextafter(now, INF))


def _preempt_for(job: Queued, duration: float, start: float, victims: list[Job], ends: dict[int, float],
                 timeline: FreeTimeline, now: float, actions: list[Start | Preempt | Reject]) -> float:
    """Stop running jobs of lower priority than `job` (lowest priority, then the newest: the least work
    lost) until it could have their devices now. Returns its start: `now` when enough victims were
    found (they are then told to stop), else `start` unchanged and nobody is preempted."""
    chosen: list[Job] = []
    for victim in victims:
        if victim.priority >= job.priority:
            break  # victims are sorted by priority: nobody further is lower
        timeline.give(now, ends[victim.id], victim.devices)
        chosen.append(victim)
        if timeline.fits(now, now + duration, job.devices):
            for v in chosen:
                victims.remove(v)
                actions.append(Preempt(v.id, job.id))
            return now
    for victim in chosen:  # preempting every lower-priority job would not be enough: stop nobody
        timeline.take(now, ends[victim.id], victim.devices)
    return start
