"""system/processes.popen_dying_with_me: a child dies when the process that started it is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runyard.system.processes import is_zombie_or_gone, popen_dying_with_me

ROOT = Path(__file__).resolve().parents[2]

# Stands in for a pytest worker: starts a sleeper through the helper (in a session of its own, with a
# preexec_fn of its own, as callers combine them), says its pid, and waits to be killed.
STARTER = """
import os, sys, time
from runyard.system.processes import popen_dying_with_me
child = popen_dying_with_me([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True,
              preexec_fn=lambda: os.nice(1))
print(child.pid, flush=True)
time.sleep(300)
"""


def niceness(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[16])


def test_a_child_started_through_the_helper_dies_when_its_starter_is_killed():
    starter = popen_dying_with_me([sys.executable, "-c", STARTER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(starter.stdout.readline())
        assert not is_zombie_or_gone(child)
        assert os.getsid(child) == child, "start_new_session was kept"
        assert niceness(child) == niceness(starter.pid) + 1, "the caller's preexec_fn ran too"
        starter.kill()  # SIGKILL: no cleanup code of the starter runs, only the kernel's signal
        starter.wait(30)
        deadline = time.monotonic() + 30
        while not is_zombie_or_gone(child):
            assert time.monotonic() < deadline, f"the child {child} outlived its killed starter"
            time.sleep(0.05)
    finally:
        starter.kill()
        starter.wait(30)
        starter.stdout.close()
        if child is not None and not is_zombie_or_gone(child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)  # when the test failed: leave nothing behind
