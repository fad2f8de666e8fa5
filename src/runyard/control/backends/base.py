"""What a backend does for the control loop. The job model, queue and CLI are the same for all."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from runyard.control.store import Job


@dataclass(frozen=True)
class Launched:
    """Where a launched attempt can be found again: a local pid + start time, or a backend id."""

    pid: int | None = None
    pid_start_time: int | None = None
    backend_id: str | None = None


@dataclass(frozen=True)
class Ended:
    """How an attempt ended. `lost` means the process vanished without saying how."""

    returncode: int | None
    signal: int | None = None
    lost: bool = False
    detail: str = ""


@dataclass(frozen=True)
class Requeued:
    """The cluster put the job back in its own queue (Slurm --requeue); it will run again there."""

    detail: str = ""


class Backend(Protocol):
    name: str
    #: True if this backend allocates devices itself (Slurm) rather than the embedded scheduler.
    allocates_itself: bool

    def launch(self, job: Job, env: dict[str, str]) -> Launched: ...

    def poll(self, job: Job) -> Ended | Requeued | None:
        """None while the attempt runs (or waits in the cluster's queue)."""
        ...

    def is_running(self, job: Job) -> bool:
        """True once the attempt is really executing (not just queued in the cluster)."""
        ...

    def terminate(self, job: Job) -> None:
        """Ask the job to stop (SIGTERM): it checkpoints and exits 4."""
        ...

    def kill(self, job: Job) -> None:
        """Stop it now (SIGKILL)."""
        ...

    def kill_leftovers(self, job: Job) -> list[str]:
        """Before an attempt starts: end whatever earlier attempts of the job left running (a worker
        that outlived its launcher would train beside the new attempt). Returns what was ended."""
        ...

    def adopt(self, job: Job) -> Launched | None:
        """After a daemon restart: find an attempt launched but never recorded, if it exists."""
        ...


def attempt_status_file(job: Job, attempt: int | None = None) -> Path:
    """Where the shim writes how attempt `attempt` (default: the current one) of `job` ended."""
    return Path(job.log_path).parent / f"attempt-{attempt if attempt is not None else job.attempt}.exit.json"
