"""What leaves a lease's run directory for its tenant, and where it may go.

The run directory was written by a stranger's job, so nothing in it is trusted: only regular
files that are not links and lie inside it are read, checkpoints stay with the provider, and the
results go only into the provider's delivery folders, never replacing anyone else's files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from runyard.system.files import atomic_write_text, fsync_dir, fsync_file

# What a tenant gets of a run directory: everything but checkpoints, logs and scratch -- and with it
# what reproducing the run takes: the spec, the manifest (seeds, data fingerprints, hardware), the
# environment lock (env/) and the metrics, so `runyard compare` can hold two deliveries side by side.
RESULT_PATTERNS = ("eval/**/*", "export/**/*", "spec.yaml", "manifest.json", "data/report.*", "data/held_out.txt",
                   "stages/*/gates.json", "stages/*/metrics.jsonl", "env/requirements.txt", "env/environment.json")
DELIVERY_MARKER = ".runyard-delivery.json"


def delivery_target(results_to: str, tenant: int | None = None, roots: tuple[Path, ...] | None = None) -> Path:
    """The local directory a lease's results go to; ValueError for what this agent cannot deliver to.

    Accepts an absolute path or a file:// URL. Other schemes (e.g. a signed upload URL) are refused
    up front, so the lease is rejected and the escrow returned rather than the work lost. A target
    that already holds something other than an earlier delivery is refused too: the agent never
    replaces a tenant's (or anyone's) files with a run's results; with `tenant` given, an earlier
    delivery is replaced only if it was made for that same tenant.
    """
    if "://" in results_to:
        scheme, _, rest = results_to.partition("://")
        if scheme.lower() != "file":
            raise ValueError(f"results_to {results_to[:200]!r}: this provider delivers only to local paths "
                             f"or file:// URLs, not {scheme}://")
        results_to = rest
    path = Path(results_to)
    if not path.is_absolute() or ".." in path.parts:
        raise ValueError(f"results_to {results_to[:200]!r} must be an absolute path without '..'")
    if roots is not None:
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(os.path.realpath(root)) for root in roots):
            raise ValueError(f"results_to {path} is outside this provider's delivery folders "
                             f"({', '.join(str(r) for r in roots)})")
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ValueError(f"results_to {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / DELIVERY_MARKER).is_file():
        raise ValueError(f"results_to {path} already holds files that are not an earlier runyard delivery")
    if tenant is not None and (path / DELIVERY_MARKER).is_file():
        try:
            earlier = json.loads((path / DELIVERY_MARKER).read_text()).get("tenant")
        except (ValueError, AttributeError):
            earlier = None
        if earlier != tenant:
            raise ValueError(f"results_to {path} holds another tenant's delivery; it is not replaced")
    return path


def deliver_results(run_dir: Path, dest: Path, stamp: dict, roots: tuple[Path, ...] | None = None) -> int:
    """Copy the run's result files into `dest` atomically (all or nothing); returns the files copied.

    The files are assembled in a hidden sibling, fsynced, then renamed into place; an earlier
    delivery at `dest` is swapped out only after the new one is complete.
    """
    delivery_target(str(dest), tenant=stamp.get("tenant"), roots=roots)  # re-check: the target may have changed since the lease was accepted
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    files = [p for p in result_files(run_dir) if "checkpoints" not in p.relative_to(run_dir).parts
             and ".tmp" not in p.name]
    copied = 0
    for src in files:
        target = tmp / src.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        with _open_regular(src) as fh:
            if fh is None:
                continue
            with open(target, "wb") as out:
                shutil.copyfileobj(fh, out)
        fsync_file(target)
        copied += 1
    atomic_write_text(tmp / DELIVERY_MARKER, json.dumps({**stamp, "files": copied}))
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)  # only an empty directory or an earlier delivery gets here (delivery_target)
    tmp.rename(dest)
    fsync_dir(dest.parent)  # the swap itself survives a crash
    shutil.rmtree(old, ignore_errors=True)
    return copied


def result_files(run_dir: Path, patterns: tuple[str, ...] = RESULT_PATTERNS) -> list[Path]:
    """The regular files of the run matching `patterns`, sorted. A link is never followed out of
    the run (a linked folder inside it may be), and nothing but a regular file (no FIFO, no
    device) is ever opened."""
    root = run_dir.resolve()
    found = set()
    for pattern in patterns:
        for path in run_dir.glob(pattern):
            if not path.is_symlink() and path.is_file() and path.resolve().is_relative_to(root):
                found.add(path)
    return sorted(found)


def metrics_digest(run_dir: str | Path) -> str:
    """sha256 over the run's metrics files: evidence that ties a usage record to the work done."""
    h = hashlib.sha256()
    run_dir = Path(run_dir)
    for path in result_files(run_dir, ("stages/*/metrics.jsonl",)):
        with _open_regular(path) as fh:
            if fh is None:
                continue
            h.update(path.relative_to(run_dir).as_posix().encode())
            while block := fh.read(1 << 20):
                h.update(block)
    return "sha256:" + h.hexdigest()


@contextlib.contextmanager
def _open_regular(path: Path) -> Iterator[BinaryIO | None]:
    """`path` opened for reading if it is a regular file, else None. A job may still be running (or
    have left a process behind) and swap a file for a FIFO or a link after it was listed: the
    file is opened without following a link or blocking, and checked once open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        yield None
        return
    with os.fdopen(fd, "rb") as fh:
        yield fh if stat.S_ISREG(os.fstat(fd).st_mode) else None
