"""A lease's disk quota, with the real launcher and bubblewrap: a job writing past it stops as the
tenant's failure with the reason, whether a filesystem of its own holds it (root) or the watchdog
does, and the provider's disk takes no more than the quota (plus the watchdog's bounded overshoot);
the per-file bound is on by default; the sandbox's tmpfs have a size; the control plane's files are
private; a cgroup a job left a live process in is removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runyard.control import disk_quota
from runyard.control import limits as job_limits
from runyard.control.agent import LeaseJobSettings
from runyard.control.daemon import make_private
from runyard.control.lease_job import LeaseFolder
from runyard.control.retry import RetryPolicy, decide
from runyard.control.sandbox import SandboxPolicy, bwrap_argv, wrap_argv
from runyard.control.states import EXIT_DISK_QUOTA, FailureReason, classify_exit
from runyard.control.store import JobStore

MIB = 1 << 20
# Writes 1 MiB files into its TMPDIR (inside the work folder) until told no, at most 200 MiB: a
# watchdog that failed would let it finish (exit 0), never fill the provider's disk.
# 200 MiB at 1 MiB per 10 ms: at least 2 s, twenty watchdog intervals of 0.1 s, however loaded the machine
# (without the pause a fast disk takes it all between two looks of a starved watchdog thread).
FILL = """
import os, sys, time
tmp = os.environ['TMPDIR']
for i in range(200):
    with open(os.path.join(tmp, f'f{i}'), 'wb') as f:
        f.write(b'x' * (1 << 20))
    time.sleep(0.01)
print('wrote it all')
"""


@pytest.fixture
def lease(tmp_path):
    folder = LeaseFolder(tmp_path / "agent" / "lease-3").create()
    yield folder
    disk_quota.release(folder.root)


def _policy(folder: LeaseFolder, **fields) -> SandboxPolicy:
    policy = SandboxPolicy(lease_id=3, root=str(folder.root), **fields)
    policy.save(folder.policy)
    return policy


def _run(folder: LeaseFolder, script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUNYARD_DEVICES": "cpu:0", "RUNYARD_JOB_ID": "1"}
    return subprocess.run(wrap_argv([sys.executable, "-c", script, *args], folder.policy), env=env,
                          capture_output=True, text=True, timeout=120)


def _the_tenants_disk_quota(out: subprocess.CompletedProcess, folder: LeaseFolder) -> str:
    assert out.returncode == EXIT_DISK_QUOTA, out.stderr
    assert "wrote it all" not in out.stdout
    reason = json.loads(folder.failure.read_text())["reason"]
    assert "disk quota" in reason and reason in out.stderr
    assert classify_exit(out.returncode, None) == (None, FailureReason.DISK_QUOTA)
    return reason


@pytest.mark.skipif(disk_quota.kernel_means() is not None, reason="no loop-mounted filesystem here (not root)")
def test_a_job_past_its_quota_on_its_own_filesystem_is_the_tenants_failure(sandboxed, lease):
    _policy(lease, disk_bytes=16 * MIB, disk_files=500)
    out = _run(lease, FILL)
    if "by a watchdog" in out.stderr:
        pytest.skip(f"the kernel would not mount a filesystem here: {out.stderr[-300:]}")
    assert "disk quota 16777216 bytes and 500 files (ext4 image" in out.stderr
    assert "filled its disk quota of 16777216 bytes" in _the_tenants_disk_quota(out, lease)
    # The provider's disk holds the image's blocks, never more than the quota.
    assert disk_quota.image_path(lease.root).stat().st_blocks * 512 <= 16 * MIB
    # What it wrote stays readable after the job (for delivery) until the lease's folder goes.
    assert (lease.work / "tmp" / "f0").stat().st_size == MIB
    # Files count too: 500 inodes.
    for path in (lease.work / "tmp").iterdir():
        path.unlink()
    many = _run(lease, "import os\nfor i in range(2000): open(os.path.join(os.environ['TMPDIR'], f'n{i}'), 'w')")
    assert "more files than its disk quota of 500 files" in _the_tenants_disk_quota(many, lease)
    disk_quota.release(lease.root)
    assert not os.path.ismount(lease.work) and not disk_quota.image_path(lease.root).exists()


def test_a_job_past_its_quota_under_the_watchdog_is_the_tenants_failure(sandboxed, lease):
    _policy(lease, disk_bytes=8 * MIB, disk_kernel=False, disk_interval_s=0.1)
    out = _run(lease, FILL)
    assert "by a watchdog every 0.1s" in out.stderr
    reason = _the_tenants_disk_quota(out, lease)
    assert "went past its disk quota of 8388608 bytes" in reason
    used, _ = disk_quota.usage(lease.work)
    print(f"watchdog overshoot: {used - 8 * MIB} bytes past an 8 MiB quota")
    assert used < 200 * MIB  # stopped well before the job's own end: one interval's writes past the quota


def test_the_watchdog_counts_files_and_keeps_the_floor(tmp_path):
    work = tmp_path / "work"
    (work / "a").mkdir(parents=True)
    for i in range(5):
        (work / "a" / f"{i}").write_bytes(b"x" * 4096)
    assert disk_quota.usage(work) == (5 * 4096, 6) or disk_quota.usage(work)[1] == 6
    killed = []
    few = disk_quota.Watchdog(work, disk_quota.DiskQuota(1 << 30, 4, 0), lambda: killed.append(1))
    assert "6 files" in (few.check() or "") and few.tenants
    # Within its quota, but the provider's disk below the floor: stopped, and not the tenant's doing.
    floor = disk_quota.Watchdog(work, disk_quota.DiskQuota(1 << 30, 100, 1 << 62), lambda: None)
    assert "below its free-space floor" in (floor.check() or "") and not floor.tenants
    with pytest.raises(disk_quota.DiskShort, match="free-space floor"):
        disk_quota.check_floor(work, 0, 1 << 62)


def test_a_job_that_ended_past_its_quota_between_two_looks_is_still_past_it(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    killed = []
    watchdog = disk_quota.Watchdog(work, disk_quota.DiskQuota(64 * 1024, 100, 0), lambda: killed.append(1),
                                   interval_s=3600).start()  # no look while the "job" runs
    (work / "big").write_bytes(b"x" * (256 * 1024))
    watchdog.stop()
    assert watchdog.tenants and "went past its disk quota of 65536 bytes" in watchdog.reason
    assert killed == []  # nothing left to kill: the reason alone makes it the tenant's failure
    within = disk_quota.Watchdog(work, disk_quota.DiskQuota(1 << 30, 100, 1 << 62), lambda: None, 3600).start()
    within.stop()
    assert within.reason is None  # the floor is not judged after the job: it takes no more disk


def test_a_disk_quota_failure_is_the_tenants_and_not_retried():
    assert classify_exit(EXIT_DISK_QUOTA, None) == (None, FailureReason.DISK_QUOTA)
    decision = decide(RetryPolicy(), FailureReason.DISK_QUOTA, EXIT_DISK_QUOTA, [[0.0, "disk_quota"]], 1.0)
    assert not decision.retry and "disk quota" in decision.final_reason


def test_the_per_file_bound_and_the_quota_are_on_by_default():
    limits = LeaseJobSettings(memory_per_device=1 << 30).sandbox_limits(2)
    assert limits["disk_bytes"] == 2 * LeaseJobSettings().disk_per_device
    assert limits["max_file_bytes"] == limits["disk_bytes"]  # no file larger than the lease may hold
    assert LeaseJobSettings(max_file_bytes=MIB).sandbox_limits(1)["max_file_bytes"] == MIB
    assert limits["disk_floor_bytes"] > 0


def test_the_default_per_file_bound_holds_in_the_sandbox(sandboxed, lease):
    limits = LeaseJobSettings(disk_per_device=4 * MIB, disk_floor_bytes=0, memory_per_device=256 * MIB,
                              disk_kernel=False).sandbox_limits(1)
    _policy(lease, **limits, disk_interval_s=30)
    out = _run(lease, "import errno\ntry:\n    open('run/big', 'wb').write(b'x' * (5 << 20))\n"
                      "except OSError as e:\n    print(errno.errorcode[e.errno])")
    assert out.stdout.strip() == "EFBIG", out.stderr  # the kernel stopped the write at the quota's bytes
    assert f"RLIMIT_FSIZE {4 * MIB}" in out.stderr
    # The 4 MiB file and the work folder's own folders are past the 4 MiB quota: the watchdog's last look
    # (no look in the 30 s interval) makes that the tenant's failure.
    assert out.returncode == EXIT_DISK_QUOTA and "went past its disk quota" in out.stderr, out.stderr


def test_the_sandboxs_tmp_and_shm_have_a_size(sandboxed, lease):
    policy = _policy(lease, memory_bytes=64 * MIB)
    argv = bwrap_argv(policy, [], ["true"])
    assert argv.count("--size") == 2 and str(64 * MIB) in argv
    out = _run(lease, "import os\nfor p in ('/tmp', '/dev/shm'):\n    s = os.statvfs(p); print(s.f_blocks * s.f_frsize)\n"
                      "try:\n    open('/dev/x', 'w')\nexcept OSError as e:\n    print(e.errno)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(64 * MIB), str(64 * MIB), "30"]  # EROFS: /dev's own tmpfs is read-only


def test_the_control_planes_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        state = tmp_path / "state"
        state.mkdir(mode=0o777)
        (state / "daemon.log").write_text("started\n")
        store = JobStore(state / "control.db")
        store.close()
        make_private(state)
    finally:
        os.umask(old)
    assert state.stat().st_mode & 0o777 == 0o700
    for name in ("daemon.log", "control.db"):
        assert (state / name).stat().st_mode & 0o777 == 0o600, name


def test_a_cgroup_left_with_a_live_process_is_removed(tmp_path):
    name = f"runyard-test-left-{os.getpid()}"
    # A child of ours joins the cgroup (so this test process never sits in it), starts a sleeper in a
    # session of its own and leaves: what a job that exits with live children leaves behind.
    # (Its sleeper has no parent-death signal on purpose: it must outlive the child that starts it.)
    script = (
        "import subprocess, sys, time\n"
        "from runyard.control import limits\n"
        f"made = limits._join_cgroup({name!r}, limits.Limits(memory_bytes={256 * MIB}))\n"
        "if not made: print('none'); sys.exit(0)\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "limits.step_out(made)\n"
        "print(p.pid, *made)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "none":
        pytest.skip("no cgroup can be made here")
    pid, *paths = out.stdout.split()
    cgroups = [Path(p) for p in paths]
    assert all(pid in (c / "cgroup.procs").read_text().split() for c in cgroups)
    started = time.monotonic()
    job_limits.leave_cgroups(cgroups)
    assert not any(c.exists() for c in cgroups), "the cgroup stayed"
    assert time.monotonic() - started < 5
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().split(")")[1].split()[0] == "Z"  # gone, or a zombie of init
