"""How long a finished lease's folder stays on the provider's machine.

A lease's folder holds the tenant's spec, fetched data, run directory and checkpoints: gigabytes that
are the provider's disk, not the tenant's. Once the lease has ended and its results were delivered
(or their delivery failed, which the lease's record says), the folder is kept for a stated time,
for the tenant to ask about and for a dispute to look at, then removed. The small JSON record of
the lease stays: it is the agent's memory that the lease was handled, and says when the folder went.
A work folder that is a filesystem of its own (a disk quota, runyard.control.disk_quota) is unmounted
and its image removed with it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

from runyard.control.disk_quota import release
from runyard.system.files import atomic_write_text

DEFAULT_KEEP_FINISHED_S = 7 * 86400.0


def remove_expired_folders(agent_dir: Path, keep_s: float, now: float) -> list[int]:
    """Remove the folders of leases finished more than `keep_s` ago; returns their lease ids.

    Only folders inside `agent_dir` are touched, whatever a record says."""
    removed = []
    root = agent_dir.resolve()
    for path in sorted(agent_dir.glob("lease-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a record being written, or not ours: never a reason to delete anything
        finished_at = record.get("finished_at")
        if not record.get("finished") or record.get("folder_removed_at") or not isinstance(finished_at, (int, float)):
            continue
        if now - finished_at < keep_s:
            continue
        folder = Path(str(record.get("folder", ""))).resolve()
        if folder.parent == root and folder.name.startswith("lease-"):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                release(folder)  # its work folder's own filesystem (a disk quota): unmounted, image removed
            shutil.rmtree(folder, ignore_errors=True)
        record["folder_removed_at"] = now
        atomic_write_text(path, json.dumps(record))
        removed.append(int(record["lease_id"]))
    return removed
