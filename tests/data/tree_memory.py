"""The peak memory of a process and all its descendants, sampled from /proc while it runs (used by
test_memory.py; benchmarks/data_scale.py has its own copy, since benchmarks do not import the tests)."""

from __future__ import annotations

import os
import threading


def _status_bytes(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass  # the process ended between the listing and the read
    return 0


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


class TreeMemory:
    """While running, samples the summed resident memory (VmRSS) of `pid`'s process tree every
    `interval` seconds and keeps the peak. RSS counts a page shared by forked processes once per
    process, so the sum errs high, the side a limit should be checked on."""

    def __init__(self, pid: int, interval: float = 0.02):
        self.pid, self.interval, self.peak_rss, self.samples = pid, interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = sum(_status_bytes(p, "VmRSS:") for p in descendants(self.pid))
            self.peak_rss = max(self.peak_rss, total)
            self.samples += 1
            self._stop.wait(self.interval)

    def stop(self) -> int:
        """Stop sampling; returns the peak in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak_rss
