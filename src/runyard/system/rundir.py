"""One writer per run directory.

`runyard run`, `train` and `resume` hold an exclusive lock on `RUN_DIR/.runyard.lock` while they
write (runyard.system.locking: a POSIX lock the kernel drops when the holder dies, never held by a child).
A second writer is refused with the holder's pid, host, start time and command line.

Under the launcher (`--nproc N`), the launcher holds the lock for all its ranks and tells them so
through `RUNYARD_RUN_LOCK=<lock file>@<launcher pid>`: a worker checks that this very launcher still
holds it, and stops if not. Everything the launcher starts carries that variable, so a writer that
takes the lock later can tell whether processes of an earlier holder are still alive (they must
not be: they die with their parent) and refuses to start beside them.

Readers (`generate`, `serve`, `show`) take no lock: they read only what a writer commits atomically
(the export directory, gates.json, the eval report) and say when the run is live (`live_holder`).

The holder cleans what an interrupted writer left behind (`clean_interrupted`): temporary files of
atomic writes (`.NAME.tmp-PID`), temporary checkpoint and export directories.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runyard.errors import RunyardError
from runyard.system.locking import LockBusy, LockHolder, ProcessLock, lock_holder
from runyard.system.processes import processes_with_env

log = logging.getLogger(__name__)

LOCK_FILE = ".runyard.lock"
HELD_FOR_ENV = "RUNYARD_RUN_LOCK"
REMOTE_HOLDER = "remote"  # multi-node: the lock is held by the launcher of node 0, on another host
LEFTOVER_WAIT_S = 10.0  # processes of a dead holder get this long to finish dying (they were signalled)


class RunDirBusy(RunyardError):
    """The run directory has a live writer (or live leftovers of one); this process must not write."""


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOCK_FILE


def live_holder(run_dir: Path) -> LockHolder | None:
    """The process writing `run_dir` right now, or None when the run is not live."""
    return lock_holder(lock_path(run_dir))


def live_message(run_dir: Path) -> str | None:
    """A line for readers: the run is being written, results shown are the last committed ones."""
    holder = live_holder(run_dir)
    if holder is None:
        return None
    return (f"run {run_dir} is live (written by {holder.describe()}): showing its last committed results; "
            "they may change when it finishes")


def _marker_value(path: Path, holder_pid: int | str) -> str:
    return f"{path.resolve()}@{holder_pid}"


def child_env(lock: ProcessLock) -> dict[str, str]:
    """Environment for the processes a holder starts (the launcher's torchrun and its workers)."""
    return {HELD_FOR_ENV: _marker_value(lock.path, os.getpid())}


def remote_child_env(run_dir: Path) -> dict[str, str]:
    """Environment for the workers of a launcher on node > 0: node 0's launcher holds the lock."""
    return {HELD_FOR_ENV: _marker_value(lock_path(run_dir), REMOTE_HOLDER)}


def leftover_processes(run_dir: Path) -> list[int]:
    """Live processes started by an earlier holder of this run directory's lock (not by this one)."""
    prefix = f"{lock_path(run_dir).resolve()}@"
    mine = f"{prefix}{os.getpid()}"
    found = []
    for pid in processes_with_env(HELD_FOR_ENV, prefix):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{HELD_FOR_ENV}={mine}".encode() not in env:
            found.append(pid)
    return found


def acquire(run_dir: Path, wait_leftovers_s: float = LEFTOVER_WAIT_S) -> ProcessLock:
    """Take the run directory's lock or raise RunDirBusy naming who writes it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = ProcessLock(lock_path(run_dir), purpose="writing this run")
    try:
        lock.acquire()
    except LockBusy as exc:
        who = exc.holder.describe() if exc.holder else "another process"
        raise RunDirBusy(
            f"run directory {run_dir} is being written by {who}; one writer at a time. Wait for it to "
            f"finish, or stop it (SIGTERM checkpoints and exits) and then `runyard resume {run_dir}`"
        ) from None
    deadline = time.monotonic() + wait_leftovers_s
    while leftovers := leftover_processes(run_dir):
        if time.monotonic() > deadline:
            lock.release()
            raise RunDirBusy(
                f"run directory {run_dir}: processes of an earlier writer are still running (pids "
                f"{', '.join(map(str, leftovers))}) and would write beside this one; stop them "
                f"(kill {' '.join(map(str, leftovers))}) and try again"
            )
        time.sleep(0.1)
    clean_interrupted(run_dir)
    return lock


def _check_launcher(run_dir: Path, marker: str) -> None:
    path, _, holder = marker.rpartition("@")
    if path != str(lock_path(run_dir).resolve()):
        raise RunDirBusy(f"this worker was started to write {path}, not {run_dir}")
    if holder == REMOTE_HOLDER:
        return  # node 0's launcher holds it; its pid means nothing on this host
    current = live_holder(run_dir)
    if current is None or str(current.pid) != holder:
        raise RunDirBusy(
            f"the launcher (pid {holder}) that holds {run_dir} for this worker is gone"
            + (f"; {current.describe()} holds it now" if current else "") + "; stopping"
        )


@contextmanager
def writing(run_dir: Path, rank: int = 0) -> Iterator[ProcessLock | None]:
    """Hold `run_dir` for the block. A worker under runyard's launcher checks the launcher's lock
    instead; under a bare torchrun, rank 0 takes the lock for the job."""
    marker = os.environ.get(HELD_FOR_ENV)
    if marker:
        _check_launcher(Path(run_dir), marker)
        yield None
        return
    if rank != 0:
        yield None
        return
    lock = acquire(run_dir)
    try:
        yield lock
    finally:
        lock.release()


def _is_interrupted_temp(name: str) -> bool:
    # system/files.py's `.NAME.tmp-PID`, checkpoints' `.tmp-step_...-TOKEN`, the export's `.export.tmp-XXXX`.
    return name.startswith(".") and (".tmp-" in name or name.startswith(".tmp-"))


def clean_interrupted(run_dir: Path) -> list[Path]:
    """Remove what interrupted writes left in `run_dir` (only its holder may call this). Returns what
    was removed."""
    removed = []
    for root, dirs, files in os.walk(run_dir):
        for name in files:
            if _is_interrupted_temp(name):
                path = Path(root) / name
                path.unlink(missing_ok=True)
                removed.append(path)
        for name in list(dirs):
            if _is_interrupted_temp(name):
                path = Path(root) / name
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                dirs.remove(name)
    if removed:
        log.info("removed %d temporary file(s) left by an interrupted run in %s", len(removed), run_dir)
    return removed
