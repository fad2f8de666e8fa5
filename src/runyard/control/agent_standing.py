"""The market agent's side of standing leases: a model deployed through a lease, kept up, and its
availability reported as signed records.

For an offered standing lease whose demand carries a deployment (`runyard.market.serving`) the agent
- rejects it, with the reason and the escrow returned, when it has no free capacity, when the lease
  carries no deployment, or when the deployment is malformed;
- otherwise lays the export out in the lease's folder, accepts the lease (signing its terms, which
  cover the deployment's digest) and queues one control-plane job that serves it in the sandbox
  (`runyard.control.deployment`), and opens the lease's endpoint (`runyard.control.endpoint`): a
  port of this machine that admits only the tenant's token;
- starts the lease (its first billing period) only once the endpoint answers healthy, and publishes
  the endpoint's URL on the lease; a deployment that fails before it ever served (an export that
  does not load...) ends the lease at once with the server's own words as the reason, so the whole
  escrow returns;
- while it runs, reports what the endpoint saw every usage interval as availability records, split
  at period closes (the market renews the lease or ends it there); a server that dies is restarted
  by the control plane, one that stays unhealthy past `unhealthy_restart_s` is restarted by the
  agent; a deployment whose restarts are spent terminates the lease (the tenant then pays only for
  the time it was available);
- rolls out another export when the tenant asks through the market (`runyard.control.agent_rollout`:
  the new server beside the old one, the endpoint switched once it answers, the old one drained);
- when the lease ends (notice, nonpayment, termination), reports the last interval, stops the job
  and closes the endpoint.

Every step is kept in the lease's record (`<state dir>/agent/lease-<id>.json`), so a restarted daemon
opens the endpoint again on the same port and goes on reporting where it stopped.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from runyard.control.agent_rollout import Rollouts, known_digest, serving
from runyard.control.deployment import (
    SERVE_PORT,
    failed_before_serving,
    job_request,
    lay_out,
    log_reason,
    report_windows,
    serve_command,
    should_restart,
)
from runyard.control.endpoint import Endpoint, Window
from runyard.control.lease_job import LeaseFolder
from runyard.control.loop import ControlLoop
from runyard.control.sandbox import SandboxPolicy, wrap_argv
from runyard.control.server import capacity
from runyard.control.states import JobState
from runyard.market.client import MarketClient, MarketClientError
from runyard.system.http_thread import free_port

log = logging.getLogger("runyard.control.agent")
ENDED = ("window_closed", "terminated", "settled", "cancelled", "expired", "rejected")


class LeaseHost(Protocol):
    """What the deployments need of the agent that holds their leases (runyard.control.agent.MarketAgent):
    the control plane's loop, the market client, the agent's settings and folder, and the four steps of a
    lease's record, each of which the agent also takes for its batch leases."""

    loop: ControlLoop
    client: MarketClient
    settings: Any  # runyard.control.agent.LeaseJobSettings
    dir: Path
    priority: int
    usage_interval_s: float

    def save_record(self, record: dict[str, Any]) -> None: ...

    def queue_jobs(self, record: dict) -> None: ...

    def stop_jobs(self, record: dict, why: str) -> None: ...

    def finish_lease(self, record: dict) -> None: ...


class Deployments:
    """Standing leases with a deployment, for the agent that holds them (a `LeaseHost`)."""

    def __init__(self, agent: LeaseHost):
        self.agent = agent
        self.endpoints: dict[int, Endpoint] = {}
        self.rollouts = Rollouts(agent, poll_s=agent.usage_interval_s)

    @property
    def settings(self):  # type: ignore[no-untyped-def]
        return self.agent.settings

    # -- offered --------------------------------------------------------------------------------------

    def consider(self, lease: dict) -> None:
        agent, lease_id = self.agent, int(lease["id"])
        free = len(capacity(agent.loop)["free"])
        if lease["devices"] > free:
            agent.client.reject_lease(lease_id, "capacity_unavailable", f"{lease['devices']} devices asked, {free} free")
            return
        deployment = lease.get("deployment")
        if not isinstance(deployment, dict):
            agent.client.reject_lease(lease_id, "other", "a standing lease here serves a deployment; the demand "
                                                         "carries none")
            return
        folder = LeaseFolder(agent.dir / f"lease-{lease_id}")
        try:
            fetch = lay_out(folder, deployment)
        except (ValueError, OSError) as exc:
            shutil.rmtree(folder.root, ignore_errors=True)
            agent.client.reject_lease(lease_id, "other", f"the deployment cannot be served: {exc}"[:2000])
            return
        gpu = any(d.startswith("cuda") for d in agent.loop.config.inventory)
        SandboxPolicy(lease_id=lease_id, root=str(folder.root), fetch=fetch,
                      max_fetch_bytes=self.settings.max_fetch_bytes, data_networks=list(self.settings.data_networks),
                      **self.settings.sandbox_limits(lease["devices"]), pass_env=list(self.settings.pass_env),
                      unconfined=self.settings.unconfined).save(folder.policy)
        # Unconfined (no sandbox, no network namespace of its own), the server needs a port of this host.
        port = free_port() if self.settings.unconfined else SERVE_PORT
        argv = wrap_argv(serve_command(folder, deployment, gpu, port), folder.policy)
        record = {"kind": "deployment", "lease_id": lease_id, "demand_id": lease["demand_id"],
                  "tenant_id": lease["tenant_id"], "folder": str(folder.root),
                  "requests": [job_request(lease, argv, folder, agent.priority)], "job_ids": [], "seq": 0,
                  "last_end": None, "token_sha256": deployment["token_sha256"], "endpoint_port": None,
                  "published": None, "started": False, "finished": False}
        agent.save_record(record)  # our intent, before accepting: a restart resumes from here
        agent.client.accept_lease(lease_id)
        agent.queue_jobs(record)

    # -- accepted and running -------------------------------------------------------------------------

    def endpoint(self, record: dict) -> Endpoint:
        """The lease's endpoint, opened (again, on its port, after a restart) if it is not open."""
        lease_id = int(record["lease_id"])
        if lease_id not in self.endpoints:
            made = None
            now_serving = serving(record)  # the first server, or the one a roll-out switched to
            for port in dict.fromkeys((record.get("endpoint_port"), None)):  # its own port again, else a new one
                try:
                    made = Endpoint(Path(now_serving["socket"]), record["token_sha256"],
                                    host=self.settings.endpoint_host, port=port,
                                    probe_interval_s=self.settings.probe_interval_s,
                                    export_digest=now_serving["digest"]).start()
                    break
                except RuntimeError as exc:
                    log.warning("lease %s: the endpoint could not open on port %s: %s", lease_id, port, exc)
            if made is None:
                raise RuntimeError(f"lease {lease_id}: no port for its endpoint on {self.settings.endpoint_host}")
            self.endpoints[lease_id] = made
            if record.get("endpoint_port") != made.port:
                record["endpoint_port"] = made.port
                self.agent.save_record(record)
        return self.endpoints[lease_id]

    def url(self, endpoint: Endpoint) -> str:
        return f"http://{self.settings.endpoint_public_host or self.settings.endpoint_host}:{endpoint.port}"

    def follow(self, lease: dict, record: dict, now: int) -> None:
        agent = self.agent
        if not record["job_ids"]:
            agent.queue_jobs(record)
        job = agent.loop.store.get(serving(record)["job_id"])
        endpoint = self.endpoint(record)
        self._name_export(record, endpoint)
        if record.get("published") != self.url(endpoint):
            agent.client.publish_endpoint(lease["id"], self.url(endpoint))
            record["published"] = self.url(endpoint)
            agent.save_record(record)
        if lease["state"] == "accepted":
            if endpoint.ever_healthy and job.state == JobState.RUNNING:
                endpoint.take()  # the probes while the server loaded belong to no period
                agent.client.start_lease(lease["id"])
                record["started"] = True
                agent.save_record(record)
                log.info("lease %s: deployment serving at %s", lease["id"], record["published"])
            elif failed_before_serving(job.state, job.failures, endpoint.ever_healthy):
                why = log_reason(job.log_path)
                agent.stop_jobs(record, "the deployment did not start")
                agent.client.start_lease(lease["id"])
                agent.client.terminate_lease(lease["id"], "job_failed", f"the deployment did not start: {why}"[:2000])
                self.close(record)
            return
        record["started"] = True
        due = record["last_end"] is None or now - record["last_end"] >= agent.usage_interval_s
        if due:
            self.report(lease, record, min(now, lease["window_end"]))
        if job.state.terminal:
            self.report(lease, record, min(now, lease["window_end"]))
            why = f"job {job.id} {job.state}: {job.detail or log_reason(job.log_path)}"
            agent.client.terminate_lease(lease["id"], "job_failed", f"the deployment stopped: {why}"[:2000])
            self.close(record)
            return
        unhealthy_for = endpoint.consecutive_failures * self.settings.probe_interval_s
        if should_restart(job.state, job.attempt_started_at, unhealthy_for, time.time(),
                          self.settings.startup_grace_s, self.settings.unhealthy_restart_s):
            log.warning("lease %s: the deployment failed its probes for %.0f s; restarting it", lease["id"],
                        unhealthy_for)
            agent.loop.requeue(job.id, actor=f"agent:lease-{lease['id']}")
        if lease["state"] == "running":
            self.rollouts.step(lease, record, endpoint)

    def _name_export(self, record: dict, endpoint: Endpoint) -> None:
        """Once the first export's files are all there, its digest names every answer (X-Runyard-Export)."""
        now_serving = serving(record)
        if now_serving["digest"] is None:
            now_serving["digest"] = known_digest(now_serving["export"])
            if now_serving["digest"] is not None:
                self.agent.save_record(record)
                endpoint.name_export(Path(now_serving["socket"]), now_serving["digest"])

    def report(self, lease: dict, record: dict, end: int) -> None:
        """Report what the endpoint saw from the last record to `end`, one record per period part."""
        start = record["last_end"] if record["last_end"] is not None else lease["started_at"]
        if start is None or end <= start:
            return
        endpoint = self.endpoint(record)
        seen = endpoint.take()
        parts = report_windows(start, end, lease["started_at"], lease["period_s"], seen)
        for i, part in enumerate(parts):
            seq = record["seq"] + 1
            try:
                self.agent.client.report_availability(
                    lease["id"], seq, part.start, part.end, part.available_seconds, part.probes, part.probes_ok,
                    part.requests, part.latency_p50_ms, part.latency_p99_ms,
                    idempotency_key=f"lease-{lease['id']}-availability-{seq}")
            except MarketClientError:
                endpoint.put_back(_rest(parts[i:]))  # the market did not take them: counted next time
                raise
            record.update(seq=seq, last_end=part.end)
            self.agent.save_record(record)

    # -- ended ----------------------------------------------------------------------------------------

    def ended(self, lease: dict, record: dict) -> None:
        """The lease is over: the last interval reported (while the market still takes it), the server
        stopped, the endpoint closed."""
        if record.get("finished"):
            return
        if record.get("started") and lease.get("window_end") is not None:
            try:
                self.report(lease, record, lease["window_end"])
            except MarketClientError as exc:
                log.warning("lease %s: the last availability record was refused: %s", lease["id"], exc.message)
        self.agent.stop_jobs(record, f"the lease is {lease['state']}")
        self.close(record)

    def close(self, record: dict) -> None:
        endpoint = self.endpoints.pop(int(record["lease_id"]), None)
        if endpoint is not None:
            endpoint.stop()
        self.agent.finish_lease(record)

    def stop_all(self) -> None:
        """The daemon is stopping: close the endpoints (they open again when it restarts)."""
        for endpoint in self.endpoints.values():
            endpoint.stop()
        self.endpoints.clear()


def _rest(parts: list) -> Window:  # type: ignore[type-arg]
    return Window(probes=sum(p.probes for p in parts), probes_ok=sum(p.probes_ok for p in parts),
                  requests=sum(p.requests for p in parts))

