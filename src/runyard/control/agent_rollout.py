"""The market agent's side of a standing lease's roll-outs: the tenant asked (through the market,
`runyard.market.rollouts`) for another export on its lease; the agent serves it without failing a
request, the way `runyard.control.rollout` does, but as control-plane jobs in the lease's sandbox
and one step at a time, so the agent's loop never blocks on a server that is loading:

1. **start**: the new export is laid out in the lease folder (`exports/r<id>/`: its uploaded files
   written, its URLs fetched by the sandbox launcher, under a policy of its own), and a second job
   serves it beside the running one on its own relay socket (`work/r<id>.sock`). It asks for the
   lease's devices again: a provider rolls out on spare capacity (a surge), never by stopping the old
   server first;
2. **check**: each step looks once at the new server through its socket (`look_at_candidate`:
   `/healthz`, then one real request); a server that exits, fails its first request, or is not
   healthy within `startup_grace_s` is stopped, the endpoint never moves, and the market is told
   `failed` with the server's own words;
3. **switch**: the endpoint moves to the new socket (`Endpoint.switch`, atomic; requests in flight
   finish on the old server), and the record now names the new server as the one serving;
4. **drain**: once nothing is in flight on the old socket (or `drain_timeout_s` passed) the old job
   is stopped and the market told `switched` with the digest of the export now serving.

Every phase is saved in the lease's record before it acts, so an agent killed at any point resumes:
before the switch the old server still serves and the roll-out goes on (the control plane restarts
both jobs); after it, the new one serves and the old one is stopped. Either way exactly one server
is behind the endpoint once the roll-out ends.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from runyard.control.deployment import (
    SERVE_PORT,
    failed_before_serving,
    job_request,
    lay_out,
    log_reason,
    serve_command,
)
from runyard.control.endpoint import Endpoint
from runyard.control.jobs import add_jobs
from runyard.control.lease_job import LeaseFolder
from runyard.control.rollout import export_digest, look_at_candidate
from runyard.control.sandbox import SandboxPolicy, wrap_argv
from runyard.control.states import JobState
from runyard.market.client import MarketClientError
from runyard.system.http_thread import free_port

log = logging.getLogger("runyard.control.agent")
DRAIN_TIMEOUT_S = 60.0  # requests still in flight on the old server after this are cut when it stops


def serving(record: dict) -> dict[str, Any]:
    """The server behind the lease's endpoint now: its job, socket, export folder and export digest
    (the deployment's first job until a roll-out switches)."""
    if "serving" not in record:
        folder = LeaseFolder(Path(record["folder"]))
        record["serving"] = {"job_id": record["job_ids"][0], "socket": str(folder.socket),
                             "export": str(folder.export), "digest": None}
    return record["serving"]


def known_digest(export: str) -> str | None:
    """The digest of a laid-out export, or None while its files are not all there yet."""
    try:
        return export_digest(Path(export))
    except (ValueError, OSError):
        return None


class Rollouts:
    """Roll-outs of the deployments an agent holds (see the module docstring)."""

    def __init__(self, agent: Any, poll_s: float, drain_timeout_s: float = DRAIN_TIMEOUT_S):
        self.agent = agent  # a runyard.control.agent_standing.LeaseHost
        self.poll_s, self.drain_timeout_s = poll_s, drain_timeout_s
        self._polled: dict[int, float] = {}

    def step(self, lease: dict, record: dict, endpoint: Endpoint) -> None:
        """One look at the lease's roll-out: take up a new one, or move the one under way forward."""
        current = record.get("rollout")
        if current is None:
            current = self._next(lease, record)
            if current is None:
                return
        phase = current["phase"]
        if phase == "start":  # killed while starting it: stop what may have started, take it up afresh
            self._abandon_start(lease, record, current)
        elif phase == "report":
            self.report_pending(lease, record)
        elif phase == "check":
            self._check(lease, record, current, endpoint)
        elif phase == "drain":
            self._drain(lease, record, current, endpoint)

    # -- taking one up ----------------------------------------------------------------------------------

    def _next(self, lease: dict, record: dict) -> dict | None:
        lease_id = int(lease["id"])
        if time.monotonic() - self._polled.get(lease_id, -1e9) < self.poll_s:
            return None
        self._polled[lease_id] = time.monotonic()
        try:
            asked = [r for r in self.agent.client.rollouts(lease_id)
                     if r["state"] == "requested" and r["id"] not in record.get("rollouts_ended", [])]
        except MarketClientError as exc:
            log.warning("lease %s: the market did not list its roll-outs: %s", lease_id, exc.message)
            return None
        return self._start(lease, record, asked[0]) if asked else None

    def _start(self, lease: dict, record: dict, asked: dict) -> dict | None:
        agent, rollout_id = self.agent, int(asked["id"])
        folder = LeaseFolder(Path(record["folder"]))
        into = f"exports/r{rollout_id}"
        try:
            fetch = lay_out(folder, asked.get("export") or {}, into=into)
        except (ValueError, OSError) as exc:
            self._end(lease, record, rollout_id, False, None, f"the export cannot be served: {exc}"[:2000])
            return None
        deployment = lease.get("deployment") or {}
        policy_path = folder.root / f"sandbox-r{rollout_id}.json"
        SandboxPolicy(lease_id=int(lease["id"]), root=str(folder.root), fetch=fetch,
                      max_fetch_bytes=agent.settings.max_fetch_bytes,
                      data_networks=list(agent.settings.data_networks),
                      **agent.settings.sandbox_limits(lease["devices"]), pass_env=list(agent.settings.pass_env),
                      unconfined=agent.settings.unconfined).save(policy_path)
        socket = folder.work / f"r{rollout_id}.sock"
        gpu = any(d.startswith("cuda") for d in agent.loop.config.inventory)
        # Unconfined (no network namespace of its own), the new server needs a port of this host.
        port = free_port() if agent.settings.unconfined else SERVE_PORT
        argv = serve_command(folder, deployment, gpu, port, export=folder.root / into, socket=socket)
        request = job_request(lease, wrap_argv(argv, policy_path), folder, agent.priority)
        request["name"] = f"deploy-lease-{int(lease['id'])}-rollout-{rollout_id}"
        current = {"id": rollout_id, "phase": "start", "socket": str(socket), "export": str(folder.root / into),
                   "job_id": None, "since": time.time()}
        record["rollout"] = current
        agent.save_record(record)  # the intent first: a restart finds the roll-out and goes on
        with agent.loop.mutex:
            (job,) = add_jobs(agent.loop.store, [request], agent.loop.config,
                              actor=f"agent:lease-{lease['id']}:rollout-{rollout_id}")
        agent.loop.wake.set()
        current.update(job_id=job.id, phase="check")
        record["job_ids"] = [*record["job_ids"], job.id]  # stopped with the lease's others when it ends
        agent.save_record(record)
        log.info("lease %s: roll-out %s: job %s serves %s beside the running server", lease["id"], rollout_id,
                 job.id, current["export"])
        return current

    def _abandon_start(self, lease: dict, record: dict, current: dict) -> None:
        name = f"deploy-lease-{int(lease['id'])}-rollout-{current['id']}"
        for job in self.agent.loop.store.jobs(lease_id=str(lease["id"])):
            if job.name == name:
                self._stop_job(record, job.id, "its roll-out is taken up again")
        record["rollout"] = None
        self.agent.save_record(record)
        self._polled.pop(int(lease["id"]), None)

    # -- checking the new server ------------------------------------------------------------------------

    def _check(self, lease: dict, record: dict, current: dict, endpoint: Endpoint) -> None:
        job = self.agent.loop.store.get(current["job_id"])
        why = None
        if failed_before_serving(job.state, job.failures, ever_healthy=False):
            why = f"the new server exited before it served: {log_reason(job.log_path)}"
        elif time.time() - current["since"] > self.agent.settings.startup_grace_s:
            why = f"the new server was not healthy within {self.agent.settings.startup_grace_s:g} s"
        elif job.state == JobState.RUNNING:
            seen = look_at_candidate(Path(current["socket"]), timeout_s=30.0)
            if seen.failed:
                why = seen.why
            elif seen.ready:
                digest = known_digest(current["export"])
                previous = dict(serving(record))
                record["serving"] = {"job_id": job.id, "socket": current["socket"], "export": current["export"],
                                     "digest": digest}
                current.update(phase="drain", previous=previous, switched_at=time.time())
                self.agent.save_record(record)  # from here, a restart opens the endpoint on the new server
                endpoint.switch(Path(current["socket"]), digest)
                log.info("lease %s: roll-out %s: the endpoint now serves %s (%s)", lease["id"], current["id"],
                         current["export"], digest)
                return
        if why is not None:
            self._stop_job(record, current["job_id"], "its roll-out failed")
            log.warning("lease %s: roll-out %s failed, the old server keeps serving: %s", lease["id"], current["id"],
                        why)
            self._end(lease, record, current["id"], False, None, why[:2000])

    # -- draining the old one ---------------------------------------------------------------------------

    def _drain(self, lease: dict, record: dict, current: dict, endpoint: Endpoint) -> None:
        previous = current["previous"]
        left = endpoint.in_flight(Path(previous["socket"]))
        if left and time.time() - current["switched_at"] < self.drain_timeout_s:
            return
        self._stop_job(record, previous["job_id"], "a roll-out replaced it")
        old_export = Path(previous["export"])
        if old_export.parent.name == "exports":  # an earlier roll-out's copy; the first export stays
            shutil.rmtree(old_export, ignore_errors=True)
        detail = "switched; the old server drained" if not left else (
            f"switched; {left} request(s) in flight on the old server after {self.drain_timeout_s:g} s were cut")
        self._end(lease, record, current["id"], True, record["serving"]["digest"] or known_digest(current["export"]),
                  detail)

    # -- telling the market -----------------------------------------------------------------------------

    def _end(self, lease: dict, record: dict, rollout_id: int, switched: bool, digest: str | None,
             detail: str) -> None:
        """Report the outcome (kept for the next step if the market does not take it now), then forget it."""
        try:
            self.agent.client.report_rollout(int(lease["id"]), rollout_id, switched=switched, export_digest=digest,
                                             detail=detail, idempotency_key=f"lease-{lease['id']}-rollout-{rollout_id}")
        except MarketClientError as exc:
            if exc.status not in (404, 409):  # the market is away: try again next step
                record["rollout"] = {**(record.get("rollout") or {}), "id": rollout_id, "phase": "report",
                                     "switched": switched, "digest": digest, "detail": detail}
                self.agent.save_record(record)
                log.warning("lease %s: roll-out %s's outcome not taken yet: %s", lease["id"], rollout_id, exc.message)
                return
        record["rollout"] = None
        record["rollouts_ended"] = [*record.get("rollouts_ended", []), rollout_id]
        self.agent.save_record(record)

    def report_pending(self, lease: dict, record: dict) -> None:
        """An outcome the market did not take earlier, sent again."""
        current = record.get("rollout") or {}
        if current.get("phase") == "report":
            self._end(lease, record, current["id"], current["switched"], current["digest"], current["detail"])

    def _stop_job(self, record: dict, job_id: int | None, why: str) -> None:
        if job_id is None:
            return
        job = self.agent.loop.store.get(job_id)
        if not job.state.terminal:
            log.info("lease %s: stopping job %s (%s)", record["lease_id"], job_id, why)
            self.agent.loop.cancel(job_id, actor=f"agent:lease-{record['lease_id']}")
