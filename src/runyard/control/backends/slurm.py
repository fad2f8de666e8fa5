"""The Slurm backend: each attempt is an sbatch job; Slurm allocates the devices.

- sbatch with the job's devices as GRES (`--gres=gpu:N`, or CPUs with `--gres ''`), `--requeue`
  (Slurm may requeue it after a node failure or `scontrol requeue`), and `--signal=B:TERM@60` so the
  job checkpoints before its time limit. The batch script `exec`s the shim, which passes the
  signal on to the training process and records its exit status.
- State comes from `scontrol show job` (squeue's source, no accounting needed) and, once Slurm has
  forgotten the job, from `sacct` where accounting exists, else from the shim's status file.
- A job Slurm put back in its own queue (PENDING after RUNNING) is reported as Requeued: it runs
  again under the same Slurm id, and its restart count is RUNYARD_RESTART_COUNT + SLURM_RESTART_COUNT.
- Cancel is `scancel`; preemption is `scancel --signal=TERM --full` (checkpoint, exit 4, queue again).
- Before an attempt is submitted, Slurm jobs of earlier attempts still in Slurm's queue are cancelled.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

from runyard.control.backends.base import Ended, Launched, Requeued, attempt_status_file
from runyard.control.states import JobState
from runyard.control.store import Job
from runyard.errors import EXIT_OUT_OF_MEMORY, RunyardError
from runyard.system.slurm import QUEUED_STATES, RUNNING_STATES, parse_sacct, parse_scontrol

LOST_STATES = {"NODE_FAIL", "BOOT_FAIL", "DEADLINE", "TIMEOUT"}
# Slurm's cgroup killed the job for going past --mem: the job's fault, not the node's (the shim's file only
# saw a SIGKILL, so this state wins over it).
OUT_OF_MEMORY_STATE = "OUT_OF_MEMORY"


class SlurmError(RunyardError):
    """A Slurm command failed; the message has its output."""


def _run(argv: list[str], env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    if check and proc.returncode != 0:
        raise SlurmError(f"{' '.join(argv[:2])} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _exit_code(value: str) -> tuple[int | None, int | None]:
    """Slurm's 'rc:signal' -> (returncode, signal)."""
    rc, _, sig = value.partition(":")
    rc_i, sig_i = int(rc or 0), int(sig or 0)
    return (None, sig_i) if sig_i else (rc_i, None)


class SlurmBackend:
    name = "slurm"
    allocates_itself = True

    def __init__(self, partition: str | None = None, gres: str | None = "gpu", sbatch_args: list[str] | None = None,
                 signal_before_limit_s: int = 60):
        self.partition, self.gres = partition, gres or None
        self.sbatch_args = list(sbatch_args or [])
        self.signal_before_limit_s = signal_before_limit_s
        self._state: dict[int, str] = {}  # job id -> last Slurm state seen
        self._has_sacct: bool | None = None

    # -- submit -----------------------------------------------------------------------------------

    def batch_script(self, job: Job) -> str:
        """The sbatch script of the job's current attempt."""
        status = attempt_status_file(job)
        shim = [sys.executable, "-m", "runyard.control.shim", str(status), "--forward-signals", "--", *job.argv]
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name=runyard-{job.id}-{job.name[:40]}",
            f"#SBATCH --output={job.log_path}",
            "#SBATCH --open-mode=append",
            "#SBATCH --requeue",
            f"#SBATCH --signal=B:TERM@{self.signal_before_limit_s}",
            f"#SBATCH --chdir={job.run_dir}",
        ]
        if self.gres:
            lines.append(f"#SBATCH --gres={self.gres}:{job.devices}")
        else:
            lines.append(f"#SBATCH --cpus-per-task={job.devices}")
        if job.time_limit_s is not None:
            lines.append(f"#SBATCH --time={max(1, math.ceil(job.time_limit_s / 60))}")
        if self.partition:
            lines.append(f"#SBATCH --partition={self.partition}")
        lines += [
            f'echo "=== runyard: job {job.id} attempt {job.attempt} slurm job $SLURM_JOB_ID '
            f'restart ${{SLURM_RESTART_COUNT:-0}} on $(hostname) ==="',
            f"export RUNYARD_RESTART_COUNT=$(( {job.restart_count} + ${{SLURM_RESTART_COUNT:-0}} ))",
            "exec " + shlex.join(shim),
            "",
        ]
        return "\n".join(lines)

    def launch(self, job: Job, env: dict[str, str]) -> Launched:
        job_dir = Path(job.log_path).parent
        job_dir.mkdir(parents=True, exist_ok=True)
        Path(job.run_dir).mkdir(parents=True, exist_ok=True)
        attempt_status_file(job).unlink(missing_ok=True)
        script = job_dir / f"attempt-{job.attempt}.sbatch"
        script.write_text(self.batch_script(job))
        env = {k: v for k, v in env.items() if k not in ("CUDA_VISIBLE_DEVICES", "RUNYARD_DEVICES", "OMP_NUM_THREADS")}
        out = _run(["sbatch", "--parsable", *self.sbatch_args, str(script)], env=env).stdout.strip()
        slurm_id = out.split(";")[0]
        if not slurm_id.isdigit():
            raise SlurmError(f"sbatch printed {out!r}, not a job id")
        self._state[job.id] = "PENDING"
        return Launched(backend_id=slurm_id)

    # -- watch ------------------------------------------------------------------------------------

    def _query(self, slurm_id: str) -> dict[str, str] | None:
        proc = _run(["scontrol", "show", "job", "-o", slurm_id], check=False)
        if proc.returncode == 0 and "JobState=" in proc.stdout:
            return parse_scontrol(proc.stdout)
        if self.has_sacct():
            acct = _run(["sacct", "-j", slurm_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode"], check=False)
            return parse_sacct(acct.stdout)
        return None

    def has_sacct(self) -> bool:
        """Whether Slurm accounting answers (it does not without slurmdbd)."""
        if self._has_sacct is None:
            try:
                probe = _run(["sacct", "-n", "-X", "-j", "1", "-o", "JobID"], check=False)
                self._has_sacct = probe.returncode == 0 and "disabled" not in (probe.stdout + probe.stderr)
            except (OSError, subprocess.SubprocessError):
                self._has_sacct = False
        return self._has_sacct

    def poll(self, job: Job) -> Ended | Requeued | None:
        if job.backend_id is None:
            return self._from_status_file(job)
        info = self._query(job.backend_id)
        if info is None:  # Slurm forgot it and there is no accounting: the shim's file says how it ended
            return self._from_status_file(job)
        state = info["JobState"].split()[0].rstrip("+")
        previous = self._state.get(job.id)
        self._state[job.id] = state
        if state in RUNNING_STATES:
            return None
        if state in QUEUED_STATES:
            if job.state == JobState.RUNNING or previous in RUNNING_STATES:
                return Requeued(detail=f"Slurm requeued job {job.backend_id} ({info.get('Reason', '')})")
            return None
        rc, sig = _exit_code(info.get("ExitCode", "0:0"))
        from_file = self._from_status_file(job, lost_if_missing=False)
        if state == OUT_OF_MEMORY_STATE:
            return Ended(EXIT_OUT_OF_MEMORY, detail=f"Slurm job {job.backend_id} went past its memory limit (OUT_OF_MEMORY)")
        if state == "CANCELLED" and from_file is None:
            return Ended(None, signal=sig or 15, detail=f"Slurm job {job.backend_id} cancelled")
        if from_file is not None:
            return from_file
        if state in LOST_STATES:
            return Ended(None, lost=True, detail=f"Slurm job {job.backend_id} ended {state}")
        return Ended(rc, sig, detail=f"Slurm job {job.backend_id} ended {state}")

    def _from_status_file(self, job: Job, lost_if_missing: bool = True) -> Ended | None:
        try:
            raw = json.loads(attempt_status_file(job).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return Ended(None, lost=True, detail="Slurm no longer knows the job") if lost_if_missing else None
        return Ended(raw.get("returncode"), raw.get("signal"))

    def is_running(self, job: Job) -> bool:
        return self._state.get(job.id) in RUNNING_STATES

    # -- stop -------------------------------------------------------------------------------------

    def terminate(self, job: Job) -> None:
        if job.backend_id is None:
            return
        if job.state == JobState.CANCELLING:
            _run(["scancel", job.backend_id], check=False)
        else:  # preemption: the job checkpoints on SIGTERM and exits 4; we queue it again ourselves
            _run(["scancel", "--signal=TERM", "--full", job.backend_id], check=False)

    def kill(self, job: Job) -> None:
        if job.backend_id is not None:
            _run(["scancel", "--signal=KILL", "--full", job.backend_id], check=False)
            _run(["scancel", job.backend_id], check=False)

    def _slurm_ids(self, job: Job) -> list[str]:
        proc = _run(["squeue", "-h", "-o", "%i %j", "--name", f"runyard-{job.id}-{job.name[:40]}"], check=False)
        return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]

    def adopt(self, job: Job) -> Launched | None:
        """A launch whose sbatch id was never recorded: find it by its job name."""
        ids = self._slurm_ids(job)
        return Launched(backend_id=ids[-1]) if ids else None

    def kill_leftovers(self, job: Job, timeout_s: float = 30.0) -> list[str]:
        """Cancel every Slurm job of earlier attempts still known to Slurm (by name) and wait until Slurm
        has let them go; Slurm ends every process of a job it cancels, on every node."""
        ids = self._slurm_ids(job)
        for slurm_id in ids:
            _run(["scancel", "--signal=KILL", "--full", slurm_id], check=False)
            _run(["scancel", slurm_id], check=False)
        deadline = time.monotonic() + timeout_s
        while ids and (left := [i for i in self._slurm_ids(job) if i in ids]):
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job.id}: Slurm jobs {left} of an earlier attempt would not end")
            time.sleep(0.5)
        return ids
