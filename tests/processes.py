"""Processes the tests start: `popen` is `subprocess.Popen` for a child that dies with the test process."""

from __future__ import annotations

import functools
import os
import signal
import subprocess

from runyard.system.processes import die_with_parent


def popen(args, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)`, the child given a parent-death signal tied to this process (run
    after start_new_session, before a preexec_fn the call passes). SIGKILL, not SIGTERM: a server stops on
    SIGTERM when it likes, a run first checkpoints, and some helpers ignore it; nobody waits for that output.
    The kernel sends it when the *thread* that started the child exits: call this from the main thread."""
    # A killed pytest worker must not leave the servers and runs it started behind (orphans of init).
    dies = functools.partial(die_with_parent, signal.SIGKILL, os.getpid())
    theirs = kwargs.pop("preexec_fn", None)
    preexec = dies if theirs is None else lambda: (dies(), theirs())
    return subprocess.Popen(args, preexec_fn=preexec, **kwargs)
