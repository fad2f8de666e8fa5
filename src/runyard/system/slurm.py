"""Slurm as its command line shows it, for every part of runyard that drives Slurm (the control plane's
backend, the data stage's executor, `runyard reproduce`'s rerun). This is the one module that runs
Slurm's commands:

- `submit` (sbatch --parsable; a job array is a batch script with `#SBATCH --array`) returns the job id;
- `job_state` asks squeue (the live jobs), then scontrol (jobs Slurm still remembers, with their exit
  codes), then sacct (accounting, where it exists) about one job;
- `live_jobs` (one squeue call for several jobs, array tasks included), `jobs_named`, `cancel`,
  `has_accounting`, `max_array_size`.

Every command runs under one timeout (TIMEOUT_S), and every failure is one error, `SlurmError`, naming
the command, its exit status and what it printed on stderr. Also here: the job states (the `JobState`
squeue, scontrol and sacct print), grouped the way runyard acts on them, and the parsers of sbatch's,
scontrol's and sacct's output (job ids, KEY=VALUE fields, exit codes)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from runyard.errors import RunyardError

RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"})
QUEUED_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
                           "RESV_DEL_HOLD"})
# A job in one of these has not ended: its (array) tasks may still run or start.
LIVE_STATES = RUNNING_STATES | QUEUED_STATES

# Seconds any Slurm command may take; slurmctld answers in well under one, unless it is overloaded.
TIMEOUT_S = 120.0
# What MaxArraySize is when `scontrol show config` does not say (Slurm's own default).
DEFAULT_MAX_ARRAY_SIZE = 1001


class SlurmError(RunyardError):
    """A Slurm command failed, could not be run, or did not answer in time. `command` is its argv,
    `returncode` its exit status (None when it never exited by itself), `stderr` what it printed there."""

    def __init__(self, message: str, command: Sequence[str] = (), returncode: int | None = None,
                 stderr: str = ""):
        super().__init__(message)
        self.command, self.returncode, self.stderr = list(command), returncode, stderr


def run(argv: Sequence[str], env: dict[str, str] | None = None, check: bool = True,
        timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run one Slurm command, its output captured as text. Raises SlurmError when it cannot be run or
    takes longer than `timeout_s`, and (with `check`) when it exits non-zero."""
    argv = list(argv)
    name = " ".join(argv[:2])
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise SlurmError(f"{name} did not answer within {timeout_s:g} s", argv, None, stderr.strip()) from None
    except (OSError, subprocess.SubprocessError) as exc:
        raise SlurmError(f"{argv[0]} could not be run ({exc}); is this a Slurm submit host?", argv) from None
    if check and proc.returncode != 0:
        said = proc.stderr.strip() or proc.stdout.strip()
        raise SlurmError(f"{name} failed ({proc.returncode}): {said}", argv, proc.returncode, proc.stderr.strip())
    return proc


# -- submit -------------------------------------------------------------------------------------------


def parse_job_id(text: str) -> str | None:
    """The job id in `sbatch --parsable` output ('123', or '123;cluster' on a multi-cluster site)."""
    job_id = text.strip().split(";")[0]
    return job_id if job_id.isdigit() else None


def submit(script: Path | str, sbatch_args: Sequence[str] = (), env: dict[str, str] | None = None,
           timeout_s: float = TIMEOUT_S) -> str:
    """Submit a batch script (a job array when it says `#SBATCH --array`) and return its job id."""
    argv = ["sbatch", "--parsable", *sbatch_args, str(script)]
    out = run(argv, env=env, timeout_s=timeout_s).stdout.strip()
    job_id = parse_job_id(out)
    if job_id is None:
        raise SlurmError(f"sbatch printed {out!r}, not a job id", argv, 0)
    return job_id


# -- watch --------------------------------------------------------------------------------------------


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job -o ID` output (one line of KEY=VALUE) as a dict."""
    fields = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


def parse_sacct(text: str) -> dict[str, str] | None:
    """`sacct -X -n -P -o JobID,State,ExitCode` output -> {'State', 'ExitCode'} of the allocation."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0] and "." not in parts[0]:
            return {"State": parts[1].split()[0], "ExitCode": parts[2]}
    return None


def parse_exit_code(value: str) -> tuple[int | None, int | None]:
    """Slurm's ExitCode 'rc:signal' -> (returncode, signal): one of them None."""
    rc, _, sig = value.partition(":")
    rc_i, sig_i = int(rc or 0), int(sig or 0)
    return (None, sig_i) if sig_i else (rc_i, None)


def state_name(info: dict[str, str]) -> str:
    """The bare state of a `job_state` answer ('CANCELLED by 0' and 'COMPLETING+' -> their first word)."""
    return info["JobState"].split()[0].rstrip("+")


def has_accounting(timeout_s: float = TIMEOUT_S) -> bool:
    """Whether Slurm accounting answers (it does not without slurmdbd)."""
    try:
        probe = run(["sacct", "-n", "-X", "-j", "1", "-o", "JobID"], check=False, timeout_s=timeout_s)
    except SlurmError:
        return False
    return probe.returncode == 0 and "disabled" not in (probe.stdout + probe.stderr)


def job_state(job_id: str, accounting: bool | Callable[[], bool] = True,
              timeout_s: float = TIMEOUT_S) -> dict[str, str] | None:
    """What Slurm says of one job, as scontrol's fields (`JobState`, and `ExitCode` once it has ended):
    from squeue while the job is live (with its `Reason`), else from scontrol while Slurm remembers
    it, else from sacct when `accounting` (a bool, or a function asked only when it comes to that).
    None when none of them knows the job."""
    queue = run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], check=False, timeout_s=timeout_s)
    if queue.returncode == 0:
        for line in queue.stdout.splitlines():
            state, _, reason = line.strip().partition("|")
            if state in LIVE_STATES:
                return {"JobState": state, "Reason": reason}
    proc = run(["scontrol", "show", "job", "-o", job_id], check=False, timeout_s=timeout_s)
    if proc.returncode == 0 and "JobState=" in proc.stdout:
        return parse_scontrol(proc.stdout)
    if accounting() if callable(accounting) else accounting:
        acct = run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode"], check=False,
                   timeout_s=timeout_s)
        found = parse_sacct(acct.stdout)
        return None if found is None else {"JobState": found["State"], "ExitCode": found["ExitCode"]}
    return None


def live_jobs(job_ids: list[str], timeout_s: float = TIMEOUT_S) -> list[str]:
    """The jobs among `job_ids` that have not ended, any of an array's tasks counting (one squeue call)."""
    proc = run(["squeue", "-h", "-r", "-j", ",".join(job_ids), "-o", "%F %T"], check=False, timeout_s=timeout_s)
    if proc.returncode != 0:  # squeue refuses the list when a job in it is long gone: ask one by one
        return [j for j in job_ids if len(job_ids) > 1 and live_jobs([j], timeout_s)]
    live = {f for f, state in (line.split()[:2] for line in proc.stdout.splitlines() if line.strip())
            if state in LIVE_STATES}
    return [j for j in job_ids if j in live]


def jobs_named(name: str, timeout_s: float = TIMEOUT_S) -> list[str]:
    """The ids of the jobs named `name` that are in Slurm's queue, oldest first."""
    proc = run(["squeue", "-h", "-o", "%i %j", "--name", name], check=False, timeout_s=timeout_s)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def max_array_size(timeout_s: float = TIMEOUT_S) -> int:
    """Slurm's MaxArraySize (array indices must be below it); 1001 when the config does not say."""
    out = run(["scontrol", "show", "config"], check=False, timeout_s=timeout_s).stdout
    m = re.search(r"MaxArraySize\s*=\s*(\d+)", out)
    return int(m.group(1)) if m else DEFAULT_MAX_ARRAY_SIZE


# -- stop ---------------------------------------------------------------------------------------------


def cancel(job_id: str, signal: str | None = None, full: bool = False, timeout_s: float = TIMEOUT_S) -> int:
    """scancel the job (with `signal`, only signal it; with `full`, the batch shell and every step too).
    Returns scancel's exit status: it is not an error that the job has ended already."""
    argv = ["scancel", *([f"--signal={signal}"] if signal else []), *(["--full"] if full else []), job_id]
    return run(argv, check=False, timeout_s=timeout_s).returncode
