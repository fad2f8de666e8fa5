"""A lease's disk quota: the bytes and files its work folder may hold (its run directory, HOME,
TMPDIR and caches all live there), and the free space the provider keeps whatever the lease does.

Two ways to hold a job to it, chosen by the launcher at each attempt (`enforce`):

- kernel: where the launcher runs as root and has mkfs.ext4 and mount, the work folder is a
  filesystem of its own: a sparse ext4 image of exactly the quota's bytes with the quota's number
  of inodes, loop-mounted on `work/`. A write past it fails with ENOSPC: no overshoot at all. The
  image takes the provider's disk only as the job writes (never more than the quota), so a
  provider with many leases does not reserve every quota up front; the floor is watched instead. The image sits beside the lease folder (`lease-<id>.disk`, outside what the
  sandbox shows) and stays mounted until the lease is over (its results delivered); the image
  stays, with the run directory in it, until the lease's folder is removed (`release`). The quota's bytes include ext4's own
  overhead (its journal and inode tables: a few percent).
- watchdog: elsewhere (an unprivileged provider, no loop devices) a thread of the launcher totals
  the work folder's bytes (allocated blocks) and files every `interval_s`, and kills the job's
  processes when either is past the quota. The overshoot is bounded by what the job can write in
  one interval plus one scan.

The floor: a lease is accepted, and each attempt started, only while the provider's disk has more
than `floor_bytes` free; while the job runs the launcher looks at the free space every interval
(both ways) and stops the job when it fell below the floor, so no lease takes the disk further
below it than one interval's writes.

A job past its quota is the tenant's failure (exit `EXIT_DISK_QUOTA`, not retried: the same job
fills the same quota), with the reason in the lease folder's failure.json. A watchdog stop for
the provider's floor while the job is within its quota is the provider's (reported as a kill).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runyard.errors import RunyardError

MIB = 1 << 20
WORK_DIRS = ("run", "home", "tmp", "cache")  # what runyard.control.lease_job.LeaseFolder.create makes


class DiskShort(RunyardError):
    """The provider cannot give the lease its quota without going below its free-space floor."""


@dataclass(frozen=True)
class DiskQuota:
    bytes: int
    files: int
    floor_bytes: int  # the provider's free space never goes below this (where this lease decides)

    def describe(self) -> str:
        return f"{self.bytes} bytes and {self.files} files"


def image_path(root: str | Path) -> Path:
    """The lease's filesystem image: beside its folder, outside what the sandbox shows."""
    root = Path(root)
    return root.parent / f"{root.name}.disk"


def kernel_means() -> str | None:
    """Why this process cannot give a lease a filesystem of its own, or None when it can."""
    if os.geteuid() != 0:
        return "the launcher is not root"
    missing = [tool for tool in ("mkfs.ext4", "mount", "umount") if shutil.which(tool) is None]
    return f"{', '.join(missing)} not found" if missing else None


def check_floor(where: Path, wanted: int, floor: int) -> None:
    """DiskShort unless `wanted` more bytes at `where` leave at least `floor` free."""
    free = shutil.disk_usage(where).free
    if free - wanted < floor:
        raise DiskShort(f"the provider's disk at {where} has {free} bytes free; a lease's quota of {wanted} bytes "
                        f"would leave less than its free-space floor of {floor} bytes")


def mount(root: str | Path, quota: DiskQuota) -> str:
    """Make `root/work` a filesystem of the quota's size (once: the image is kept across attempts)
    and mount it; what was done, for the job's log. DiskShort when the floor forbids it; OSError
    (or CalledProcessError) when the kernel will not: the caller falls back to the watchdog."""
    work = Path(root) / "work"
    work.mkdir(parents=True, exist_ok=True)
    if not os.path.ismount(work):
        image = image_path(root)
        if not image.exists():
            made = image.with_suffix(".disk-new")
            fd = os.open(made, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, quota.bytes)  # sparse: the provider's disk is taken as the job writes
            finally:
                os.close(fd)
            _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-N", str(quota.files),
                  "-E", f"lazy_itable_init=1,nodiscard,root_owner={os.getuid()}:{os.getgid()}", str(made)])
            os.replace(made, image)
        # noinit_itable: no background zeroing of inode tables (which would write them all out)
        _run(["mount", "-o", "loop,nosuid,nodev,noatime,noinit_itable", str(image), str(work)])
    for sub in WORK_DIRS:
        (work / sub).mkdir(exist_ok=True)
    return f"disk quota {quota.describe()} (ext4 image {image_path(root)} on {work})"


def release(root: str | Path, remove_image: bool = True) -> None:
    """Unmount the lease's filesystem (if mounted: the lease is over, its results delivered) and, with
    `remove_image` (the lease's folder is going), remove its image."""
    work = Path(root) / "work"
    if os.path.ismount(work):
        try:
            _run(["umount", str(work)])
        except (OSError, subprocess.CalledProcessError):
            _run(["umount", "-l", str(work)])  # still held open: detached now, freed when closed
    if not remove_image:
        return
    image_path(root).unlink(missing_ok=True)
    image_path(root).with_suffix(".disk-new").unlink(missing_ok=True)


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)


def full(work: Path, quota: DiskQuota) -> str | None:
    """Why a job on a quota filesystem ended for its quota (the filesystem is full of bytes or of
    inodes), or None."""
    try:
        st = os.statvfs(work)
    except OSError:
        return None
    # A write fails when it does not fit, so a full filesystem still has a little free: the last
    # write's size at most. Within 2% (at least 1 MiB) of its end, the job was at its quota.
    free = st.f_bavail * st.f_frsize
    if free < max(MIB, st.f_blocks * st.f_frsize // 50):
        return f"the job filled its disk quota of {quota.bytes} bytes (work folder {work})"
    if st.f_favail < 2:
        return f"the job made more files than its disk quota of {quota.files} files (work folder {work})"
    return None


def usage(work: Path) -> tuple[int, int]:
    """Bytes (allocated blocks) and entries (files, folders, links) under `work`, links not followed."""
    total, count = 0, 0
    stack = [str(work)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue  # removed while we looked
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            count += 1
            total += st.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return total, count


class Watchdog:
    """Polls the provider's free space and (with `scan`: no filesystem of its own holds the job) the
    work folder's totals; calls `kill` once when the job is past its quota (`tenants` True) or the
    disk is below the floor (`tenants` False)."""

    def __init__(self, work: Path, quota: DiskQuota, kill: Callable[[], None], interval_s: float = 1.0,
                 scan: bool = True):
        self.work, self.quota, self.kill, self.interval_s, self.scan = work, quota, kill, interval_s, scan
        self.reason: str | None = None
        self.tenants = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="disk-quota", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching, with one last look at the quota: a job that wrote past it and ended between two
        looks is still past it (what it left is in the work folder). The floor is not looked at again:
        the job is over, so it takes no more of the provider's disk."""
        self._stop.set()
        self._thread.join()
        if self.reason is None:
            self._past_quota()

    def _past_quota(self) -> bool:
        used, files = usage(self.work) if self.scan else (0, 0)
        if used > self.quota.bytes or files > self.quota.files:
            self.tenants = True
            self.reason = (f"the job went past its disk quota of {self.quota.describe()}: its work folder "
                           f"{self.work} held {used} bytes and {files} files")
            return True
        return False

    def check(self) -> str | None:
        """One look; sets `reason` and `tenants` when the job must stop."""
        if not self._past_quota():
            with contextlib.suppress(OSError):
                free = shutil.disk_usage(self.work).free
                if free < self.quota.floor_bytes:
                    self.reason = (f"the provider's disk went below its free-space floor of {self.quota.floor_bytes} "
                                   f"bytes ({free} free) while the job was within its quota")
        return self.reason

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.check() is not None:
                self.kill()
                return
