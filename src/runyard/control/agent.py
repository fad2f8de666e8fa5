"""The market agent: links this control plane to the market.

Each round it
- accepts offered leases whose job it can run on free capacity (signing the terms with the
  provider's key), or rejects them with a reason (no capacity, no job, a job spec that is invalid),
- submits each accepted lease's job to the local queue and starts the lease once the job runs,
- reports usage as signed records at a fixed interval: the device-seconds the job really held,
  with a digest of the run's metrics as evidence,
- when the job ends, hands the run directory's results to the tenant (locally: a directory),
  terminates the lease if the job failed, and closes it when its window ends (cancelling a job
  still running then),
- reports a lease whose job could not start (terminated with `job_failed`, so the market returns
  the escrow).

Where the job comes from: the demand's job, which the market shows on the lease to its parties
(`lease["job"]` = {"spec", "results_to", "files", "data_urls", "env_lock", "init_export"}, see
`runyard.market.jobs`). It is laid out in the lease's folder `<state dir>/agent/lease-<id>/` (see
`runyard.control.lease_job`): the spec, the uploaded files, the export it starts from (its URLs
fetched by the sandbox launcher), and the spec the job runs, whose data paths are the lease's own
files or local copies of its data URLs and whose `model.init.path` is the lease's copy of the export. A spec that names anything else (a provider path, a URL
the demand does not name, a cache or store outside the lease) gets the lease rejected with the
reason before any work. A lease without a job falls back to the local drop directory
`<lease_jobs>/demand-<demand id>/spec.yaml` (its other files are the job's data), with results
delivered to `<lease_jobs>/demand-<demand id>/results/`.

Every attempt runs inside the sandbox (`runyard.control.sandbox`): only the lease's work folder
writable, no provider files, environment or network. When the sandbox launcher cannot run the job
(a data URL that cannot be fetched, ...) the lease ends with its reason. Results are the run's
eval/, export/, spec.yaml, manifest.json, data/report.*, stages/*/gates.json and metrics, never
its checkpoints, copied atomically and never through a link (see `runyard.control.delivery`); a
`results_to` this agent cannot deliver to (another URL scheme, a directory holding other files)
gets the lease rejected before any work.

Standing leases (serving capacity, `runyard.market.standing`) carry a deployment instead of a job:
the agent serves it through the lease and reports its availability (`runyard.control.agent_standing`).

What it has done for each lease is kept in `<state dir>/agent/lease-<id>.json` (written
atomically), so a restarted daemon neither accepts twice nor reports the same usage twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runyard.control import limits as job_limits
from runyard.control.agent_standing import ENDED, Deployments
from runyard.control.delivery import deliver_results, delivery_target, metrics_digest
from runyard.control.disk_quota import DiskShort, check_floor
from runyard.control.disk_quota import release as release_disk
from runyard.control.jobs import add_jobs, requests_for_spec
from runyard.control.lease_env import check_lock
from runyard.control.lease_job import (
    LeaseFolder,
    copy_drop_folder,
    runnable_spec,
    url_files,
    write_env_lock,
    write_files,
    write_init_export,
    write_runnable_spec,
)
from runyard.control.lease_retention import DEFAULT_KEEP_FINISHED_S, remove_expired_folders
from runyard.control.sandbox import SandboxPolicy, wrap_argv
from runyard.control.server import capacity
from runyard.control.states import JobState
from runyard.control.store import Job
from runyard.errors import RunyardError
from runyard.market.client import MarketClient
from runyard.market.jobs import MAX_JOB_FILES_BYTES, check_data_urls, decode_files
from runyard.reproduce.env_cache import prune as prune_environments
from runyard.spec.job import load_spec
from runyard.system.files import atomic_write_text

log = logging.getLogger("runyard.control.agent")
LEASE_PRIORITY = 100  # paid market work goes ahead of the provider's own best-effort jobs
RETENTION_SWEEP_S = 60.0  # how often finished leases' folders are checked against their retention
ENV_UNUSED_PRUNE_S = 30 * 86400.0  # a lease job's built environment no job has used this long is removed
DEFAULT_DISK_PER_DEVICE = 50 << 30
DEFAULT_DISK_FILES_PER_DEVICE = 1_000_000
DEFAULT_DISK_FLOOR_BYTES = 5 << 30


@dataclass
class LeaseJobSettings:
    """The operator's settings for lease jobs (see `runyard control start --help`)."""

    unconfined: bool = False  # run them without the sandbox (only where bubblewrap cannot run)
    data_networks: list[str] = field(default_factory=list)  # CIDRs data URLs may reach besides public addresses
    max_fetch_bytes: int = 1 << 30  # the most a lease's data URLs may hold in all
    memory_per_device: int | None = None  # default: this machine's memory over its devices
    max_file_bytes: int | None = None  # the largest file a lease job may write (RLIMIT_FSIZE); default its disk quota
    # Each lease's disk quota (its work folder: run directory, HOME, TMPDIR, caches), per device it
    # holds, and the free space the provider keeps whatever its leases write (runyard.control.disk_quota).
    disk_per_device: int = DEFAULT_DISK_PER_DEVICE
    disk_files_per_device: int = DEFAULT_DISK_FILES_PER_DEVICE
    disk_floor_bytes: int = DEFAULT_DISK_FLOOR_BYTES
    disk_kernel: bool = True  # a loop-mounted filesystem per lease where the launcher is root; else a watchdog
    pass_env: list[str] = field(default_factory=list)  # daemon variables a lease job may see
    # Deployments (standing leases): where their endpoints listen, the host named in their URLs
    # (default: the one they listen on), and how they are watched.
    endpoint_host: str = "127.0.0.1"
    endpoint_public_host: str | None = None
    probe_interval_s: float = 5.0
    unhealthy_restart_s: float = 60.0  # failing probes this long, a live server is restarted
    startup_grace_s: float = 300.0  # ... unless its attempt is younger than this (loading its model)
    env_cache: str | None = None  # where environments from jobs' locks are built (default: STATE_DIR/envs)
    keep_finished_s: float = DEFAULT_KEEP_FINISHED_S  # a finished lease's folder stays this long, then goes

    def sandbox_limits(self, devices: int) -> dict[str, Any]:
        """A lease's limits, as SandboxPolicy fields: memory, the per-file bound (on by default: its
        disk quota, since no file can be larger than that), the disk quota and the floor."""
        disk = self.disk_per_device * max(1, devices)
        return {"memory_bytes": (self.memory_per_device or 0) * devices or None,
                "max_file_bytes": min(self.max_file_bytes or disk, disk), "disk_bytes": disk,
                "disk_files": self.disk_files_per_device * max(1, devices),
                "disk_floor_bytes": self.disk_floor_bytes, "disk_kernel": self.disk_kernel}


class MarketAgent:
    def __init__(self, loop, market_url: str, provider_key: str | None, usage_interval_s: float = 30.0,
                 lease_jobs: str | Path | None = None, poll_s: float = 1.0, client=None,
                 deliveries_root: str | Path | None = None, settings: LeaseJobSettings | None = None):
        self.loop = loop
        self.client = client or MarketClient.from_identity_file(provider_key, base_url=market_url)
        self.usage_interval_s = usage_interval_s
        self.poll_s = min(poll_s, usage_interval_s)
        state_dir = Path(loop.config.state_dir)
        self.lease_jobs = Path(lease_jobs) if lease_jobs else state_dir / "lease-jobs"
        # A tenant names where its results go, but only inside these folders: a lease can never make
        # the provider's agent write anywhere else on the provider's machine.
        self.deliveries_root = Path(deliveries_root) if deliveries_root else state_dir / "deliveries"
        self.delivery_roots = (self.deliveries_root, self.lease_jobs)
        self.settings = settings or LeaseJobSettings()
        if self.settings.memory_per_device is None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            self.settings.memory_per_device = total // max(1, len(loop.config.inventory))
        self.dir = state_dir / "agent"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.priority = LEASE_PRIORITY
        self.env_cache = Path(self.settings.env_cache) if self.settings.env_cache else state_dir / "envs"
        self.deployments = Deployments(self)
        self._thread: threading.Thread | None = None
        self._swept_at = float("-inf")  # when finished leases' folders were last looked at

    # -- thread -----------------------------------------------------------------------------------

    def start(self, stop: threading.Event) -> None:
        self._thread = threading.Thread(target=self._run, args=(stop,), name="market-agent", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        self.deployments.stop_all()

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.step()
            except Exception:  # the market may be down for a while; try again next round
                log.exception("market agent round failed")
            stop.wait(self.poll_s)

    # -- one round --------------------------------------------------------------------------------

    def step(self) -> None:
        now = self.client.market_info()["now"]
        for lease in self.client.leases(state="offered"):
            if lease.get("form") == "standing":
                if self._record(lease["id"]) is None:
                    self.deployments.consider(lease)
            else:
                self._consider(lease)
        for lease in self.client.leases(state="accepted") + self.client.leases(state="running"):
            record = self._record(lease["id"])
            if record is not None and record.get("kind") == "deployment":
                self.deployments.follow(lease, record, now)
            elif record is not None:
                self._follow(lease, record, now)
        for state in ENDED:
            for lease in self.client.leases(state=state):
                record = self._record(lease["id"])
                if record is None or record.get("finished"):
                    continue
                if record.get("kind") == "deployment":
                    self.deployments.ended(lease, record)
                elif state in ("terminated", "cancelled", "expired"):
                    self.stop_jobs(record, f"the lease was {state}")
                    self.finish_lease(record)
        if time.monotonic() - self._swept_at >= RETENTION_SWEEP_S:
            self._swept_at = time.monotonic()
            for lease_id in remove_expired_folders(self.dir, self.settings.keep_finished_s, time.time()):
                log.info("lease %s: its folder was removed (finished more than %gs ago)", lease_id,
                         self.settings.keep_finished_s)
            for env in prune_environments(self.env_cache, ENV_UNUSED_PRUNE_S, time.time()):
                log.info("lease environment %s removed (%d MB, unused for %g days)", env.key, env.size_bytes >> 20,
                         ENV_UNUSED_PRUNE_S / 86400)

    def _consider(self, lease: dict) -> None:
        if self._record(lease["id"]) is not None:
            return  # already decided (e.g. accepted before a restart; the market will show it soon)
        free = len(capacity(self.loop)["free"])
        if lease["devices"] > free:
            self.client.reject_lease(lease["id"], "capacity_unavailable",
                                     f"{lease['devices']} devices asked, {free} free")
            return
        limits = self.settings.sandbox_limits(lease["devices"])
        try:  # the disk must be above the floor (watched again while the job runs)
            check_floor(self.dir, 0, limits["disk_floor_bytes"])
        except DiskShort as exc:
            self.client.reject_lease(lease["id"], "capacity_unavailable", str(exc)[:2000])
            return
        try:
            found = self._job_of(lease)
            if found is None:
                return  # its job has not arrived yet; the market expires the lease if it never does
            folder, results_to, data_urls = found
            init_fetch = write_init_export(folder, (lease.get("job") or {}).get("init_export"))
            spec = load_spec(folder.spec)
            run_spec = runnable_spec(yaml.safe_load(folder.spec.read_text(encoding="utf-8")), folder, data_urls,
                                     init_export=folder.init_export.is_dir())
            write_runnable_spec(folder, run_spec)
            delivery_target(results_to, tenant=lease["tenant_id"], roots=self.delivery_roots)
            locked = folder.env_lock.is_dir()
            if locked:
                check_lock(folder.env_lock)  # a lock this machine cannot install: refused before any work
        except (RunyardError, OSError, ValueError) as exc:
            # Nothing of a refused lease stays here: neither the tenant's spec nor its data.
            shutil.rmtree(self.dir / f"lease-{int(lease['id'])}", ignore_errors=True)
            self.client.reject_lease(lease["id"], "other", f"the lease's job cannot run: {exc}"[:2000])
            return
        SandboxPolicy(lease_id=int(lease["id"]), root=str(folder.root), data_urls=url_files(data_urls),
                      fetch=init_fetch, max_fetch_bytes=self.settings.max_fetch_bytes,
                      data_networks=list(self.settings.data_networks),
                      **limits, pass_env=list(self.settings.pass_env), unconfined=self.settings.unconfined,
                      env_lock=str(folder.env_lock) if locked else None,
                      env_cache=str(self.env_cache), cwd=str(folder.files)).save(folder.policy)
        requests = requests_for_spec(folder.run_spec, spec, devices=lease["devices"], priority=LEASE_PRIORITY,
                                     tenant=f"tenant-{lease['tenant_id']}", run_dir=str(folder.run_dir),
                                     lease_id=str(lease["id"]))
        for request in requests:  # every attempt of the lease's job runs inside the sandbox
            request["argv"] = wrap_argv(request["argv"], folder.policy)
        # Write our intent before accepting: after a crash we resume from here, never accept twice.
        record = {"lease_id": lease["id"], "demand_id": lease["demand_id"], "tenant_id": lease["tenant_id"],
                  "results_to": str(results_to), "folder": str(folder.root), "requests": requests,
                  "job_ids": [], "seq": 0, "reported_device_seconds": 0,
                  "last_end": None, "delivered": False, "finished": False}
        self.save_record(record)
        self.client.accept_lease(lease["id"])
        self.queue_jobs(record)

    def queue_jobs(self, record: dict) -> None:
        """Queue the accepted lease's job(s), once (also after a crash between accepting and queueing)."""
        with self.loop.mutex:
            if record["job_ids"]:
                return
            jobs = add_jobs(self.loop.store, record["requests"], self.loop.config,
                            actor=f"agent:lease-{record['lease_id']}")
            record["job_ids"] = [j.id for j in jobs]
            self.save_record(record)
        self.loop.wake.set()
        log.info("accepted lease %s: job(s) %s", record["lease_id"], record["job_ids"])

    def _follow(self, lease: dict, record: dict, now: int) -> None:
        if not record["job_ids"]:
            self.queue_jobs(record)
        jobs = [self.loop.store.get(i) for i in record["job_ids"]]
        if not jobs:
            return
        job = jobs[-1]
        if lease["state"] == "accepted":
            if any(j.state in (JobState.RUNNING, JobState.SUCCEEDED) for j in jobs):
                self.client.start_lease(lease["id"])
            elif job.state.terminal:
                # It could not start: start and end the lease at once so the escrow comes back.
                self.client.start_lease(lease["id"])
                self.client.terminate_lease(lease["id"], "job_failed",
                                            f"the job could not start: {self._why(record, job)}"[:2000])
                self.finish_lease(record)
            return
        # Running lease.
        window_over = now >= lease["window_end"]
        if window_over and not all(j.state.terminal for j in jobs):
            self.stop_jobs(record, "the lease's window ended")
        due = record["last_end"] is None or now - record["last_end"] >= self.usage_interval_s
        ended = all(j.state.terminal for j in jobs)
        if due or ended or window_over:
            self._report_usage(lease, record, jobs, min(now, lease["window_end"]))
        if ended and not record["delivered"]:
            self._deliver(record, job)
            if job.state != JobState.SUCCEEDED and not window_over:
                self.client.terminate_lease(lease["id"], "job_failed",
                                            f"job {job.id} {job.state}: {self._why(record, job)}"[:2000])
                self.finish_lease(record)
                return
        if window_over and ended and record["delivered"]:
            self.client.close_lease(lease["id"])
            self.finish_lease(record)

    # -- usage and results ------------------------------------------------------------------------

    def _report_usage(self, lease: dict, record: dict, jobs: list[Job], end: int) -> None:
        start = record["last_end"] if record["last_end"] is not None else lease["started_at"]
        if end <= start:
            return
        used = sum(self._device_seconds(j) for j in jobs)
        delta = int(used) - record["reported_device_seconds"]
        delta = max(0, min(delta, lease["devices"] * (end - start)))
        seq = record["seq"] + 1
        self.client.report_usage(lease["id"], seq, start, end, delta, evidence=metrics_digest(jobs[-1].run_dir),
                                 idempotency_key=f"lease-{lease['id']}-usage-{seq}")
        record.update(seq=seq, last_end=end, reported_device_seconds=record["reported_device_seconds"] + delta)
        self.save_record(record)

    @staticmethod
    def _device_seconds(job: Job) -> float:
        """Device-seconds allocated to the job so far, including its attempt running now."""
        current = job.devices * (time.time() - job.attempt_started_at) if job.attempt_started_at else 0.0
        return job.device_seconds + current

    def _deliver(self, record: dict, job: Job) -> None:
        """Copy the run's results (never its checkpoints) to where the tenant asked for them."""
        try:
            dest = delivery_target(record["results_to"], tenant=record.get("tenant_id"), roots=self.delivery_roots)
            copied = deliver_results(Path(job.run_dir), dest, {"lease_id": record["lease_id"], "job_id": job.id,
                                                               "job_state": str(job.state),
                                                               "tenant": record.get("tenant_id")},
                                     roots=self.delivery_roots)
            log.info("lease %s: %d result files of job %s delivered to %s", record["lease_id"], copied, job.id, dest)
        except (OSError, ValueError) as exc:
            # The lease still closes and settles; the results stay in the run directory here.
            record["delivery_error"] = str(exc)[:2000]
            log.error("lease %s: results of job %s not delivered: %s", record["lease_id"], job.id, exc)
        record["delivered"] = True
        self.save_record(record)

    @staticmethod
    def _why(record: dict, job: Job) -> str:
        """Why a lease's job failed: the sandbox launcher's reason when it could not run the job."""
        try:
            reason = json.loads((Path(record["folder"]) / "failure.json").read_text())["reason"]
            return f"{reason} ({job.detail})"
        except (KeyError, OSError, ValueError, TypeError):
            return str(job.detail)

    def finish_lease(self, record: dict) -> None:
        """The lease is over for this agent: its record says so, its jobs' cgroups are gone and its work
        folder's own filesystem (a disk quota) is unmounted (its image stays until the folder goes)."""
        record["finished"], record["finished_at"] = True, time.time()
        self.save_record(record)
        for job_id in record["job_ids"]:
            job_limits.remove_stale(job_limits.cgroup_name(record["folder"], record["lease_id"], job_id))
        with contextlib.suppress(OSError, subprocess.SubprocessError):  # no mount outlives its lease
            release_disk(record["folder"], remove_image=False)

    def stop_jobs(self, record: dict, why: str) -> None:
        for job_id in record["job_ids"]:
            job = self.loop.store.get(job_id)
            if not job.state.terminal:
                log.info("lease %s: cancelling job %s (%s)", record["lease_id"], job_id, why)
                self.loop.cancel(job_id, actor=f"agent:lease-{record['lease_id']}")

    # -- where jobs come from, and the agent's own records ------------------------------------------

    def _job_of(self, lease: dict) -> tuple[LeaseFolder, str, list[str]] | None:
        """The lease's folder with its spec and data written into it, where its results go, and the
        data URLs it may read; None while a job-less lease's drop folder has no spec yet."""
        folder = LeaseFolder(self.dir / f"lease-{int(lease['id'])}")
        attached = lease.get("job")
        if isinstance(attached, dict) and "spec" in attached:
            files = decode_files(attached.get("files") or {})  # checked again: never trust the wire
            data_urls = check_data_urls(list(attached.get("data_urls") or []))
            folder.create()
            write_files(folder, files)
            spec_text = attached["spec"] if isinstance(attached["spec"], str) else yaml.safe_dump(attached["spec"])
            atomic_write_text(folder.spec, spec_text)
            write_env_lock(folder, attached.get("env_lock"))
            return folder, str(attached.get("results_to") or folder.root / "results"), data_urls
        # Fallback for demands that carry no job: the local drop directory, whose files are the job's data.
        drop = self.lease_jobs / f"demand-{int(lease['demand_id'])}"
        if not (drop / "spec.yaml").is_file():
            return None
        folder.create()
        copy_drop_folder(drop, folder, MAX_JOB_FILES_BYTES)
        atomic_write_text(folder.spec, (drop / "spec.yaml").read_text(encoding="utf-8"))
        return folder, str(drop / "results"), []

    def _path(self, lease_id: int) -> Path:
        return self.dir / f"lease-{int(lease_id)}.json"

    def _record(self, lease_id: int) -> dict[str, Any] | None:
        try:
            return json.loads(self._path(lease_id).read_text())
        except FileNotFoundError:
            return None

    def save_record(self, record: dict[str, Any]) -> None:
        atomic_write_text(self._path(record["lease_id"]), json.dumps(record))
