"""Exclusive locks that the kernel releases when their holder dies, and that no child inherits.

A `ProcessLock` is a POSIX record lock (fcntl F_SETLK) on a small file. Three properties make it the
right lock for "one writer" guarantees:

- the kernel drops it when the holding process dies, however it dies (SIGKILL, the OOM killer), so
  there is never a stale lock file to clean up by hand;
- it belongs to the process, not to an open file: a child made by fork (a multiprocessing worker
  pool) or by exec never holds it, so a leftover child cannot keep it after its parent is gone
  (flock locks are shared with forked children: that is how issue 10's data workers kept the
  dataset lock after the main process was killed);
- the kernel names the holder's pid (F_GETLK), so a refusal can say who holds it. The holder also
  writes its pid, host, start time and command line into the file, for the message.

POSIX locks do not exclude threads of one process, and closing *any* descriptor of the file drops
the process's lock. So this module keeps a registry of the locks this process holds: a second
acquisition from the same process is refused (or waits, for blocking locks) on a thread lock, and a
reader in the holding process answers from the registry instead of opening the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runyard.errors import RunyardError

# struct flock on Linux (64-bit off_t): short l_type, short l_whence, off_t l_start, off_t l_len,
# pid_t l_pid, padded to 32 bytes.
_FLOCK = struct.Struct("hhqqi4x")


class LockBusy(RunyardError):
    """Another live process holds the lock; `holder` says which."""

    def __init__(self, message: str, holder: LockHolder | None):
        super().__init__(message)
        self.holder = holder


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock: the kernel's pid, and what the holder wrote about itself."""

    pid: int
    host: str | None = None
    started_at: float | None = None
    command: str | None = None
    purpose: str | None = None

    def describe(self) -> str:
        where = f" on {self.host}" if self.host else ""
        since = ""
        if self.started_at is not None:
            since = f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started_at))}"
        what = f" ({self.command})" if self.command else ""
        return f"pid {self.pid}{where}{since}{what}"


# (st_dev, st_ino) of each lock file this process holds -> its holder record; and a thread lock per
# file, so threads of this process queue for it as other processes do.
_held: dict[tuple[int, int], LockHolder] = {}
_thread_locks: dict[str, threading.Lock] = {}
_registry = threading.Lock()


def _forget_after_fork() -> None:
    # A forked child holds none of its parent's POSIX locks: its registry must say so too.
    global _registry
    _held.clear()
    _thread_locks.clear()
    _registry = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def _thread_lock(path: Path) -> threading.Lock:
    with _registry:
        return _thread_locks.setdefault(str(path.resolve()), threading.Lock())


def _key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _kernel_holder_pid(fd: int) -> int | None:
    """The pid of the process holding a conflicting lock on the file, or None when it is free."""
    query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    answer = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_GETLK, query))
    return None if answer[0] == fcntl.F_UNLCK else int(answer[4])


def _read_record(fd: int, kernel_pid: int) -> LockHolder:
    try:
        raw = os.pread(fd, 4096, 0)
        record = json.loads(raw.decode()) if raw else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        record = {}
    if not isinstance(record, dict) or record.get("pid") != kernel_pid:
        return LockHolder(kernel_pid)  # the holder has not written its record yet
    return LockHolder(kernel_pid, record.get("host"), record.get("started_at"), record.get("command"),
                      record.get("purpose"))


def _command_line() -> str:
    try:
        return Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode()[:500]
    except OSError:
        return " ".join(sys.argv)[:500]


def lock_holder(path: Path) -> LockHolder | None:
    """Who holds the lock on `path` right now (this process included), or None if nobody does."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    mine = _held.get((st.st_dev, st.st_ino))
    if mine is not None:
        return mine  # opening and closing the file here would drop our own lock
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        pid = _kernel_holder_pid(fd)
        return None if pid is None else _read_record(fd, pid)
    finally:
        os.close(fd)


class ProcessLock:
    """An exclusive lock on `path` held by this process alone (see the module docstring)."""

    def __init__(self, path: Path, purpose: str):
        self.path, self.purpose = Path(path), purpose
        self._fd: int | None = None
        self._thread_lock: threading.Lock | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(
        self,
        blocking: bool = False,
        poll_s: float = 0.2,
        on_wait: Callable[[LockHolder | None], None] | None = None,
    ) -> ProcessLock:
        """Take the lock. Not blocking: raise LockBusy naming the holder. Blocking: wait for it,
        calling `on_wait(holder)` once when another process (or thread) holds it."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this ProcessLock")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tlock = _thread_lock(self.path)
        told = False
        if not tlock.acquire(blocking=False):
            if not blocking:
                raise LockBusy(self._busy_message(lock_holder(self.path)), lock_holder(self.path))
            if on_wait is not None:
                on_wait(lock_holder(self.path))
                told = True
            tlock.acquire()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            while True:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EACCES, errno.EAGAIN):
                        os.close(fd)
                        raise
                    holder = self._holder_from(fd)
                    if not blocking:
                        os.close(fd)
                        raise LockBusy(self._busy_message(holder), holder) from None
                    if on_wait is not None and not told:
                        on_wait(holder)
                        told = True
                    time.sleep(poll_s)
        except BaseException:
            tlock.release()
            raise
        self._fd, self._thread_lock = fd, tlock
        record = LockHolder(os.getpid(), socket.gethostname(), time.time(), _command_line(), self.purpose)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record.__dict__).encode(), 0)
        with _registry:
            _held[_key(fd)] = record
        return self

    def _holder_from(self, fd: int) -> LockHolder | None:
        pid = _kernel_holder_pid(fd)
        return None if pid is None else _read_record(fd, pid)

    def _busy_message(self, holder: LockHolder | None) -> str:
        who = holder.describe() if holder else "another process"
        return f"{self.path.parent} is in use: {who} holds its lock ({self.path.name}, for {self.purpose})"

    def release(self) -> None:
        """Give the lock up (the kernel also does when this process dies). The file stays: removing
        it would let a waiter lock a file that a newcomer then recreates beside it."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with _registry:
            _held.pop(_key(fd), None)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing drops the POSIX lock
        if self._thread_lock is not None:
            self._thread_lock.release()
            self._thread_lock = None

    def __enter__(self) -> ProcessLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
