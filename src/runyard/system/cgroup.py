"""Where this process's cgroups are: the one directory of cgroup v2, or a v1 controller's. Read by the
thread choice (runyard/system/cpus.py: a CPU quota) and by a job's limits (control/limits.py: its own cgroups)."""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def own_cgroup(controller: str | None, root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> Path | None:
    """This process's cgroup directory for a v1 controller, or the v2 one (controller None); None where
    there is none (no cgroups, or not that controller)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller is None and controllers == "":
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            return base / path.lstrip("/")
        if controller is not None and controller in controllers.split(","):
            return root / controller / path.lstrip("/")
    return None


def read_setting(path: Path) -> str:
    """A cgroup file's text; "" where it does not exist or cannot be read (a controller not enabled)."""
    try:
        return path.read_text()
    except OSError:
        return ""
