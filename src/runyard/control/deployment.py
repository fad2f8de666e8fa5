"""A standing lease's deployment on this machine: its export, the command that serves it, and the
availability records of what its endpoint saw.

The demand's deployment (`runyard.market.serving`) is laid out in the lease's folder
(`runyard.control.lease_job.LeaseFolder`): the uploaded export files are written under `export/`,
and the export's URLs are fetched there by the sandbox launcher before the server starts (on the
provider's network, checked like a job's data URLs: `runyard.control.fetch`). The control plane then
runs one job for the lease, with no time limit and a generous restart budget:

    sandbox launcher -> bwrap -> serve_relay SOCKET PORT -> runyard serve export/ --port PORT ...

The server listens inside the sandbox's own network namespace (nothing but loopback); the relay
puts that port on a Unix socket in the lease's work folder, and the agent's endpoint
(`runyard.control.endpoint`) is the only thing that connects to it. If the server dies, the relay
exits as an infrastructure failure and the control plane restarts it with backoff; an endpoint that
stays unhealthy while its server is alive is restarted by the agent.

Availability is reported per interval, never across a billing period's close: `report_windows`
splits what the endpoint saw since the last record at the period boundaries between, sharing the
probes between the parts by their lengths. A part's available seconds are its length times the
share of its probes that found the server healthy (no probe, no availability).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runyard.control.endpoint import Window
from runyard.control.lease_job import LeaseFolder
from runyard.control.states import FailureReason, JobState
from runyard.market.jobs import check_file_path, decode_files
from runyard.market.serving import check_deployment_files
from runyard.system.files import atomic_write_bytes

SERVE_PORT = 8000  # inside the sandbox's own network namespace: no other process can hold it
SERVE_OPTIONS = {"model_name": "--model-name", "max_batch": "--max-batch", "max_queue": "--max-queue",
                 "kv_cache_mb": "--kv-cache-mb", "max_prefill_tokens": "--max-prefill-tokens"}
# A deployment is restarted again and again after infrastructure failures (a killed server), and a
# few times after its own errors; it never times out.
RETRY_POLICY = {"infra": {"retries": 1000, "backoff_s": 1.0, "backoff_max_s": 30.0},
                "user_error": {"retries": 3, "backoff_s": 2.0}, "window_s": 3600.0}


def lay_out(folder: LeaseFolder, deployment: dict, into: str = "export") -> dict[str, str]:
    """Write the deployment's uploaded export files into `into` under the lease folder (`export/`, or
    a roll-out's own folder beside it); returns the URLs the launcher fetches there (URL -> path under
    the lease folder). ValueError for a bad deployment (checked again here: never trust the wire)."""
    files = deployment.get("export_files") or {}
    urls = deployment.get("export_urls") or {}
    check_deployment_files(files, urls)
    folder.create()
    target = folder.root / check_file_path(into)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for rel, data in decode_files(files).items():
        atomic_write_bytes(target / check_file_path(rel), data)
    return {url: f"{into}/{check_file_path(rel)}" for rel, url in urls.items()}


def serve_command(folder: LeaseFolder, deployment: dict, gpu: bool, port: int = SERVE_PORT,
                  export: Path | None = None, socket: Path | None = None) -> list[str]:
    """The command the deployment's job runs inside the sandbox (before the launcher wraps it): the
    relay, and `runyard serve` on `port` of the sandbox's loopback (runyard's engine, on one device).
    A roll-out's candidate serves another `export` on its own `socket` beside the running one."""
    export, socket = export or folder.export, socket or folder.socket
    serve = [sys.executable, "-m", "runyard", "serve", str(export), "--host", "127.0.0.1",
             "--port", str(port), "--device", "cuda" if gpu else "cpu"]
    for key, flag in SERVE_OPTIONS.items():
        value = (deployment.get("serve") or {}).get(key)
        if value is not None:
            serve += [flag, str(value)]
    if (deployment.get("serve") or {}).get("log_requests"):
        # Each server keeps its own log (two serve side by side during a roll-out); the tenant fetches it
        # through its endpoint, the only way in.
        serve += ["--log-requests", str(folder.work / f"traffic-{Path(socket).stem}"), "--share-traffic"]
    return [sys.executable, "-m", "runyard.control.serve_relay", str(socket), str(port), "--", *serve]


def failed_before_serving(job_state: JobState, failures: list, ever_healthy: bool) -> bool:
    """A deployment that never answered healthy and whose server already failed on its own (not killed
    by the machine): it will not serve, and the lease should end now rather than after every retry."""
    if ever_healthy:
        return False
    tenant_faults = (FailureReason.USER_ERROR, FailureReason.BAD_SPEC, FailureReason.OUT_OF_MEMORY,
                     FailureReason.DISK_QUOTA)
    own = [f for f in failures if f[1] in {str(reason) for reason in tenant_faults}]
    return bool(own) or job_state in (JobState.FAILED, JobState.CANCELLED)


def should_restart(job_state: JobState, attempt_started_at: float | None, unhealthy_for_s: float, now: float,
                   startup_grace_s: float, unhealthy_restart_s: float) -> bool:
    """Restart a server that is alive but has failed its health probes for `unhealthy_restart_s`, once
    its attempt is older than the start-up grace (a server still loading its model is not sick)."""
    if job_state != JobState.RUNNING or attempt_started_at is None:
        return False
    return now - attempt_started_at > startup_grace_s and unhealthy_for_s >= unhealthy_restart_s


def log_reason(log_path: str, limit: int = 600) -> str:
    """What a failed server said last: its last `runyard:` line, else its last line."""
    try:
        lines = [ln.strip() for ln in Path(log_path).read_text(errors="replace")[-20_000:].splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    said = [ln for ln in lines if ln.startswith("runyard:")]
    return (said or lines or ["(no output)"])[-1][:limit]


def job_request(lease: dict, argv: list[str], folder: LeaseFolder, priority: int) -> dict[str, Any]:
    """The control-plane job that keeps a deployment up."""
    return {"name": f"deploy-lease-{int(lease['id'])}", "argv": argv, "devices": lease["devices"],
            "priority": priority, "tenant": f"tenant-{lease['tenant_id']}", "run_dir": str(folder.run_dir),
            "lease_id": str(lease["id"]), "retry_policy": RETRY_POLICY}


@dataclass(frozen=True)
class Part:
    """One availability record's worth: an interval inside one period and what was seen in it."""

    start: int
    end: int
    available_seconds: int
    probes: int
    probes_ok: int
    requests: int
    latency_p50_ms: int | None
    latency_p99_ms: int | None


def report_windows(start: int, end: int, started_at: int, period_s: int, seen: Window) -> list[Part]:
    """[start, end) split at the period closes inside it, with `seen` shared between the parts by
    their lengths (each part gets its share of probes and healthy probes, rounded down, the last one
    the rest; the requests go with the probes, the latencies to every part)."""
    cuts = [start]
    close = started_at + period_s * ((start - started_at) // period_s + 1)
    while close < end:
        cuts.append(close)
        close += period_s
    cuts.append(end)
    total = end - start
    parts, given = [], {"probes": 0, "ok": 0, "requests": 0}
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        last = i == len(cuts) - 2
        share = {key: (value - given[key]) if last else value * (b - a) // total
                 for key, value in (("probes", seen.probes), ("ok", seen.probes_ok), ("requests", seen.requests))}
        for key in given:
            given[key] += share[key]
        ok = min(share["ok"], share["probes"])
        available = (b - a) * ok // share["probes"] if share["probes"] else 0
        parts.append(Part(a, b, available, share["probes"], ok, share["requests"], seen.latency_p50_ms,
                          seen.latency_p99_ms))
    return parts
