"""The run directory's lock (runyard.system.rundir, runyard.system.locking): one writer, named when it refuses another,
released by the kernel when its holder dies, never held by a child of the holder."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from runyard.system import rundir
from runyard.system.locking import LockBusy, ProcessLock, lock_holder
from tests.e2e.faults import ProcessTree, finish, wait_until

# Holds the run directory's lock; with "fork", forks a child (which sleeps) after taking it.
_HOLDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from runyard.system import rundir
    lock = rundir.acquire(Path(sys.argv[1]))
    if sys.argv[2] == "fork" and os.fork() == 0:
        Path(sys.argv[1], "child.pid").write_text(str(os.getpid()))
        time.sleep(120)
        os._exit(0)
    Path(sys.argv[1], "holder.pid").write_text(str(os.getpid()))
    time.sleep(120)
""")


def hold(tree: ProcessTree, run_dir: Path, mode: str = "plain") -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = tree.start([sys.executable, "-c", _HOLDER, str(run_dir), mode])
    wait_until(lambda: (run_dir / "holder.pid").exists(), 60, "the holder to take the lock", proc=proc)
    return proc


@pytest.fixture
def tree():
    t = ProcessTree()
    yield t
    t.kill_all()


def test_a_second_writer_is_refused_with_the_holders_pid_and_host(tmp_path, tree):
    run_dir = tmp_path / "run"
    holder = hold(tree, run_dir)
    with pytest.raises(rundir.RunDirBusy) as err:
        rundir.acquire(run_dir)
    message = str(err.value)
    assert f"pid {holder.pid}" in message and socket.gethostname() in message
    live = rundir.live_holder(run_dir)
    assert live is not None and live.pid == holder.pid and "python" in (live.command or "")
    assert "is live" in rundir.live_message(run_dir)


def test_the_kernel_releases_the_lock_when_its_holder_is_killed(tmp_path, tree):
    run_dir = tmp_path / "run"
    holder = hold(tree, run_dir)
    holder.send_signal(signal.SIGKILL)
    finish(holder, 10)
    assert rundir.live_holder(run_dir) is None and rundir.live_message(run_dir) is None
    lock = rundir.acquire(run_dir)  # no stale lock file to remove by hand
    try:
        assert rundir.live_holder(run_dir).pid == os.getpid()
    finally:
        lock.release()


def test_a_forked_child_never_holds_the_lock(tmp_path, tree):
    run_dir = tmp_path / "run"
    holder = hold(tree, run_dir, mode="fork")
    wait_until(lambda: (run_dir / "child.pid").exists(), 30, "the forked child")
    child = int((run_dir / "child.pid").read_text())
    holder.send_signal(signal.SIGKILL)
    finish(holder, 10)
    assert Path(f"/proc/{child}").exists(), "the child outlived its parent (it has no parent-death signal here)"
    lock = rundir.acquire(run_dir, wait_leftovers_s=0)  # free although the child lives
    lock.release()


def test_asking_who_holds_it_from_the_holding_process_keeps_the_lock(tmp_path, tree):
    run_dir = tmp_path / "run"
    lock = rundir.acquire(run_dir)
    try:
        assert rundir.live_holder(run_dir).pid == os.getpid()  # must not open and close the file
        other = tree.start([sys.executable, "-c", "import sys; from pathlib import Path; from runyard.system import rundir; "
                            "rundir.acquire(Path(sys.argv[1]))", str(run_dir)])
        assert finish(other, 60) != 0
        assert f"pid {os.getpid()}" in other.stderr.read().decode()
    finally:
        lock.release()


def test_threads_of_one_process_exclude_each_other(tmp_path):
    path = tmp_path / "x.lock"
    first = ProcessLock(path, "test").acquire()
    try:
        with pytest.raises(LockBusy):
            ProcessLock(path, "test").acquire()
        got = []
        waiter = threading.Thread(target=lambda: got.append(ProcessLock(path, "test").acquire(blocking=True, poll_s=0.01)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not got, "a blocking acquire waits while another thread holds it"
    finally:
        first.release()
    waiter.join(30)
    assert got and got[0].held
    got[0].release()
    assert lock_holder(path) is None


def test_a_worker_stops_when_its_launcher_no_longer_holds_the_lock(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv(rundir.HELD_FOR_ENV, f"{rundir.lock_path(run_dir).resolve()}@999999")
    with pytest.raises(rundir.RunDirBusy, match="pid 999999.*is gone"), rundir.writing(run_dir):
        pass
    lock = rundir.acquire(run_dir)
    try:
        monkeypatch.setenv(rundir.HELD_FOR_ENV, f"{rundir.lock_path(run_dir).resolve()}@{os.getpid()}")
        with rundir.writing(run_dir) as held:
            assert held is None  # checked, not taken: the launcher holds it for its ranks
    finally:
        lock.release()


def test_the_holder_removes_what_interrupted_writes_left(tmp_path):
    run_dir = tmp_path / "run"
    stage = run_dir / "stages" / "main"
    (stage / "checkpoints" / ".tmp-step_00000004-abcd1234").mkdir(parents=True)
    (stage / "checkpoints" / "step_00000004").mkdir()
    (stage / ".gates.json.tmp-12345").write_text("{")
    (run_dir / ".export.tmp-xyz").mkdir()
    (stage / "metrics.jsonl").write_text("")
    lock = rundir.acquire(run_dir)
    lock.release()
    left = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    assert left == [".runyard.lock", "stages", "stages/main", "stages/main/checkpoints",
                    "stages/main/checkpoints/step_00000004", "stages/main/metrics.jsonl"]
