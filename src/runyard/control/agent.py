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
(`lease["job"]` = {"spec": YAML text, "results_to": absolute path or file:// URL}); the spec is
written to `<state dir>/agent/lease-<id>/spec.yaml` and run from there. A lease without a job
falls back to the local drop directory `<lease_jobs>/demand-<demand id>/spec.yaml`, with results
delivered to `<lease_jobs>/demand-<demand id>/results/`. Results are the run's eval/, export/,
spec.yaml, manifest.json, data/report.*, stages/*/gates.json and metrics, never its checkpoints,
copied atomically (see `deliver_results`); a `results_to` this agent cannot deliver to (another
URL scheme, a directory holding other files) gets the lease rejected before any work.

What it has done for each lease is kept in `<state dir>/agent/lease-<id>.json` (written
atomically), so a restarted daemon neither accepts twice nor reports the same usage twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from runyard.control.jobs import add_jobs, requests_for_spec
from runyard.control.server import capacity
from runyard.control.states import JobState
from runyard.control.store import Job
from runyard.errors import RunyardError
from runyard.fsutil import atomic_write_text, fsync_dir, fsync_file
from runyard.spec import load_spec

log = logging.getLogger("runyard.control.agent")
LEASE_PRIORITY = 100  # paid market work goes ahead of the provider's own best-effort jobs


class MarketAgent:
    def __init__(self, loop, market_url: str, provider_key: str | None, usage_interval_s: float = 30.0,
                 lease_jobs: str | Path | None = None, poll_s: float = 1.0, client=None,
                 deliveries_root: str | Path | None = None):
        from runyard.market.client import MarketClient

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
        self.dir = state_dir / "agent"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._thread: threading.Thread | None = None

    # -- thread -----------------------------------------------------------------------------------

    def start(self, stop: threading.Event) -> None:
        self._thread = threading.Thread(target=self._run, args=(stop,), name="market-agent", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

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
            self._consider(lease)
        for lease in self.client.leases(state="accepted") + self.client.leases(state="running"):
            record = self._record(lease["id"])
            if record is not None:
                self._follow(lease, record, now)
        for state in ("terminated", "cancelled", "expired"):
            for lease in self.client.leases(state=state):
                record = self._record(lease["id"])
                if record is not None and not record.get("finished"):
                    self._stop_jobs(record, f"the lease was {state}")
                    record["finished"] = True
                    self._save(record)

    def _consider(self, lease: dict) -> None:
        if self._record(lease["id"]) is not None:
            return  # already decided (e.g. accepted before a restart; the market will show it soon)
        free = len(capacity(self.loop)["free"])
        if lease["devices"] > free:
            self.client.reject_lease(lease["id"], "capacity_unavailable",
                                     f"{lease['devices']} devices asked, {free} free")
            return
        try:
            found = self._job_of(lease)
        except OSError as exc:
            log.warning("lease %s: cannot read its job: %s", lease["id"], exc)
            found = None
        if found is None:
            return  # its job has not arrived yet; the market expires the lease if it never does
        spec_path, results_to = found
        try:
            spec = load_spec(spec_path)
            delivery_target(results_to, tenant=lease["tenant_id"], roots=self.delivery_roots)
        except (RunyardError, OSError, ValueError) as exc:
            self.client.reject_lease(lease["id"], "other", f"the lease's job cannot run: {exc}"[:2000])
            return
        # Write our intent before accepting: after a crash we resume from here, never accept twice.
        record = {"lease_id": lease["id"], "demand_id": lease["demand_id"], "tenant_id": lease["tenant_id"],
                  "results_to": str(results_to),
                  "spec": str(spec_path), "job_ids": [], "seq": 0, "reported_device_seconds": 0,
                  "last_end": None, "delivered": False, "finished": False}
        self._save(record)
        self.client.accept_lease(lease["id"])
        requests = requests_for_spec(spec_path, spec, devices=lease["devices"], priority=LEASE_PRIORITY,
                                     tenant=f"tenant-{lease['tenant_id']}", lease_id=str(lease["id"]))
        with self.loop.mutex:
            jobs = add_jobs(self.loop.store, requests, self.loop.config, actor=f"agent:lease-{lease['id']}")
        record["job_ids"] = [j.id for j in jobs]
        self._save(record)
        self.loop.wake.set()
        log.info("accepted lease %s: job(s) %s", lease["id"], record["job_ids"])

    def _follow(self, lease: dict, record: dict, now: int) -> None:
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
                self.client.terminate_lease(lease["id"], "job_failed", f"the job could not start: {job.detail}")
                record["finished"] = True
                self._save(record)
            return
        # Running lease.
        window_over = now >= lease["window_end"]
        if window_over and not all(j.state.terminal for j in jobs):
            self._stop_jobs(record, "the lease's window ended")
        due = record["last_end"] is None or now - record["last_end"] >= self.usage_interval_s
        ended = all(j.state.terminal for j in jobs)
        if due or ended or window_over:
            self._report_usage(lease, record, jobs, min(now, lease["window_end"]))
        if ended and not record["delivered"]:
            self._deliver(record, job)
            if job.state != JobState.SUCCEEDED and not window_over:
                self.client.terminate_lease(lease["id"], "job_failed", f"job {job.id} {job.state}: {job.detail}")
                record["finished"] = True
                self._save(record)
                return
        if window_over and ended and record["delivered"]:
            self.client.close_lease(lease["id"])
            record["finished"] = True
            self._save(record)

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
        self._save(record)

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
        self._save(record)

    def _stop_jobs(self, record: dict, why: str) -> None:
        for job_id in record["job_ids"]:
            job = self.loop.store.get(job_id)
            if not job.state.terminal:
                log.info("lease %s: cancelling job %s (%s)", record["lease_id"], job_id, why)
                self.loop.cancel(job_id, actor=f"agent:lease-{record['lease_id']}")

    # -- where jobs come from, and the agent's own records ------------------------------------------

    def _job_of(self, lease: dict) -> tuple[Path, str] | None:
        """The lease's spec (written into the lease's own area here) and where its results go."""
        attached = lease.get("job")
        if isinstance(attached, dict) and "spec" in attached:
            folder = self.dir / f"lease-{int(lease['id'])}"
            folder.mkdir(parents=True, exist_ok=True)
            spec_path = folder / "spec.yaml"
            spec_text = attached["spec"] if isinstance(attached["spec"], str) else yaml.safe_dump(attached["spec"])
            atomic_write_text(spec_path, spec_text)
            return spec_path, str(attached.get("results_to") or folder / "results")
        # Fallback for demands that carry no job: the local drop directory.
        drop = self.lease_jobs / f"demand-{int(lease['demand_id'])}"
        if not (drop / "spec.yaml").exists():
            return None
        return drop / "spec.yaml", str(drop / "results")

    def _path(self, lease_id: int) -> Path:
        return self.dir / f"lease-{int(lease_id)}.json"

    def _record(self, lease_id: int) -> dict[str, Any] | None:
        try:
            return json.loads(self._path(lease_id).read_text())
        except FileNotFoundError:
            return None

    def _save(self, record: dict[str, Any]) -> None:
        atomic_write_text(self._path(record["lease_id"]), json.dumps(record))


# What a tenant gets of a run directory: everything but checkpoints, logs and scratch.
RESULT_PATTERNS = ("eval/**/*", "export/**/*", "spec.yaml", "manifest.json", "data/report.*",
                   "stages/*/gates.json", "stages/*/metrics.jsonl")
DELIVERY_MARKER = ".runyard-delivery.json"


def delivery_target(results_to: str, tenant: int | None = None, roots: tuple[Path, ...] | None = None) -> Path:
    """The local directory a lease's results go to; ValueError for what this agent cannot deliver to.

    Accepts an absolute path or a file:// URL. Other schemes (e.g. a signed upload URL) are refused
    up front, so the lease is rejected and the escrow returned rather than the work lost. A target
    that already holds something other than an earlier delivery is refused too: the agent never
    replaces a tenant's (or anyone's) files with a run's results; with `tenant` given, an earlier
    delivery is replaced only if it was made for that same tenant.
    """
    if "://" in results_to:
        scheme, _, rest = results_to.partition("://")
        if scheme.lower() != "file":
            raise ValueError(f"results_to {results_to[:200]!r}: this provider delivers only to local paths "
                             f"or file:// URLs, not {scheme}://")
        results_to = rest
    path = Path(results_to)
    if not path.is_absolute() or ".." in path.parts:
        raise ValueError(f"results_to {results_to[:200]!r} must be an absolute path without '..'")
    if roots is not None:
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(os.path.realpath(root)) for root in roots):
            raise ValueError(f"results_to {path} is outside this provider's delivery folders "
                             f"({', '.join(str(r) for r in roots)})")
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ValueError(f"results_to {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / DELIVERY_MARKER).is_file():
        raise ValueError(f"results_to {path} already holds files that are not an earlier runyard delivery")
    if tenant is not None and (path / DELIVERY_MARKER).is_file():
        try:
            earlier = json.loads((path / DELIVERY_MARKER).read_text()).get("tenant")
        except (ValueError, AttributeError):
            earlier = None
        if earlier != tenant:
            raise ValueError(f"results_to {path} holds another tenant's delivery; it is not replaced")
    return path


def deliver_results(run_dir: Path, dest: Path, stamp: dict, roots: tuple[Path, ...] | None = None) -> int:
    """Copy the run's result files into `dest` atomically (all or nothing); returns the files copied.

    The files are assembled in a hidden sibling, fsynced, then renamed into place; an earlier
    delivery at `dest` is swapped out only after the new one is complete.
    """
    delivery_target(str(dest), tenant=stamp.get("tenant"), roots=roots)  # re-check: the target may have changed since the lease was accepted
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    root = run_dir.resolve()
    # A symlinked directory in the run (eval -> /somewhere) must not hand out files from outside it.
    files = sorted({p for pattern in RESULT_PATTERNS for p in run_dir.glob(pattern)
                    if p.is_file() and not p.is_symlink() and "checkpoints" not in p.relative_to(run_dir).parts
                    and ".tmp" not in p.name and p.resolve().is_relative_to(root)})
    for src in files:
        target = tmp / src.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
        fsync_file(target)
    atomic_write_text(tmp / DELIVERY_MARKER, json.dumps({**stamp, "files": len(files)}))
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)  # only an empty directory or an earlier delivery gets here (delivery_target)
    tmp.rename(dest)
    fsync_dir(dest.parent)  # the swap itself survives a crash
    shutil.rmtree(old, ignore_errors=True)
    return len(files)


def metrics_digest(run_dir: str | Path) -> str:
    """sha256 over the run's metrics files: evidence that ties a usage record to the work done."""
    h = hashlib.sha256()
    for path in sorted(Path(run_dir).glob("stages/*/metrics.jsonl")):
        h.update(path.relative_to(run_dir).as_posix().encode())
        h.update(path.read_bytes())
    return "sha256:" + h.hexdigest()
