"""Resource limits of a lease's job: CPU cores, memory, processes, file size, core dumps.

Applied by the sandbox launcher to itself just before it starts the job (children inherit them):

- CPU: the job's CPU slots (`cpu:N` devices) become its CPU affinity (core N modulo the cores
  there are); a GPU job keeps the launcher's cores.
- memory and processes: a cgroup of their own (cgroup v2 where this process may create a child
  cgroup with the memory controller, else the v1 memory and pids hierarchies) with `memory.max`
  / `memory.limit_in_bytes` and `pids.max`. Where no cgroup can be made (an unprivileged provider
  without a delegated cgroup; under Slurm, whose own cgroup already confines the job),
  RLIMIT_DATA bounds each process's data instead: a weaker, per-process bound.
  The launcher steps out of the cgroup once the job has started (`step_out`), and a job the
  OOM killer ended is the tenant's (`out_of_memory`), its heap and its tmpfs files alike.
- RLIMIT_FSIZE (largest file), RLIMIT_CORE = 0 (no core dumps of a stranger's memory),
  RLIMIT_NOFILE.

`Limits.applied` says which of these took effect, for the job's log and the operator.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from runyard.system.cgroup import own_cgroup, read_setting


@dataclass
class Limits:
    memory_bytes: int | None = None
    max_pids: int = 4096
    max_file_bytes: int | None = None
    max_open_files: int = 65536
    applied: list[str] = field(default_factory=list)
    cgroups: list[Path] = field(default_factory=list)


def cpu_affinity(devices: list[str]) -> set[int] | None:
    """The cores a job with these devices may use: its `cpu:N` slots, or None (no CPU slots)."""
    slots = [int(d.split(":", 1)[1]) for d in devices if d.startswith("cpu:") and d.split(":", 1)[1].isdigit()]
    if not slots:
        return None
    available = sorted(os.sched_getaffinity(0))
    return {available[s % len(available)] for s in slots}


def apply(limits: Limits, devices: list[str], name: str) -> Limits:
    """Apply the limits to this process (its children inherit them); records what took effect."""
    cores = cpu_affinity(devices)
    if cores:
        os.sched_setaffinity(0, cores)
        limits.applied.append(f"cpu cores {','.join(map(str, sorted(cores)))}")
    if limits.memory_bytes or limits.max_pids:
        limits.cgroups = _join_cgroup(name, limits)
    if limits.cgroups:
        limits.applied.append(f"cgroup {', '.join(str(c) for c in limits.cgroups)}: memory "
                              f"{limits.memory_bytes or 'unbounded'}, pids {limits.max_pids}")
    elif limits.memory_bytes:
        _lower(resource.RLIMIT_DATA, limits.memory_bytes)
        limits.applied.append(f"RLIMIT_DATA {limits.memory_bytes} (no cgroup available: per process)")
    if limits.max_file_bytes:
        _lower(resource.RLIMIT_FSIZE, limits.max_file_bytes)
        limits.applied.append(f"RLIMIT_FSIZE {limits.max_file_bytes}")
    _lower(resource.RLIMIT_CORE, 0)
    _lower(resource.RLIMIT_NOFILE, limits.max_open_files)
    return limits


def _lower(which: int, value: int) -> None:
    soft, hard = resource.getrlimit(which)
    new_hard = value if hard == resource.RLIM_INFINITY else min(hard, value)
    resource.setrlimit(which, (min(value, new_hard), new_hard))


def _join_cgroup(name: str, limits: Limits) -> list[Path]:
    """Create cgroups for the job, set its limits, move this process in; [] where that is not possible."""
    v2 = own_cgroup(None)
    if v2 is not None and "memory" in read_setting(v2 / "cgroup.subtree_control").split():
        made = _make(v2 / name, {"memory.max": limits.memory_bytes, "pids.max": limits.max_pids})
        if made:
            return made
    made = []
    for controller, settings in (("memory", {"memory.limit_in_bytes": limits.memory_bytes}),
                                 ("pids", {"pids.max": limits.max_pids})):
        own = own_cgroup(controller)
        if own is not None:
            made += _make(own / name, settings)
    if limits.memory_bytes and not any("memory" in str(p) for p in made):
        leave_cgroups(made)
        return []
    return made


def _make(path: Path, settings: dict[str, int | None]) -> list[Path]:
    try:
        path.mkdir(exist_ok=True)
        for key, value in settings.items():
            if value is not None and (path / key).exists():
                (path / key).write_text(str(value))
        (path / "cgroup.procs").write_text(str(os.getpid()))
        return [path]
    except OSError:
        with contextlib.suppress(OSError):
            path.rmdir()
        return []


def oom_kills(cgroups: list[Path]) -> int:
    """How many processes the kernel's OOM killer has killed in these cgroups so far (cgroup v2
    `memory.events`, v1 `memory.oom_control`; 0 where neither says)."""
    kills = 0
    for path in cgroups:
        for name in ("memory.events", "memory.oom_control"):
            for line in read_setting(path / name).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    kills += int(value)
    return kills


def tmpfs_bytes(cgroups: list[Path]) -> int:
    """Bytes of tmpfs and shared memory (the sandbox's /tmp and /dev/shm) charged to these cgroups:
    `shmem` in memory.stat (v2; v1 `total_shmem` or `shmem`)."""
    found = 0
    for path in cgroups:
        stat = dict(line.partition(" ")[::2] for line in read_setting(path / "memory.stat").splitlines())
        value = stat.get("shmem", stat.get("total_shmem", "0")).strip()
        found += int(value) if value.isdigit() else 0
    return found


def out_of_memory(code: int, kills_before: int, cgroups: list[Path]) -> str | None:
    """Why an attempt that ended with `code` ended for memory, or None: the kernel's OOM killer
    killed a process of the job's cgroups (their `oom_kill` count rose past `kills_before`).
    Whatever filled the memory, the job's heap or files in its tmpfs /tmp and /dev/shm (shmem is
    charged to the cgroup like the heap), it is the job's own doing: the tenant's failure, never
    the provider's (a SIGKILL alone, exit 137, would read as the provider's and be retried)."""
    if code == 0 or oom_kills(cgroups) <= kills_before:
        return None
    shmem = tmpfs_bytes(cgroups)
    held = f", {shmem} bytes of it in tmpfs (/tmp, /dev/shm)" if shmem else ""
    return f"the job went past its memory limit{held} and the kernel killed it (exit {code})"


def step_out(cgroups: list[Path]) -> None:
    """Move this process (the launcher) back to each cgroup's parent, leaving its children in:
    the OOM killer then picks only the job's processes, and the launcher lives to say why the job
    ended (a job holding its memory in tmpfs has a small heap, so the launcher would be the
    largest process in the cgroup)."""
    for path in cgroups:
        with contextlib.suppress(OSError):
            (path.parent / "cgroup.procs").write_text(str(os.getpid()))


def leave_cgroups(cgroups: list[Path]) -> None:
    """Move this process back to each cgroup's parent, end whatever the job left running in it (a
    child that outlived the job's first process) and remove the cgroup."""
    for path in cgroups:
        with contextlib.suppress(OSError):
            (path.parent / "cgroup.procs").write_text(str(os.getpid()))
        remove_cgroup(path)


def remove_cgroup(path: Path, wait_s: float = 5.0) -> bool:
    """Kill every process in the cgroup (v2 `cgroup.kill`, else SIGKILL to each of `cgroup.procs`),
    wait for them to go, and remove it; False when it is still there after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while path.is_dir():
        pids = [int(p) for p in read_setting(path / "cgroup.procs").split() if p.isdigit()]
        if pids and (path / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (path / "cgroup.kill").write_text("1")
        for pid in pids:
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            path.rmdir()
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)  # killed processes leave the cgroup once the kernel has reaped them
    return True


def remove_stale(name: str) -> int:
    """Remove the cgroups called `name` beside this process's own, and any process still in them:
    what a launcher killed before it could leave them behind. Returns how many were removed."""
    removed = 0
    for own in (own_cgroup(None), own_cgroup("memory"), own_cgroup("pids")):
        if own is not None and (own / name).is_dir() and remove_cgroup(own / name):
            removed += 1
    return removed


def cgroup_name(lease_folder: str | Path, lease_id: int, job_id: int | str) -> str:
    """The cgroup a lease's job runs in (one name for all its attempts). The lease folder's hash is in
    it: two agents (or two markets) on one host may both have a lease 7 with a job 1, and a shared
    cgroup would charge one job's memory to the other and OOM-kill it."""
    folder = hashlib.sha256(str(Path(lease_folder).resolve()).encode()).hexdigest()[:10]
    return f"runyard-lease-{lease_id}-{job_id}-{folder}"
