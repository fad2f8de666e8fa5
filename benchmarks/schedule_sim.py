"""A scheduling trace on a simulated clock, for benchmarks/control.py: jobs arrive, run for their real
duration (under their time limit), and are asked about at every event through runyard's pure
`scheduler.plan`. A preempted job goes back to the queue and later resumes where it stopped (as a run
resumes from its checkpoint). Nothing runs for real; only the decisions are runyard's.
"""

from __future__ import annotations

import dataclasses
import random
import time

from runyard.control import scheduler
from runyard.control.states import JobState
from runyard.control.store import Job


def make_job(job_id: int, **fields) -> Job:
    """A queue row for the pure scheduler (the fields it reads; the rest at their defaults)."""
    base = dict(id=job_id, name=f"j{job_id}", tenant="default", priority=0, devices=1, argv=["true"], env={},
                run_dir="", log_path="", depends_on=None, time_limit_s=None, retry_policy={}, lease_id=None,
                state=JobState.PENDING, failure=None, detail=None, restart_count=0, attempt=0, allocation=[],
                pid=None, pid_start_time=None, backend_id=None, exit_code=None, failures=[], next_start_at=None,
                signalled_at=None, attempt_started_at=None, submitted_at=float(job_id), started_at=None,
                ended_at=None)
    base.update(fields)
    return Job(**base)


def make_trace(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(1 / 60.0)
        duration = rng.uniform(120, 3600)
        out.append({"id": i + 1, "arrival": t, "devices": rng.choice([1, 1, 2, 2, 4, 8]),
                    "priority": rng.randint(0, 9), "duration": duration,
                    "limit": duration * rng.uniform(1.1, 2.0)})
    return out


def simulate(trace: list[dict], config: scheduler.SchedulerConfig) -> dict:
    """Replay arrivals and completions on a simulated clock, asking `plan` at every event."""
    pending: dict[int, Job] = {}
    running: dict[int, tuple[Job, float]] = {}  # id -> (job, simulated end)
    remaining = {j["id"]: j["duration"] for j in trace}
    first_start: dict[int, float] = {}
    arrivals = sorted(trace, key=lambda j: j["arrival"])
    now, busy_device_s, plan_s, decided = 0.0, 0.0, 0.0, 0
    backfilled = preempted = 0
    k = 0
    while k < len(arrivals) or pending or running:
        next_arrival = arrivals[k]["arrival"] if k < len(arrivals) else float("inf")
        next_end = min((end for _, end in running.values()), default=float("inf"))
        new_now = min(next_arrival, next_end)
        busy_device_s += sum(job.devices for job, _ in running.values()) * (new_now - now)
        for job, _end in running.values():
            remaining[job.id] -= new_now - now
        now = new_now
        for jid, (_job, end) in list(running.items()):
            if end <= now:
                del running[jid]
        while k < len(arrivals) and arrivals[k]["arrival"] <= now:
            j = arrivals[k]
            pending[j["id"]] = make_job(j["id"], priority=j["priority"], devices=j["devices"],
                                        time_limit_s=j["limit"], submitted_at=j["arrival"])
            k += 1
        while True:  # a preemption frees devices now: decide again at the same instant
            holders = [job for job, _ in running.values()]
            t0 = time.perf_counter()
            actions = scheduler.plan(config, list(pending.values()), holders, now)
            plan_s += time.perf_counter() - t0
            decided += len(pending)
            victims = [a for a in actions if isinstance(a, scheduler.Preempt)]
            for a in victims:
                job, _ = running.pop(a.job_id)
                preempted += 1
                pending[job.id] = dataclasses.replace(job, state=JobState.PENDING, allocation=[])
            for a in actions:
                if isinstance(a, scheduler.Start):
                    job = pending.pop(a.job_id)
                    if any(p.priority > job.priority for p in pending.values()):
                        backfilled += 1  # started past a higher-priority job that still waits
                    first_start.setdefault(job.id, now)
                    started = dataclasses.replace(job, state=JobState.RUNNING, allocation=a.devices,
                                                  started_at=now)
                    running[job.id] = (started, now + remaining[job.id])
            if not victims:
                break
    top = [j for j in trace if j["priority"] == 9]
    return {
        "makespan_s": now,
        "utilisation": busy_device_s / (now * len(config.inventory)),
        "top_wait_s": sum(first_start[j["id"]] - j["arrival"] for j in top) / len(top),
        "backfilled": backfilled,
        "preempted": preempted,
        "plan_s": plan_s,
        "decisions": decided,
    }
