"""Fault injection for tests: start real processes, kill them, and prove nothing is left behind.

Every process a test starts through `ProcessTree` carries `RUNYARD_TEST_TREE=<token>` in its
environment, and so does every process those start (environments are inherited, also by processes
that leave their parent's session or group). So after a kill the test can list exactly the
processes it started that are still alive, whoever their parent is now (an orphan is adopted by
init), and kill only those. /proc is read directly: the check needs nothing but each process's
environment, which is what psutil would read there too.

Every wait is bounded and fails the test when it runs out: a hang is a failure, never a stuck suite.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from runyard.system.processes import is_zombie_or_gone, popen_dying_with_me, processes_with_env

TREE_ENV = "RUNYARD_TEST_TREE"
FAULT_SEED_ENV = "RUNYARD_FAULT_SEED"


def fault_rng(test_name: str) -> random.Random:
    """The seeded source of 'random moments': RUNYARD_FAULT_SEED (default 0) and the test's name, so a
    failing draw is repeated by running the test again with the seed it printed."""
    seed = int(os.environ.get(FAULT_SEED_ENV, "0"))
    print(f"fault injection: {FAULT_SEED_ENV}={seed} ({test_name})")
    return random.Random(f"{seed}:{test_name}")


class ProcessTree:
    """The processes one test started (and all their descendants)."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "OMP_NUM_THREADS": "1", TREE_ENV: self.token, **extra}

    def start(self, argv: list[str], log: Path | None = None, **popen) -> subprocess.Popen:
        """Start `argv` in its own process group, output to `log` (or pipes)."""
        out = open(log, "ab") if log is not None else subprocess.PIPE  # noqa: SIM115
        try:
            return popen_dying_with_me(argv, env=popen.pop("env", None) or self.env(), stdout=out,
                                   stderr=subprocess.STDOUT if log is not None else subprocess.PIPE,
                                   start_new_session=True, **popen)
        finally:
            if log is not None:
                out.close()

    def runyard(self, *args: str, log: Path | None = None) -> subprocess.Popen:
        return self.start([sys.executable, "-m", "runyard", *args], log=log)

    def alive(self) -> list[int]:
        """Live processes of this tree (this test process excluded)."""
        return processes_with_env(TREE_ENV, self.token)

    def kill_all(self) -> list[int]:
        """SIGKILL every live process of the tree ('kill the whole tree'); returns their pids."""
        pids = self.alive()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def assert_none_left(self, timeout: float = 20.0) -> None:
        """Fail unless every process of the tree has exited within `timeout` (then kill the rest)."""
        deadline = time.monotonic() + timeout
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            described = [f"{pid}: {cmdline(pid)}" for pid in left]
            self.kill_all()
            raise AssertionError(f"{len(left)} orphaned process(es) still alive after {timeout:g}s:\n  "
                                 + "\n  ".join(described))


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "(gone)"


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
        except OSError:
            continue
        if int(raw[raw.rindex(")") + 2 :].split()[1]) == pid and not is_zombie_or_gone(int(stat.parent.name)):
            out.append(int(stat.parent.name))
    return sorted(out)


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, poll: float = 0.02):
    """Poll `predicate` until it returns something truthy (returned); fail after `timeout` seconds, or
    as soon as `proc` ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process ended first (exit {proc.returncode}): {output_of(proc)}")
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def output_of(proc: subprocess.Popen) -> str:
    if proc.stdout is None:
        return ""
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        return "(no output: still running)"
    return ((out or b"") + (err or b"")).decode(errors="replace")[-3000:] if isinstance(out, bytes) else (
        (out or "") + (err or ""))[-3000:]


def finish(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for `proc` (bounded): a hang fails the test."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"process {proc.args} hung: still running after {timeout:g}s") from None
