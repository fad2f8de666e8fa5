"""The control loop: each tick reaps ended attempts, restarts, cancels, preempts and starts jobs.

Every decision is written as a state transition (store.transition) before it is acted on; a
scheduling round commits all its decisions in one transaction, then acts on them. The loop and the
HTTP handlers share `mutex`, so a tick sees a consistent queue.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from runyard.control import procs, scheduler
from runyard.control.backends.base import Backend, Ended, Requeued
from runyard.control.retry import RetryPolicy, decide
from runyard.control.states import FailureReason, JobState, classify_exit
from runyard.control.store import Change, Job, JobStore, QueuedJob

log = logging.getLogger("runyard.control")
S = JobState
ACTOR = "control-loop"
HOLDING = [s for s in JobState if s.holds_devices]  # in enum order: a stable SQL query


@dataclass
class ControlConfig:
    state_dir: Path
    inventory: list[str]
    max_concurrent: int | None = None
    tenant_quotas: dict[str, int] = field(default_factory=dict)
    preemption: bool = True
    backfill: bool = True
    stop_grace_s: float = 60.0  # SIGTERM -> SIGKILL for preemption and cancel
    tick_s: float = 0.2
    retry_policy: RetryPolicy = field(default_factory=RetryPolicy)


class ControlLoop:
    def __init__(self, config: ControlConfig, store: JobStore, backend: Backend):
        self.config, self.store, self.backend = config, store, backend
        self.instance = procs.instance_id(config.state_dir)
        self.mutex = threading.RLock()
        self.wake = threading.Event()
        self.sched_config = scheduler.SchedulerConfig(
            inventory=config.inventory,
            max_concurrent=config.max_concurrent,
            tenant_quotas=config.tenant_quotas,
            preemption=config.preemption,
            backfill=config.backfill,
        )

    # -- the loop -------------------------------------------------------------------------------

    def run_forever(self, stop: threading.Event) -> None:
        """Tick until `stop` is set. Call reconcile() once before, after a (re)start."""
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # keep the daemon alive; the error is in its log
                log.exception("control loop tick failed")
            self.wake.wait(self.config.tick_s)
            self.wake.clear()

    def tick(self) -> None:
        with self.mutex:
            now = time.time()
            for job in self.store.jobs(HOLDING):
                self._watch(job, now)
            self.act(self.decide(time.time()))

    # -- restart after a daemon crash -------------------------------------------------------------

    def reconcile(self) -> None:
        """Match recorded state with what really runs. Launch intents that never launched go back
        to the queue; attempts launched but never recorded are adopted; nothing starts twice."""
        with self.mutex:
            for job in self.store.jobs([S.STARTING, S.RECOVERING]):
                if job.state == S.RECOVERING and job.next_start_at is not None:
                    continue  # still waiting out its backoff; no launch was intended yet
                if job.backend_id is not None or job.pid is not None:
                    continue  # launched and recorded; the normal watch takes it from here
                found = self.backend.adopt(job)
                if found is not None:
                    self.store.transition(
                        job.id, S.RUNNING, actor="reconcile", reason="found its attempt alive after a restart",
                        pid=found.pid, pid_start_time=found.pid_start_time, backend_id=found.backend_id,
                    )
                elif job.state == S.STARTING:
                    self.store.transition(
                        job.id, S.PENDING, actor="reconcile",
                        reason="the daemon stopped before launching it; queued again", allocation=[],
                        attempt=job.attempt - 1,
                    )
                else:
                    self.store.update(job.id, next_start_at=time.time())

    # -- watching attempts ------------------------------------------------------------------------

    def _watch(self, job: Job, now: float) -> None:
        if job.state == S.RECOVERING and job.pid is None and job.backend_id is None:
            if job.next_start_at is not None and now >= job.next_start_at:
                self._launch(job, relaunch=True)  # same allocation, next attempt
            return
        if job.state == S.CANCELLING and job.pid is None and job.backend_id is None:
            self.store.transition(job.id, S.CANCELLED, actor=ACTOR, reason="nothing was running", **self._release(job))
            return
        if job.state == S.STARTING and job.pid is None and job.backend_id is None:
            return  # a launch in flight in this tick's caller; never happens across ticks
        outcome = self.backend.poll(job)
        if outcome is None:
            if job.state in (S.STARTING, S.RECOVERING) and self.backend.is_running(job):
                self.store.transition(job.id, S.RUNNING, actor=ACTOR, reason="the cluster started it",
                                      attempt_started_at=now)
            elif (job.state in (S.PREEMPTED, S.CANCELLING) and job.signalled_at is not None
                  and now - job.signalled_at > self.config.stop_grace_s):
                self.backend.kill(job)
            return
        if isinstance(outcome, Requeued):
            if job.state == S.RUNNING:
                self.store.transition(job.id, S.RECOVERING, actor="cluster", reason=outcome.detail,
                                      restart_count=job.restart_count + 1, **self._usage(job, now))
            return
        self._ended(job, outcome, now)

    def _usage(self, job: Job, now: float) -> dict:
        """Device-seconds of the attempt that just ended, added to the job's total."""
        if job.attempt_started_at is None:
            return {}
        return {"device_seconds": job.device_seconds + job.devices * max(0.0, now - job.attempt_started_at),
                "attempt_started_at": None}

    def _release(self, job: Job) -> dict:
        # backend_id stays: `job show` can name the Slurm job of the last attempt.
        return {"allocation": [], "pid": None, "pid_start_time": None, "ended_at": time.time(),
                "signalled_at": None, **self._usage(job, time.time())}

    def _ended(self, job: Job, out: Ended, now: float) -> None:
        code = out.returncode
        if job.state in (S.STARTING, S.RECOVERING):
            # A short attempt can start and end between two polls (Slurm forgets it quickly): record
            # that it ran, so the state machine's path stays starting -> running -> outcome.
            job = self.store.transition(job.id, S.RUNNING, actor=ACTOR, reason="ran and ended between two polls",
                                        attempt_started_at=job.attempt_started_at or now)
        if job.state == S.CANCELLING:
            self.store.transition(job.id, S.CANCELLED, actor=ACTOR, reason=f"stopped (exit {code}, signal {out.signal})",
                                  exit_code=code, **self._release(job))
            return
        outcome, failure = classify_exit(code, out.signal)
        if out.lost:
            outcome, failure = None, FailureReason.INFRA
        if outcome == S.SUCCEEDED:
            self.store.transition(job.id, S.SUCCEEDED, actor=ACTOR, reason="exit 0", exit_code=0,
                                  **self._release(job))
            return
        preempted = job.state == S.PREEMPTED
        if outcome == S.PENDING or (preempted and failure in (FailureReason.INFRA, None)):
            if not preempted:
                job = self.store.transition(job.id, S.PREEMPTED, actor=ACTOR,
                                            reason="exited 4 (checkpointed) without being asked")
            why = "checkpointed and exited 4" if code == 4 else f"stopped for preemption ({out.detail or code})"
            self.store.transition(job.id, S.PENDING, actor=ACTOR, reason=f"{why}; queued to resume",
                                  exit_code=code, **self._release(job))
            return
        assert failure is not None
        self._failed(job, failure, code, out.detail or (f"signal {out.signal}" if out.signal else f"exit {code}"), now)

    def _failed(self, job: Job, failure: FailureReason, code: int | None, detail: str, now: float) -> None:
        failures = [*job.failures, [now, str(failure)]]
        policy = RetryPolicy.from_dict(job.retry_policy) if job.retry_policy else self.config.retry_policy
        decision = decide(policy, failure, code, failures, now)
        if decision.retry:
            self.store.transition(
                job.id, S.RECOVERING, actor=ACTOR,
                reason=f"{failure}: {detail}; restarting from the last checkpoint in {decision.delay_s:g}s",
                failures=failures, exit_code=code, next_start_at=now + decision.delay_s,
                pid=None, pid_start_time=None, backend_id=None, signalled_at=None, **self._usage(job, now),
            )
            return
        self.store.transition(job.id, S.FAILED, actor=ACTOR, reason=decision.final_reason, failures=failures,
                              exit_code=code, detail=decision.final_reason, failure=str(failure),
                              **self._release(job))

    # -- dependencies ------------------------------------------------------------------------------

    def _fail_orphaned_dependents(self, pending: list[QueuedJob]) -> list[QueuedJob]:
        """Fail pending jobs whose dependency ended badly; return the pending jobs left."""
        if not any(j.depends_on is not None for j in pending):
            return pending
        # One id query per tick rather than a row read per dependent job: most dependencies are fine.
        ended_badly = self.store.ids_in([S.FAILED, S.CANCELLED])
        left = []
        for job in pending:
            if job.depends_on not in ended_badly:  # also None: no dependency
                left.append(job)
            else:
                dep = self.store.get(job.depends_on)
                why = f"job {dep.id} ({dep.name}) it depends on ended {dep.state}" + (
                    f": {dep.failure}" if dep.failure else "")
                self.store.transition(job.id, S.FAILED, actor=ACTOR, reason=why, detail=why, ended_at=time.time(),
                                      failure=str(FailureReason.DEPENDENCY_FAILED))
        return left

    def _eligible(self, pending: list[QueuedJob]) -> list[QueuedJob]:
        if not any(j.depends_on for j in pending):
            return pending
        done = self.store.ids_in([S.SUCCEEDED])
        return [j for j in pending if j.depends_on is None or j.depends_on in done]

    # -- scheduling and launching -----------------------------------------------------------------

    def decide(self, now: float) -> list[tuple[scheduler.Start | scheduler.Preempt, Job]]:
        """One scheduling round: read the queue, plan, and commit every decision in one transaction
        (jobs to start are `starting` with their devices, victims `preempted`, impossible requests
        `failed`). Returns what `act` must do, each with its job as committed. Nothing is acted on."""
        pending = self._eligible(self._fail_orphaned_dependents(self.store.queue()))
        if not pending:
            return []
        holders = self.store.jobs(HOLDING)
        if self.backend.allocates_itself:
            # The cluster allocates: hand jobs over in queue order, up to the concurrency cap.
            room = (self.config.max_concurrent or 10**9) - len(holders)
            actions: list = [scheduler.Start(job.id, []) for job in pending[: max(0, room)]]
        else:
            actions = scheduler.plan(self.sched_config, pending, holders, now)
        if not actions:
            return []
        by_id = {job.id: job for job in pending}
        signalled = time.time()
        changes = []
        for action in actions:
            if isinstance(action, scheduler.Reject):
                changes.append(Change(action.job_id, S.FAILED, "scheduler", action.detail, fields=dict(
                    detail=action.detail, failure=str(FailureReason.NO_CAPACITY), ended_at=signalled)))
            elif isinstance(action, scheduler.Preempt):
                changes.append(Change(action.job_id, S.PREEMPTED, "scheduler",
                                      f"preempted by higher-priority job {action.for_job}", expect=[S.RUNNING],
                                      fields=dict(signalled_at=signalled)))
            else:
                changes.append(self._start_change(by_id[action.job_id], action.devices, signalled))
        committed = self.store.apply(changes)
        return [(action, job) for action, job in zip(actions, committed, strict=True)
                if not isinstance(action, scheduler.Reject)]

    def act(self, decided: list[tuple[scheduler.Start | scheduler.Preempt, Job]]) -> None:
        """Carry out a round's committed decisions: signal the victims, launch the starts."""
        for action, job in decided:
            if isinstance(action, scheduler.Preempt):
                self.backend.terminate(job)
            else:
                self._launch(job, relaunch=False)

    @staticmethod
    def _start_change(job: QueuedJob, devices: list[str], now: float) -> Change:
        return Change(job.id, S.STARTING, "scheduler", f"allocated {','.join(devices) or 'by the cluster'}",
                      expect=[S.PENDING], fields=dict(
                          allocation=devices, attempt=job.attempt + 1, restart_count=job.attempt,
                          started_at=job.started_at or now, ended_at=None, exit_code=None, pid=None,
                          pid_start_time=None, backend_id=None))

    def _launch(self, job: Job, relaunch: bool) -> None:
        if relaunch:  # the intent (next attempt, no backoff pending) is written before launching
            job = self.store.update(job.id, attempt=job.attempt + 1, restart_count=job.attempt, next_start_at=None)
        try:
            # Nothing of an earlier attempt may run beside this one (a worker that outlived its launcher
            # would write the same run directory; a data worker would hold the data cache's lock).
            leftovers = self.backend.kill_leftovers(job)
            if leftovers:
                log.warning("job %s: ended %s left by an earlier attempt", job.id, ", ".join(leftovers))
            launched = self.backend.launch(job, self.job_env(job))
        except Exception as exc:  # could not start at all: the provider's problem
            log.exception("launch of job %s failed", job.id)
            self._failed(job, FailureReason.INFRA, None, f"launch failed: {exc}", time.time())
            return
        running = self.backend.is_running(job)
        fields = dict(pid=launched.pid, pid_start_time=launched.pid_start_time, backend_id=launched.backend_id)
        if running:
            fields["attempt_started_at"] = time.time()
            self.store.transition(job.id, S.RUNNING, actor=ACTOR, reason=f"launched attempt {job.attempt}", **fields)
        else:  # queued in the cluster; the watch moves it to running when the cluster starts it
            self.store.update(job.id, **fields)

    def job_env(self, job: Job) -> dict[str, str]:
        """The environment of an attempt: the daemon's, the job's, and what the control plane tells it."""
        env = dict(os.environ)
        env.update(job.env)
        cuda = [d.split(":", 1)[1] for d in job.allocation if d.startswith("cuda:")]
        env.update(
            RUNYARD_CONTROL_JOB=procs.marker(self.instance, job.id, job.attempt),
            RUNYARD_JOB_ID=str(job.id),
            RUNYARD_RESTART_COUNT=str(job.restart_count),
            RUNYARD_RUN_DIR=job.run_dir,
            RUNYARD_DEVICES=",".join(job.allocation),
            CUDA_VISIBLE_DEVICES=",".join(cuda),
        )
        if job.allocation and not cuda:  # CPU slots: one thread per slot
            env["OMP_NUM_THREADS"] = str(len(job.allocation))
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    # -- requests from users (called by the API under the mutex) ------------------------------------

    def cancel(self, job_id: int, actor: str) -> Job:
        with self.mutex:
            job = self.store.get(job_id)
            if job.state == S.PENDING:
                return self.store.transition(job_id, S.CANCELLED, actor=actor, reason="cancelled while queued",
                                             ended_at=time.time())
            if job.state.terminal or job.state == S.CANCELLING:
                return job
            job = self.store.transition(job_id, S.CANCELLING, actor=actor, reason="cancel requested",
                                        signalled_at=time.time())
            self.backend.terminate(job)
            self.wake.set()
            return job

    def requeue(self, job_id: int, actor: str) -> Job:
        """A finished job goes back to the queue with fresh budgets; a running one is preempted."""
        with self.mutex:
            job = self.store.get(job_id)
            if job.state.terminal:
                self.store.transition(job_id, S.PENDING, actor=actor, reason="requeued by a user",
                                      failures=[], detail=None, failure=None, ended_at=None)
            elif job.state == S.RUNNING:
                job = self.store.transition(job_id, S.PREEMPTED, actor=actor, reason="requeued by a user",
                                            signalled_at=time.time())
                self.backend.terminate(job)
            self.wake.set()
            return self.store.get(job_id)
