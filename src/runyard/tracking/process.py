"""The mirror's own process: `python -m runyard.tracking RUN_DIR --parent PID`, started by rank 0.

Out of the training process, the mirror's imports (MLflow, SQLAlchemy: seconds of CPU) and its sends never
hold the trainer's GIL. Its one-time set-up (the imports, MLflow's store) and its final pass run at the
run's priority; the syncs in between, while the run trains, on a thread at nice +10. It only reads the run
directory, so it needs nothing from the run but the spec and the moment the session ends. The protocol is
its stdin and stdout:

- the parent writes the spec (one JSON line), and when the session ends the status to close the tracked
  run with (FINISHED, FAILED or KILLED, one line);
- the mirror then sends what is left and writes its problems (one JSON line) on its stdout (what libraries
  print goes to stderr), and exits.

The parent waits at most `tracking.flush_timeout_s` for that, then kills it. The mirror dies with its
parent (the kernel's parent-death signal: a SIGKILLed run leaves no mirror behind), and ignores SIGINT and
SIGTERM, which a terminal or a scheduler sends the run's whole process group: the run decides when the
mirror ends, so a Ctrl-C still closes the tracked run as KILLED.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import runyard
from runyard.errors import Preempted
from runyard.spec.job import JobSpec, parse_spec
from runyard.system.processes import die_with_parent
from runyard.tracking.mirror import Mirror
from runyard.tracking.sinks import TRACKING_DIR, check_installed

log = logging.getLogger(__name__)

# Set in the mirror's environment to the run directory: how it is found (system.processes.processes_with_env).
MIRROR_ENV = "RUNYARD_TRACKING_MIRROR"
NICENESS = 10
STATUSES = ("FINISHED", "FAILED", "KILLED")


class MirrorProcess:
    """The parent's handle on a running mirror."""

    def __init__(self, spec: JobSpec, run_dir: Path):
        self.spec, self.run_dir = spec, run_dir.resolve()
        # The child imports the same runyard as this process, wherever that came from.
        package_root = str(Path(runyard.__file__).resolve().parent.parent)
        env = dict(os.environ, OMP_NUM_THREADS="1", **{MIRROR_ENV: str(self.run_dir)})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runyard.tracking", str(self.run_dir), "--parent", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.pid = self.proc.pid
        try:
            self.proc.stdin.write(spec.model_dump_json() + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died at once; close() reports how
            pass

    def close(self, status: str) -> list[str]:
        """Tell the mirror the session ended with `status`, wait at most `tracking.flush_timeout_s` for it to
        send the rest, kill it if it has not finished, and return the problems (each also logged)."""
        timeout = self.spec.tracking.flush_timeout_s
        try:
            out, _ = self.proc.communicate(status + "\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            problems = [f"tracking: the trackers did not finish sending within {timeout:g} s "
                        "(tracking.flush_timeout_s); the rest is sent by the next `runyard resume`"]
        else:
            problems = _problems(out, self.proc.returncode, self.pid)
        for problem in problems:
            log.warning("%s", problem)
        return problems


def _problems(out: str, returncode: int, pid: int) -> list[str]:
    lines = out.strip().splitlines()
    try:
        return list(json.loads(lines[-1])["problems"])
    except (IndexError, ValueError, KeyError, TypeError):
        return [f"tracking: the mirror process (pid {pid}) exited with status {returncode} before it reported; "
                "its error is above. Nothing is lost: the next `runyard resume` of this run sends what was not sent"]


@contextlib.contextmanager
def mirrored(spec: JobSpec, run_dir: Path, is_main: bool) -> Iterator[MirrorProcess | None]:
    """Mirror `run_dir` into the spec's trackers, from a process of its own, while the body runs (rank 0
    only; the others and a spec without tracking get None). The tracked run ends FINISHED, KILLED (stopped by
    a signal) or FAILED."""
    if not is_main or not spec.tracking.enabled:
        yield None
        return
    check_installed(spec)
    (run_dir / TRACKING_DIR).mkdir(parents=True, exist_ok=True)
    mirror = MirrorProcess(spec, run_dir)
    status = "FAILED"
    try:
        yield mirror
        status = "FINISHED"
    except (KeyboardInterrupt, Preempted):
        status = "KILLED"
        raise
    finally:
        mirror.close(status)


def _follow(mirror: Mirror, stop: threading.Event) -> None:
    """Sync every `tracking.interval_s` until `stop`, on a thread at a lower CPU priority (Linux keeps a nice
    value per thread), so that while the run trains the mirror takes only CPU the run leaves idle."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICENESS)
    while not stop.wait(mirror.spec.tracking.interval_s):
        mirror.sync(final=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runyard.tracking", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--parent", type=int, required=True, help="the run's pid: the mirror dies with it")
    args = parser.parse_args(argv)
    die_with_parent(signal.SIGKILL, expected_parent=args.parent)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the run's group gets these; the run tells us when to end
        signal.signal(sig, signal.SIG_IGN)
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr; stdout carries the report alone
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    spec_line = sys.stdin.readline()
    if not spec_line.strip():
        return 0  # the run ended before it sent the spec: nothing to mirror
    mirror = Mirror(parse_spec(json.loads(spec_line), "<the run's spec>"), args.run_dir)
    # The one-time part (importing MLflow, setting up its store) at the run's priority: niced on a busy
    # machine it could take minutes and still be going when the run ends, eating into flush_timeout_s.
    mirror.sync(final=False)
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(mirror, stop), name="runyard-tracking", daemon=True)
    follower.start()
    line = sys.stdin.readline().strip()  # "" when the run closed the pipe without a word
    stop.set()
    follower.join()
    status = line if line in STATUSES else "KILLED"
    # The final pass on this thread, at the run's priority: the run has stopped training and is waiting.
    problems = mirror.finish(status)
    report.write(json.dumps({"problems": problems}) + "\n")
    report.flush()
    return 0
