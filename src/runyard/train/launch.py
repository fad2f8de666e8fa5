"""Launching worker processes under torchrun (torch.distributed.run), and reading how they ended.

`runyard run SPEC --nproc N` re-runs the same command line in N workers through torchrun; each worker
finds RANK/WORLD_SIZE in its environment and joins the process group (train/parallel.py). Multi-node is
the same command on every node with --nnodes, --node-rank and --rdzv-endpoint HOST:PORT (c10d rendezvous).

How a job ends is decided in two places:
- a worker that stops *on purpose* (gates failed, preempted after its checkpoint, a bad spec: any
  RunyardError) writes its exit code to a status file and exits 0, so torchrun does not restart it;
  the launcher returns that code (3, 4, ...), the same as a single process would;
- a worker that *dies* (an exception, SIGKILL, the OOM killer, a lost node) exits non-zero; torchrun
  restarts all workers up to --max-restarts times and they resume from the last good checkpoint.
  Each failure is reported in `run_dir/failures.json` (from torchrun's per-attempt log directory under
  `run_dir/launch/`), and the recovery figures are in `run_dir/recovery.json` (train/recovery.py).

SIGTERM or SIGINT to the launcher is passed to torchrun, which passes SIGTERM to the workers: they agree
to stop at the next step boundary, checkpoint, and the launcher exits 4. torchrun SIGKILLs workers
that have not exited 30 s later, so the stop is bounded.

No orphans, one writer (issue 10):
- the launcher holds the run directory's lock (runyard.system.rundir) for all its ranks; the workers check
  that it still does;
- torchrun dies with the launcher, and the workers with torchrun (parent-death signal, SIGKILL): a
  killed launcher or torchrun never leaves workers that train on beside a retry. SIGKILL rather than
  a graceful stop because the lock goes with the launcher: nothing may write after it;
- a job that ends because torchrun or its workers were killed by a signal exits 128 + the signal
  (137 when the signal is not known), as a shell reports a killed process: the control plane files
  it as `infra`, not as an error in the training code;
- the launcher's status folder (under the temporary directory) is removed when it ends, and folders
  of launchers that were killed are removed by the next launcher.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from runyard.errors import EXIT_FAILURE, RunyardError
from runyard.system import rundir
from runyard.system.cpus import choose_threads
from runyard.system.files import atomic_write_text
from runyard.system.processes import die_with_parent, parent_of
from runyard.train.recovery import read_recovery

UNDER_LAUNCHER = "RUNYARD_UNDER_TORCHRUN"
STATUS_DIR = "RUNYARD_STATUS_DIR"
LAUNCHER_PID = "RUNYARD_LAUNCHER_PID"
FAILURES_FILE = "failures.json"
STATUS_PREFIX = "runyard-launch-"
EXIT_KILLED = 128 + signal.SIGKILL  # how a shell reports a process killed by SIGKILL
NO_ERROR_RECORD = "ended without an error record (killed by a signal, e.g. SIGKILL or the OOM killer)"


def under_launcher() -> bool:
    return os.environ.get(UNDER_LAUNCHER) == "1" or "TORCHELASTIC_RUN_ID" in os.environ


def torchrun_command(
    worker_argv: list[str],
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    log_dir: Path | None = None,
) -> list[str]:
    """The torchrun command line that runs `runyard <worker_argv>` in each worker."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise RunyardError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    else:
        cmd += ["--standalone"]
    if log_dir is not None:
        cmd += [f"--log-dir={log_dir}"]
    return cmd + ["-m", "runyard", *worker_argv]


# -- worker side ---------------------------------------------------------------------------------------
def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _write_status(code: int, message: str) -> None:
    status_dir = Path(os.environ[STATUS_DIR])
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    path = status_dir / f"attempt_{_attempt()}_rank_{rank}.json"
    atomic_write_text(path, json.dumps({"exit_code": code, "message": message, "rank": int(os.environ.get("RANK", "0"))}))


def bind_to_launcher() -> None:
    """In a worker: die with torchrun (which starts workers in their own sessions, so nothing else
    would end them if torchrun is killed), and exit now if torchrun is already gone."""
    die_with_parent(signal.SIGKILL)
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher and parent_of(os.getppid()) != int(launcher):
        os.kill(os.getpid(), signal.SIGKILL)  # torchrun died before the parent-death signal was set


def run_worker(fn: Callable[[], int]) -> int:
    """Run a worker's body. Under the runyard launcher a RunyardError is an outcome, not a crash: it is
    reported through the status file and the worker exits 0 (see the module docstring). Any other
    exception propagates (torchrun's `record` writes it to the attempt's error file first)."""
    if under_launcher():
        bind_to_launcher()
    if not os.environ.get(STATUS_DIR):
        return fn()
    # torch only here, in a worker: every `runyard` verb imports this module, and the market and
    # control-plane verbs must start without the training stack.
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        code = record(fn)()
    except RunyardError as exc:
        print(f"runyard: {exc}", file=sys.stderr)
        _write_status(exc.exit_code, str(exc))
        return 0
    _write_status(int(code or 0), "")
    return int(code or 0)


# -- launcher side -------------------------------------------------------------------------------------
def _clean_stale_status_dirs() -> None:
    """Remove the status folders of launchers that were killed (their pid, in the name, is gone)."""
    for path in Path(tempfile.gettempdir()).glob(f"{STATUS_PREFIX}*"):
        pid = path.name[len(STATUS_PREFIX) :].split("-", 1)[0]
        if path.is_dir() and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(path, ignore_errors=True)


def _statuses(status_dir: Path) -> dict[int, dict[int, dict]]:
    """{attempt: {local rank: status}} from the workers' status files."""
    out: dict[int, dict[int, dict]] = {}
    for path in status_dir.glob("attempt_*_rank_*.json"):
        _, attempt, _, rank = path.stem.split("_")
        out.setdefault(int(attempt), {})[int(rank)] = json.loads(path.read_text())
    return out


def failure_report(log_dir: Path, statuses: dict[int, dict[int, dict]], nproc: int) -> list[dict]:
    """One entry per failed attempt: which ranks died and how (their error file, or none: a signal)."""
    attempts = sorted({int(p.name.split("_")[1]) for p in log_dir.glob("*/attempt_*")} | set(statuses))
    report = []
    for attempt in attempts:
        done = statuses.get(attempt, {})
        if len(done) == nproc:
            continue
        ranks = []
        for rank in range(nproc):
            if rank in done:
                continue
            errors = list(log_dir.glob(f"*/attempt_{attempt}/{rank}/error.json"))
            message = NO_ERROR_RECORD
            if errors:
                try:
                    err = json.loads(errors[0].read_text())["message"]
                    message = (err.get("message") if isinstance(err, dict) else str(err)) or message
                    message = message.strip().splitlines()[0][:500] if message.strip() else message
                except (json.JSONDecodeError, KeyError, OSError):
                    pass
            ranks.append({"local_rank": rank, "error": message})
        report.append({"attempt": attempt, "failed_ranks": ranks})
    return report


def _write_failures(run_dir: Path, entry: dict) -> None:
    path = run_dir / FAILURES_FILE
    runs = json.loads(path.read_text()).get("launches", []) if path.is_file() else []
    atomic_write_text(path, json.dumps({"launches": runs + [entry]}, indent=1))


def launch(worker_argv: list[str], nproc: int, run_dir: Path | None = None, **kwargs) -> int:
    """Run the workers under torchrun and return the job's exit code: the workers' own code when they
    ended on purpose (0, 3, 4, ...), 128 + a signal when torchrun or the workers were killed, else 1;
    each failure is reported (also when restarts recovered). The run directory is held for the ranks."""
    lock = None
    if run_dir is not None and kwargs.get("node_rank", 0) == 0:
        lock = rundir.acquire(run_dir)  # RunDirBusy before any worker starts
    try:
        return _launch_locked(worker_argv, nproc, run_dir, lock, **kwargs)
    finally:
        if lock is not None:
            lock.release()


def worker_threads(nproc: int) -> int:
    """Each of `nproc` local workers' share of this launcher's threads (runyard/system/cpus.py: OMP_NUM_THREADS when
    a scheduler set it for the whole job, else the cores this process may use), at least one."""
    return max(1, choose_threads(None, 1).threads // max(1, nproc))


def _launch_locked(worker_argv: list[str], nproc: int, run_dir: Path | None, lock, **kwargs) -> int:
    _clean_stale_status_dirs()
    status_dir = Path(tempfile.mkdtemp(prefix=f"{STATUS_PREFIX}{os.getpid()}-"))
    try:
        stamp = time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
        log_dir = (run_dir / "launch" / stamp) if run_dir is not None else status_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **{UNDER_LAUNCHER: "1", STATUS_DIR: str(status_dir), LAUNCHER_PID: str(os.getpid())})
        if lock is not None:
            env.update(rundir.child_env(lock))
        elif run_dir is not None:
            env.update(rundir.remote_child_env(run_dir))
        env["OMP_NUM_THREADS"] = str(worker_threads(nproc))  # torchrun would set 1
        cmd = torchrun_command(worker_argv, nproc, log_dir=log_dir, **kwargs)
        launcher = os.getpid()
        # Own session (a terminal's Ctrl-C reaches the launcher only, which forwards it), and death with
        # the launcher: SIGKILL, since the run directory's lock dies with the launcher too.
        proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(signal.SIGKILL, launcher))

        def forward(signum, _frame):
            proc.send_signal(signal.SIGTERM)  # torchrun SIGTERMs its workers: checkpoint, exit 4

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            rc = proc.wait()
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
        return _outcome(rc, status_dir, log_dir, nproc, run_dir)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def _outcome(rc: int, status_dir: Path, log_dir: Path, nproc: int, run_dir: Path | None) -> int:
    statuses = _statuses(status_dir)
    report = failure_report(log_dir, statuses, nproc)
    final = max(statuses) if statuses else None
    ended_on_purpose = final is not None and len(statuses[final]) == nproc and not any(
        r["attempt"] >= final for r in report
    )
    killed = None
    if ended_on_purpose:
        code = min(statuses[final].items())[1]["exit_code"]
    elif rc < 0:
        killed = f"torchrun was killed by {signal.Signals(-rc).name}; its workers went with it"
        code = 128 - rc
    elif report and all(r["error"] == NO_ERROR_RECORD for r in report[-1]["failed_ranks"]):
        killed = "the workers were killed by a signal (no restarts left)"
        code = EXIT_KILLED
    else:
        code = rc or EXIT_FAILURE
    if code < 0 or code > 255:
        code = EXIT_FAILURE
    if killed:
        print(f"runyard: {killed} (exit {code}: an infrastructure failure, not an error in the training code)",
              file=sys.stderr)
    if report and run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_failures(run_dir, {"logs": str(log_dir), "torchrun_exit": rc, "exit_code": code, "failures": report})
        _print_failures(report, run_dir, recovered=ended_on_purpose)
    return code


def _print_failures(report: list[dict], run_dir: Path, recovered: bool) -> None:
    print(f"runyard: {len(report)} worker failure(s){', recovered' if recovered else ''}:", file=sys.stderr)
    for entry in report:
        for r in entry["failed_ranks"]:
            print(f"  attempt {entry['attempt']}: local rank {r['local_rank']} {r['error']}", file=sys.stderr)
    for e in read_recovery(run_dir):
        if e.get("kind") == "restart":
            print(
                f"  restart {e['restart_count']}: resumed stage {e['stage']} from step {e['resumed_from_step']}, "
                f"{e['steps_lost']} step(s) lost, first resumed step {e['seconds_to_first_resumed_step']} s "
                "after the last step before the failure",
                file=sys.stderr,
            )
    print(f"  details: {run_dir / FAILURES_FILE}", file=sys.stderr)
