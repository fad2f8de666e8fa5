"""Disk space: how much is free where, checking estimated needs before work starts, and turning a
failed write on a full disk (ENOSPC, EDQUOT, or a library's own wording of them) into a `DiskFull`
error that says what was being written, where, how much it needed and how much was free.

Standard library only: system/files.py (imported everywhere, without torch) uses it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runyard.errors import DiskFull, InsufficientDiskSpace

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# How libraries that do not raise OSError word it (safetensors, tokenizers, fsspec backends).
_FULL_WORDS = ("no space left on device", "disk quota exceeded", "os error 28", "os error 122")
# Kept free beyond the estimates: filesystems misbehave near full, and estimates are estimates.
RESERVE_BYTES = 64 << 20


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"


def existing_ancestor(path: Path | str) -> Path:
    """`path` itself if it exists, else its nearest existing parent (where it would be created)."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: Path | str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem that holds (or would hold) `path`."""
    st = os.statvfs(existing_ancestor(path))
    return st.f_bavail * st.f_frsize


def mount_point(path: Path | str) -> Path:
    """The mount point of the filesystem holding `path`."""
    p = existing_ancestor(path)
    dev = p.stat().st_dev
    while p != p.parent and p.parent.stat().st_dev == dev:
        p = p.parent
    return p


@dataclass(frozen=True)
class DiskNeed:
    """`bytes` more are needed under `path` to write `what`."""

    what: str
    path: Path
    bytes: int


@dataclass(frozen=True)
class FilesystemCheck:
    """The needs that fall on one filesystem, against what it has free."""

    mount: Path
    needs: list[DiskNeed]
    free: int

    @property
    def needed(self) -> int:
        return sum(n.bytes for n in self.needs)

    @property
    def fits(self) -> bool:
        return self.needed + RESERVE_BYTES <= self.free

    def describe(self) -> list[str]:
        """A headline (the filesystem, needed, free) and one line per need (bytes, what, where)."""
        verdict = "fits" if self.fits else "DOES NOT FIT"
        head = (
            f"filesystem {self.mount}: needs {human_bytes(self.needed)} + {human_bytes(RESERVE_BYTES)} kept "
            f"free, has {human_bytes(self.free)} free: {verdict}"
        )
        return [head] + [f"  {human_bytes(n.bytes):>10}  {n.what}  ({n.path})" for n in self.needs]


def group_by_filesystem(needs: Iterable[DiskNeed]) -> list[FilesystemCheck]:
    """The needs summed per filesystem (two paths on one disk share its free space)."""
    groups: dict[int, list[DiskNeed]] = {}
    anchors: dict[int, Path] = {}
    for need in needs:
        if need.bytes <= 0:
            continue
        anchor = existing_ancestor(need.path)
        dev = anchor.stat().st_dev
        groups.setdefault(dev, []).append(need)
        anchors.setdefault(dev, anchor)
    return [FilesystemCheck(mount_point(anchors[dev]), group, free_bytes(anchors[dev])) for dev, group in groups.items()]


def check_disk(needs: Iterable[DiskNeed], hint: str = "") -> list[FilesystemCheck]:
    """Raise InsufficientDiskSpace, with the figures, if any filesystem lacks room for its needs."""
    checks = group_by_filesystem(needs)
    short = [c for c in checks if not c.fits]
    if short:
        lines = ["not enough free disk space to start:"] + [f"  {line}" for c in short for line in c.describe()]
        if hint:
            lines.append(f"  {hint}")
        raise InsufficientDiskSpace("\n".join(lines))
    return checks


def is_disk_full(exc: BaseException) -> bool:
    """True for a failed write that ran out of space, whoever raised it."""
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return True
    text = str(exc).lower()
    return any(words in text for words in _FULL_WORDS)


def disk_full_error(what: str, path: Path | str, needed: int | None, exc: BaseException | None = None) -> DiskFull:
    where = Path(path)
    free = free_bytes(where)
    need = f"it needed {human_bytes(needed)}" if needed else "the size it needed is unknown"
    cause = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    return DiskFull(
        f"no space left writing {what} at {where} (filesystem {mount_point(where)}): {need}, "
        f"{human_bytes(free)} free. Free some space or write elsewhere{cause}"
    )


@contextmanager
def writing(what: str, path: Path | str, needed: int | None = None) -> Iterator[None]:
    """Writes in this block that fail for lack of space raise DiskFull naming `what`, `path` and `needed`.
    A library that reports a full disk in its own words (torch's "unexpected pos") is recognised by the
    free space left: less than the write needed."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as exc:
        if is_disk_full(exc) or (needed is not None and free_bytes(path) < needed):
            raise disk_full_error(what, path, needed, exc) from exc
        raise


def nbytes_of(obj: Any) -> int:
    """Bytes held by the arrays (torch tensors, numpy arrays: anything with `.nbytes`) in a nest of
    dicts, lists and tuples: what writing them needs, give or take the file format's overhead."""
    if hasattr(obj, "nbytes") and not isinstance(obj, (bytes, bytearray)):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(nbytes_of(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes_of(v) for v in obj)
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    return 0
