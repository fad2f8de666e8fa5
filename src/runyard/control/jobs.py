"""What a submission is: a validated job request, the commands a spec becomes, and staged chains.

A job is a run: `runyard run SPEC --run-dir DIR` (`--nproc N` for several devices). A staged spec
becomes one job per stage (`--stage NAME`), sharing one run directory, each depending on the one
before, so a later stage starts only after the earlier one succeeded (its gates passed). The
smoke stage (the first of several) runs on a small allocation.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runyard.control.retry import RetryPolicy
from runyard.control.store import Job, JobStore
from runyard.errors import RunyardError

if TYPE_CHECKING:
    from runyard.control.loop import ControlConfig
    from runyard.spec.job import JobSpec


class JobRequestError(RunyardError):
    """A submission the control plane cannot accept; the message names the field."""


class JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
    argv: list[str] = Field(min_length=1, description="the command of one attempt")
    devices: int = Field(default=1, ge=1, le=4096)
    priority: int = Field(default=0, ge=-1000, le=1000)
    tenant: str = Field(default="default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,99}$")
    run_dir: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    time_limit_s: float | None = Field(default=None, gt=0)
    retry_policy: dict[str, Any] | None = None
    lease_id: str | None = None
    depends_on: int | None = None
    after_previous: bool = Field(default=False, description="depend on the job before it in this request")


def add_jobs(store: JobStore, raw: Any, config: ControlConfig, actor: str) -> list[Job]:
    """Validate every request first, then add them in order (a chain links each to the one before)."""
    if not isinstance(raw, list) or not raw:
        raise JobRequestError("expected {'jobs': [ ... ]} with at least one job")
    requests = []
    for i, item in enumerate(raw):
        try:
            req = JobRequest.model_validate(item)
            if req.retry_policy is not None:
                RetryPolicy.from_dict(req.retry_policy)
        except (ValidationError, ValueError, TypeError) as exc:
            raise JobRequestError(f"jobs[{i}]: {exc}") from None
        if req.depends_on is not None:
            store.get(req.depends_on)  # JobNotFound if it does not exist
        if req.after_previous and i == 0:
            raise JobRequestError("jobs[0]: after_previous needs a job before it in the same request")
        bad_env = [k for k in req.env if k.startswith("RUNYARD_CONTROL")]
        if bad_env:
            raise JobRequestError(f"jobs[{i}].env: {bad_env} are set by the control plane")
        requests.append(req)
    added: list[Job] = []
    for req in requests:
        fields = req.model_dump(exclude={"after_previous"})
        if req.after_previous:
            fields["depends_on"] = added[-1].id
        fields["retry_policy"] = req.retry_policy or {}
        job = store.add(actor=actor, log_path="", run_dir=req.run_dir or "", **{
            k: v for k, v in fields.items() if k not in ("run_dir",)})
        job_dir = Path(config.state_dir) / "jobs" / str(job.id)
        run_dir = req.run_dir or (added[-1].run_dir if req.after_previous else
                                  str(Path(config.state_dir) / "runs" / f"{job.id}-{req.name}"))
        run_dir = str(Path(run_dir).resolve())
        argv = [a.replace("{run_dir}", run_dir) for a in req.argv]
        added.append(store.update(job.id, log_path=str(job_dir / "output.log"), run_dir=run_dir, argv=argv))
    return added


def run_command(spec_path: str | Path, run_dir: str | Path | None, nproc: int, stage: str | None = None) -> list[str]:
    """The spine's command for one run (or one stage of it)."""
    argv = [sys.executable, "-m", "runyard", "run", str(Path(spec_path).resolve())]
    if run_dir is not None:
        argv += ["--run-dir", str(run_dir)]
    if nproc > 1:
        argv += ["--nproc", str(nproc)]
    if stage is not None:
        argv += ["--stage", stage]
    return argv


def requests_for_spec(
    spec_path: str | Path,
    spec: JobSpec,
    *,
    devices: int | None = None,
    priority: int = 0,
    tenant: str = "default",
    run_dir: str | None = None,
    staged: bool = False,
    smoke_devices: int = 1,
    lease_id: str | None = None,
) -> list[dict[str, Any]]:
    """Job requests for a spec: one job, or (staged) one per stage linked in order.

    The run directory must be known before submission so every stage writes into the same one;
    when not given, the daemon's default for the first job is used and later stages follow it.
    """
    devices = devices or spec.resources.nproc
    time_limit = float(spec.resources.requirement.duration_s)
    base = {"priority": priority, "tenant": tenant, "time_limit_s": time_limit, "lease_id": lease_id}
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", spec.name)[:100]
    if not staged or len(spec.stages) == 1:
        # The command needs the run dir; "{run_dir}" is filled in by the daemon (see expand_run_dir).
        return [{**base, "name": name, "devices": devices, "run_dir": run_dir,
                 "argv": run_command(spec_path, run_dir or "{run_dir}", devices)}]
    requests = []
    for i, stage in enumerate(spec.stages):
        n = min(smoke_devices, devices) if i == 0 else devices
        requests.append({**base, "name": f"{name}.{stage.name}", "devices": n, "run_dir": run_dir,
                         "after_previous": i > 0,
                         "argv": run_command(spec_path, run_dir or "{run_dir}", n, stage=stage.name)})
    return requests
