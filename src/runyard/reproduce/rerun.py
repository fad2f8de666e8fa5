"""Rerun a spec inside a built environment: here (`local`) or as a Slurm job (`slurm`).

Either way the command is the environment's own `python -m runyard run SPEC --run-dir INTO`, started from
the original run's working directory, with a fresh data cache (so the data stage runs again and its
fingerprint is compared too) and the environment's archive folder on PIP_FIND_LINKS (so the rerun's
own lock proves every hash). The rerun never outlives this process: a local one is in its own process
group with a parent-death signal, a Slurm one is cancelled if this process is interrupted.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from runyard.reproduce.errors import RerunFailed
from runyard.system import slurm
from runyard.system.processes import popen_dying_with_me
from runyard.system.slurm import SlurmError, state_name

BACKENDS = ("local", "slurm")
_SLURM_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}
_POLL_S = 1.0


def rerun_command(python: Path, spec_path: Path, into: Path) -> list[str]:
    return [str(python), "-m", "runyard", "run", str(spec_path), "--run-dir", str(into), "--no-progress"]


def rerun_environment(python: Path, archives: Path, data_cache: Path) -> dict[str, str]:
    """This process's environment, pointed at the built venv; nothing that would import other code."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    venv = python.parent.parent
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_FIND_LINKS"] = " ".join([str(archives)] + env.get("PIP_FIND_LINKS", "").split())
    env["RUNYARD_CACHE_DIR"] = str(data_cache)
    return env


def run_local(argv: list[str], cwd: Path, env: dict[str, str], log_path: Path) -> int:
    """Run `argv` here; its output goes to `log_path`. Returns its exit code."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        # SIGTERM (a checkpoint, then exit) if this process dies, even by SIGKILL: the run leads its own session.
        proc = popen_dying_with_me(argv, signal.SIGTERM, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            return proc.wait()
        except BaseException:
            _stop_group(proc)
            raise


def _stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the run checkpoints and exits 4
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def slurm_script(argv: list[str], cwd: Path, log_path: Path, status_file: Path, cpus: int, name: str) -> str:
    """The batch script: the shim (which records the exit status) runs the rerun and passes signals on."""
    shim = [argv[0], "-m", "runyard.control.shim", str(status_file), "--forward-signals", "--", *argv]
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name=runyard-reproduce-{name[:40]}",
        f"#SBATCH --output={log_path}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={cwd}",
        f"#SBATCH --cpus-per-task={cpus}",
        "#SBATCH --ntasks=1",
        "exec " + shlex.join(shim),
        "",
    ])


def run_slurm(argv: list[str], cwd: Path, env: dict[str, str], log_path: Path, work_dir: Path, cpus: int,
              name: str, sbatch_args: list[str] | None = None) -> tuple[int, str]:
    """Submit `argv` as a Slurm job and wait for it. Returns (exit code, Slurm job id)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    status_file = work_dir / "slurm-exit.json"
    status_file.unlink(missing_ok=True)
    script = work_dir / "rerun.sbatch"
    script.write_text(slurm_script(argv, cwd, log_path, status_file, cpus, name))
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    try:
        job_id = slurm.submit(script, sbatch_args or [], env=env)
    except SlurmError as exc:
        raise RerunFailed(str(exc)) from None
    try:
        gone_since = None
        while True:
            if status_file.is_file():
                status = json.loads(status_file.read_text())
                if status.get("signal"):
                    return 128 + int(status["signal"]), job_id
                return int(status.get("returncode") or 0), job_id
            info = slurm.job_state(job_id, accounting=False)  # None: Slurm has forgotten it
            state = None if info is None else state_name(info)
            if state is None or state in _SLURM_ENDED:
                # The shim writes its file before the job ends; give the file system a moment.
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > 30:
                    raise RerunFailed(f"Slurm job {job_id} ended {state or '(forgotten)'} without an exit status; "
                                      f"see {log_path}")
            time.sleep(_POLL_S)
    except BaseException:
        if not status_file.is_file():
            slurm.cancel(job_id)
        raise
