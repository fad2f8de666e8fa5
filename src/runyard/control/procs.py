"""What /proc says about processes: identity by (pid, start time), and finding a job's processes.

A pid alone is not an identity (pids are reused); a pid plus its start time (clock ticks since
boot, field 22 of /proc/PID/stat) is. Every process a job launches carries the environment
variable RUNYARD_CONTROL_JOB=<job id>, so a restarted daemon can find them even when it never
recorded their pids.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
from pathlib import Path

from runyard.system.processes import processes_with_env

MARKER = "RUNYARD_CONTROL_JOB"


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone or a zombie."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 overall; fields[0] is field 3 (state)


def is_alive(pid: int | None, expected_start: int | None) -> bool:
    """True if `pid` is still the very process that was started at `expected_start`."""
    if pid is None:
        return False
    now_start = start_time(pid)
    return now_start is not None and (expected_start is None or now_start == expected_start)


def instance_id(state_dir: str | Path) -> str:
    """A short stable name for the control plane that owns `state_dir`."""
    return hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:12]


def marker(instance: str, job_id: int, attempt: int) -> str:
    """The value of RUNYARD_CONTROL_JOB for one attempt."""
    return f"{instance}:{job_id}:{attempt}"


def processes_of_job(instance: str, job_id: int) -> list[int]:
    """Live pids whose environment says they belong to `job_id` of this instance (any attempt)."""
    return processes_with_env(MARKER, f"{instance}:{job_id}:")


def kill_job_processes(instance: str, job_id: int, sig: int = signal.SIGKILL) -> int:
    """Signal every live process of a job. Returns how many were signalled."""
    count = 0
    for pid in processes_of_job(instance, job_id):
        try:
            os.kill(pid, sig)
            count += 1
        except ProcessLookupError:
            pass
    return count


class LeftoversAlive(RuntimeError):
    """Processes of an earlier attempt survived SIGKILL (e.g. stuck in the kernel): do not start yet."""


def kill_leftovers(instance: str, job_id: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process left by earlier attempts of a job and wait (bounded) until they are gone,
    so that the next attempt never runs beside them (two writers in one run directory, a data lock
    still held). Returns the pids that were killed; raises LeftoversAlive if some would not die."""
    killed = processes_of_job(instance, job_id)
    deadline = time.monotonic() + timeout_s
    while left := processes_of_job(instance, job_id):
        if time.monotonic() > deadline:
            raise LeftoversAlive(f"job {job_id}: processes of an earlier attempt would not die: {left}")
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return killed
