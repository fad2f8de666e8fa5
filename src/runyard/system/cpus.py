"""How many CPU threads each of a run's processes computes with: one number for torch and LightGBM alike.

Left to themselves both take every core they see, which is wrong wherever the process may use fewer (a
container's CPU quota, which OpenMP does not see) or shares them with the run's other workers: the threads
then fight for the cores. So the number is, first that applies:

1. `resources.threads`, when the spec sets it;
2. `OMP_NUM_THREADS`, when the environment sets it (OpenMP's own setting, which torch and LightGBM read
   too: a scheduler or a person who pinned it is obeyed);
3. the cores this process may use (its CPU affinity, capped by a cgroup CPU quota where there is one)
   divided by the worker processes on this node (torchrun's LOCAL_WORLD_SIZE), at least one.

A machine shared with other work this process cannot see (no affinity or quota says so) is the spec's to
state (`resources.threads`) or the environment's (`OMP_NUM_THREADS`). The run records the number and where
it came from in its manifest (`threads`).
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

from runyard.system.cgroup import CGROUP_ROOT, PROC_CGROUP, own_cgroup, read_setting


@dataclass(frozen=True)
class ThreadChoice:
    """Threads per process, and how that number was chosen (in words)."""

    threads: int
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_model() -> str:
    """The processor's name (/proc/cpuinfo's `model name`; the platform's word for it elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def affinity_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPUs' worth of time this process's cgroups allow (quota / period, the tightest of its cgroup and
    the ones above it, v2 `cpu.max` or v1 `cpu.cfs_quota_us`); None where nothing limits it."""
    limits = []
    v2 = own_cgroup(None, root, proc_cgroup)
    for path in _up_to(v2, root):
        fields = read_setting(path / "cpu.max").split()
        if len(fields) == 2 and fields[0] != "max":
            limits.append(int(fields[0]) / int(fields[1]))
    v1 = own_cgroup("cpu", root, proc_cgroup)
    for path in _up_to(v1, root / "cpu"):
        quota, period = read_setting(path / "cpu.cfs_quota_us").strip(), read_setting(path / "cpu.cfs_period_us").strip()
        if quota.lstrip("-").isdigit() and int(quota) > 0 and period.isdigit() and int(period) > 0:
            limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def usable_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The cores this process may use: its affinity, capped by its cgroup CPU quota (rounded up)."""
    cores = affinity_cores()
    quota = cpu_quota(root, proc_cgroup)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def local_processes() -> int:
    """The worker processes on this node: torchrun's LOCAL_WORLD_SIZE, or 1 outside torchrun."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def choose_threads(requested: int | None, processes: int) -> ThreadChoice:
    """Threads per process for `processes` local workers, given the spec's `resources.threads`
    (`requested`, None when unset); the order is the module doc's."""
    if requested:
        return ThreadChoice(requested, "resources.threads")
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return ThreadChoice(int(env), "OMP_NUM_THREADS")
    cores = usable_cores()
    processes = max(1, processes)
    threads = max(1, cores // processes)
    return ThreadChoice(threads, f"the {cores} usable core{'s' if cores != 1 else ''} (affinity, cgroup CPU quota) "
                                 f"/ {processes} local process{'es' if processes != 1 else ''}")


def _up_to(path: Path | None, top: Path) -> list[Path]:
    """`path` and its parents up to and including `top` (none when `path` is None or not below `top`)."""
    if path is None or not path.is_relative_to(top):
        return []
    chain = [path]
    while chain[-1] != top:
        chain.append(chain[-1].parent)
    return chain
