"""What the API's `POST /jobs` accepts: a job spec (always), or raw commands (only when allowed).

A spec submission carries the spec's YAML text and how to queue it; the daemon validates the spec
itself (a bad one is refused with its problems, before anything is queued), keeps a copy in
`<state dir>/specs/`, and queues `runyard run` on it (one job, or one per stage). Raw commands
(`{"jobs": [{"argv": [...]}, ...]}`) run anything as the daemon's user, so the daemon accepts them
only when its operator started it with `--allow-argv`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runyard.control.jobs import JobRequestError, add_jobs, requests_for_spec
from runyard.control.loop import ControlLoop
from runyard.control.store import Job
from runyard.errors import SpecError
from runyard.spec.job import parse_spec
from runyard.system.files import atomic_write_text

MAX_SPEC_TEXT = 1 << 20


class ArgvNotAllowed(JobRequestError):
    """A raw command was submitted to a daemon that does not accept them."""


class SpecSubmission(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: str = Field(min_length=1, max_length=MAX_SPEC_TEXT, description="the job spec, YAML text")
    priority: int = Field(default=0, ge=-1000, le=1000)
    devices: int | None = Field(default=None, ge=1, le=4096, description="default: the spec's resources.nproc")
    tenant: str = Field(default="default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,99}$")
    run_dir: str | None = Field(default=None, max_length=4096, pattern=r"^/", description="an absolute path")
    staged: bool = False


def submit(loop: ControlLoop, body: dict[str, Any], allow_argv: bool, actor: str = "api") -> list[Job]:
    """Queue a spec submission or (if allowed) raw job requests; JobRequestError says what is wrong."""
    if "jobs" in body:
        if not allow_argv:
            raise ArgvNotAllowed("this control plane runs job specs only (POST /jobs with 'spec'); arbitrary "
                                 "commands ('jobs' with argv) need the daemon started with --allow-argv")
        with loop.mutex:
            return add_jobs(loop.store, body.get("jobs"), loop.config, actor=actor)
    try:
        request = SpecSubmission.model_validate(body)
    except ValidationError as exc:
        raise JobRequestError(f"expected {{'spec': YAML text, ...}}: {exc}") from None
    try:
        raw = yaml.safe_load(request.spec)
    except yaml.YAMLError as exc:
        raise JobRequestError(f"spec: not valid YAML: {exc}") from None
    except RecursionError:
        raise JobRequestError("spec: nests too deeply") from None
    try:
        spec = parse_spec(raw, "<submitted spec>")
    except SpecError as exc:
        raise JobRequestError(str(exc)) from None
    digest = hashlib.sha256(request.spec.encode("utf-8")).hexdigest()[:16]
    path = Path(loop.config.state_dir) / "specs" / f"{spec.name}-{digest}.yaml"
    atomic_write_text(path, request.spec)
    requests = requests_for_spec(path, spec, devices=request.devices, priority=request.priority,
                                 tenant=request.tenant, run_dir=request.run_dir, staged=request.staged)
    with loop.mutex:
        return add_jobs(loop.store, requests, loop.config, actor=actor)
