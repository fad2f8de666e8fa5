"""The embedded backend: each attempt is a process on this machine, in its own session and
process group, with its output appended to the job's log file.

The process launched is the shim (`runyard.control.shim`), which runs the job's command and
records how it ended in a status file, so a daemon restarted after SIGKILL still learns the outcome.
Before each attempt, whatever an earlier attempt left running is killed (`kill_leftovers`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runyard.control import procs
from runyard.control.backends.base import Ended, Launched, attempt_status_file
from runyard.control.store import Job


class LocalBackend:
    name = "local"
    allocates_itself = False

    def __init__(self, instance: str) -> None:
        self.instance = instance  # see procs.instance_id: whose jobs these are
        self._children: dict[int, subprocess.Popen] = {}  # pids this daemon started: reaped here

    def launch(self, job: Job, env: dict[str, str]) -> Launched:
        status = attempt_status_file(job)
        status.unlink(missing_ok=True)
        log_path = Path(job.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        Path(job.run_dir).mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            header = f"=== runyard: job {job.id} attempt {job.attempt} (restart {job.restart_count}) "
            header += f"at {time.strftime('%Y-%m-%dT%H:%M:%S')} on {env.get('RUNYARD_DEVICES', '')} ===\n"
            log.write(header.encode())
            log.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", "runyard.control.shim", str(status), "--", *job.argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=job.run_dir,
                start_new_session=True,  # own session + process group: survives the daemon, signalled as one
            )
        self._children[proc.pid] = proc
        return Launched(pid=proc.pid, pid_start_time=procs.start_time(proc.pid))

    def kill_leftovers(self, job: Job) -> list[str]:
        """SIGKILL every process an earlier attempt left (found by the job's environment marker, whatever
        session or group it moved to), and wait until they are gone; noted in the job's log."""
        killed = procs.kill_leftovers(self.instance, job.id)
        if killed:
            log_path = Path(job.log_path)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a") as log:
                log.write(f"=== runyard: ended {len(killed)} process(es) left by an earlier attempt: "
                          f"{' '.join(map(str, killed))} ===\n")
        return [str(pid) for pid in killed]

    def _reap(self, pid: int) -> int | None:
        proc = self._children.get(pid)
        if proc is None:
            return None
        code = proc.poll()
        if code is not None:
            del self._children[pid]
        return code

    def poll(self, job: Job) -> Ended | None:
        if job.pid is None:
            return self._outcome(job)  # it ended while no daemon watched; the status file says how
        reaped = self._reap(job.pid)
        if reaped is None and job.pid in self._children:
            return None
        if reaped is None and procs.is_alive(job.pid, job.pid_start_time):
            return None  # adopted after a restart: not our child, but alive
        return self._outcome(job)

    def _outcome(self, job: Job) -> Ended:
        status = attempt_status_file(job)
        try:
            raw = json.loads(status.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            # The shim itself died (kill -9 of the group, OOM): the job's processes may linger.
            procs.kill_job_processes(self.instance, job.id)
            return Ended(None, lost=True, detail="the job's process vanished without an exit status")
        return Ended(raw.get("returncode"), raw.get("signal"), detail=raw.get("launch_error", ""))

    def is_running(self, job: Job) -> bool:
        return True

    def terminate(self, job: Job) -> None:
        self._signal_group(job, signal.SIGTERM)

    def kill(self, job: Job) -> None:
        self._signal_group(job, signal.SIGKILL)
        procs.kill_job_processes(self.instance, job.id)  # stragglers that left the group

    def _signal_group(self, job: Job, sig: int) -> None:
        if job.pid is None or not procs.is_alive(job.pid, job.pid_start_time):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, sig)  # the shim leads the group, so pgid == its pid

    def adopt(self, job: Job) -> Launched | None:
        """Find the shim of the current attempt by its environment marker."""
        marker = procs.marker(self.instance, job.id, job.attempt)
        for pid in procs.processes_of_job(self.instance, job.id):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                pgid = os.getpgid(pid)
            except OSError:
                continue
            if f"{procs.MARKER}={marker}".encode() in env and pgid == pid:
                return Launched(pid=pid, pid_start_time=procs.start_time(pid))
        if attempt_status_file(job).exists():
            return Launched(pid=None)  # it ran and ended while we were down
        return None
