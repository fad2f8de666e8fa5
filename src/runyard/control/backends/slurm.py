"""The Slurm backend: each attempt is an sbatch job; Slurm allocates the devices.

- sbatch with the job's devices as GRES (`--gres=gpu:N`, or CPUs with `--gres ''`), `--requeue`
  (Slurm may requeue it after a node failure or `scontrol requeue`), and `--signal=B:TERM@60` so the
  job checkpoints before its time limit. The batch script `exec`s the shim, which passes the
  signal on to the training process and records its exit status.
- State comes from squeue while the job is live, then `scontrol show job` (no accounting needed) and,
  once Slurm has forgotten the job, from `sacct` where accounting exists, else from the shim's status
  file (runyard.system.slurm runs every Slurm command).
- A job Slurm put back in its own queue (PENDING after RUNNING) is reported as Requeued: it runs
  again under the same Slurm id, and its restart count is RUNYARD_RESTART_COUNT + SLURM_RESTART_COUNT.
- Cancel is `scancel`; preemption is `scancel --signal=TERM --full` (checkpoint, exit 4, queue again).
- Before an attempt is submitted, Slurm jobs of earlier attempts still in Slurm's queue are cancelled.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from pathlib import Path

from runyard.control.backends.base import Ended, Launched, Requeued, attempt_status_file
from runyard.control.states import JobState
from runyard.control.store import Job
from runyard.errors import EXIT_OUT_OF_MEMORY
from runyard.system import slurm
from runyard.system.slurm import QUEUED_STATES, RUNNING_STATES, SlurmError, parse_exit_code, state_name

LOST_STATES = {"NODE_FAIL", "BOOT_FAIL", "DEADLINE", "TIMEOUT"}
# Slurm's cgroup killed the job for going past --mem: the job's fault, not the node's (the shim's file only
# saw a SIGKILL, so this state wins over it).
OUT_OF_MEMORY_STATE = "OUT_OF_MEMORY"


def _job_name(job: Job) -> str:
    """The Slurm job name of every attempt of `job` (how a launch whose id was lost is found again)."""
    return f"runyard-{job.id}-{job.name[:40]}"


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
            f"#SBATCH --job-name={_job_name(job)}",
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
        slurm_id = slurm.submit(script, self.sbatch_args, env=env)
        self._state[job.id] = "PENDING"
        return Launched(backend_id=slurm_id)

    # -- watch ------------------------------------------------------------------------------------

    def _query(self, slurm_id: str) -> dict[str, str] | None:
        return slurm.job_state(slurm_id, accounting=self.has_sacct)

    def has_sacct(self) -> bool:
        """Whether Slurm accounting answers (asked once)."""
        if self._has_sacct is None:
            self._has_sacct = slurm.has_accounting()
        return self._has_sacct

    def poll(self, job: Job) -> Ended | Requeued | None:
        if job.backend_id is None:
            return self._from_status_file(job)
        info = self._query(job.backend_id)
        if info is None:  # Slurm forgot it and there is no accounting: the shim's file says how it ended
            return self._from_status_file(job)
        state = state_name(info)
        previous = self._state.get(job.id)
        self._state[job.id] = state
        if state in RUNNING_STATES:
            return None
        if state in QUEUED_STATES:
            if job.state == JobState.RUNNING or previous in RUNNING_STATES:
                return Requeued(detail=f"Slurm requeued job {job.backend_id} ({info.get('Reason', '')})")
            return None
        rc, sig = parse_exit_code(info.get("ExitCode", "0:0"))
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
            slurm.cancel(job.backend_id)
        else:  # preemption: the job checkpoints on SIGTERM and exits 4; we queue it again ourselves
            slurm.cancel(job.backend_id, signal="TERM", full=True)

    def kill(self, job: Job) -> None:
        if job.backend_id is not None:
            slurm.cancel(job.backend_id, signal="KILL", full=True)
            slurm.cancel(job.backend_id)

    def _slurm_ids(self, job: Job) -> list[str]:
        return slurm.jobs_named(_job_name(job))

    def adopt(self, job: Job) -> Launched | None:
        """A launch whose sbatch id was never recorded: find it by its job name."""
        ids = self._slurm_ids(job)
        return Launched(backend_id=ids[-1]) if ids else None

    def kill_leftovers(self, job: Job, timeout_s: float = 30.0) -> list[str]:
        """Cancel every Slurm job of earlier attempts still known to Slurm (by name) and wait until Slurm
        has let them go; Slurm ends every process of a job it cancels, on every node."""
        ids = self._slurm_ids(job)
        for slurm_id in ids:
            slurm.cancel(slurm_id, signal="KILL", full=True)
            slurm.cancel(slurm_id)
        deadline = time.monotonic() + timeout_s
        while ids and (left := [i for i in self._slurm_ids(job) if i in ids]):
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job.id}: Slurm jobs {left} of an earlier attempt would not end")
            time.sleep(0.5)
        return ids
