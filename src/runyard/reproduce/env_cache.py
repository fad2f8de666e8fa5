"""The cache of built environments: one folder per lock hash, one builder per folder, and pruning.

`STATE/<key>/` is an environment being built or built (`ready.json` last); `STATE/<key>.lock` is the
file a builder holds (flock) while it builds. Every use of a ready environment touches `ready.json`,
so its modification time is the environment's last use, what `prune` goes by. Pruning takes the same
lock without waiting: an environment being built is never removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

READY_FILE = "ready.json"
_KEY_FOLDER = re.compile(r"^[0-9a-f]{24}$")  # lock sha256[:24]: nothing else in the cache is ours to remove


@contextmanager
def exclusive_build(cache_root: Path, key: str) -> Iterator[None]:
    """Hold the builder's lock of environment `key`: a second builder waits, then finds it ready."""
    lock_path = cache_root / f"{key[:24]}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def mark_used(root: Path) -> None:
    """Record that the ready environment at `root` was just used (see `prune`)."""
    with contextlib.suppress(OSError):  # a read-only cache still serves; it is only never pruned
        os.utime(root / READY_FILE)


@dataclass(frozen=True)
class Pruned:
    key: str
    size_bytes: int
    ready: bool  # False: an unfinished build left by a killed builder


def prune(cache_root: Path, unused_for_s: float, now: float, dry_run: bool = False) -> list[Pruned]:
    """Remove the environments not used for `unused_for_s` seconds (and unfinished builds that old);
    returns what was (or, with dry_run, would be) removed. Skips any environment being built."""
    pruned = []
    if not cache_root.is_dir():
        return pruned
    for root in sorted(p for p in cache_root.iterdir() if p.is_dir() and _KEY_FOLDER.match(p.name)):
        ready = (root / READY_FILE).is_file()
        try:
            last_use = (root / READY_FILE).stat().st_mtime if ready else root.stat().st_mtime
        except OSError:
            continue
        if now - last_use < unused_for_s:
            continue
        with open(cache_root / f"{root.name}.lock", "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a builder holds it
            try:
                size = _size(root)
                if not dry_run:
                    shutil.rmtree(root, ignore_errors=True)
                pruned.append(Pruned(root.name, size, ready))
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
    return pruned


def _size(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
