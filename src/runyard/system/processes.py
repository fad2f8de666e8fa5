"""Processes that die with their parent, and finding processes by a variable in their environment.

Every process runyard starts must end when the process that started it ends, however that one ends
(SIGKILL and the OOM killer included, where no cleanup code runs). Linux's parent-death signal does
this: `die_with_parent()` asks the kernel to send a signal to the calling process when its parent
exits. It is set in the child, after fork, so there is a window in which the parent may already be
gone; the check against the expected parent's pid closes it.

A process that escaped anyway (started before these rules, or in its own session by a tool) is
found by an environment variable its starter set, which every descendant inherits:
`processes_with_env`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no C library to ask (not Linux)
        return None


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent exits. If `expected_parent` is
    given and the parent is already another process (it died before this call), exit now.
    Returns False where the platform has no parent-death signal (not Linux)."""
    libc = _libc()
    prctl = getattr(libc, "prctl", None) if libc is not None else None
    if prctl is None:  # pragma: no cover - not Linux
        return False
    if prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:  # pragma: no cover - EINVAL only for a bad signal
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)  # the parent died before we could ask: behave as if we had asked
    return True


def popen_dying_with_me(args, sig: int = signal.SIGKILL, **popen_kwargs) -> subprocess.Popen:
    """`subprocess.Popen(args, **popen_kwargs)` for a child sent `sig` when this process exits, however it
    exits. A `preexec_fn` the caller passes runs after the signal is set (so does `start_new_session`).
    The kernel sends it when the *thread* that started the child exits: call this from one that lives."""
    dies = functools.partial(die_with_parent, sig, os.getpid())
    theirs = popen_kwargs.pop("preexec_fn", None)
    preexec = dies if theirs is None else lambda: (dies(), theirs())
    return subprocess.Popen(args, preexec_fn=preexec, **popen_kwargs)


def parent_of(pid: int) -> int | None:
    """The parent pid of `pid` (from /proc), or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2 :].split()[1])


def is_zombie_or_gone(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return raw[raw.rindex(")") + 2 :].split()[0] in ("Z", "X")


def processes_with_env(name: str, value_prefix: str) -> list[int]:
    """Live (not zombie) pids, other than this one, whose initial environment sets `name` to a value
    starting with `value_prefix`. Processes of other users (unreadable environ) are not listed."""
    wanted = f"{name}={value_prefix}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry.name}/environ").read_bytes()
        except OSError:
            continue
        if any(item.startswith(wanted) for item in env.split(b"\0")) and not is_zombie_or_gone(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)
