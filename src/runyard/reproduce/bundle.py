"""`runyard env bundle RUN_DIR`: a wheelhouse beside the lock, so the environment rebuilds with no index.

`RUN_DIR/env/wheelhouse/` gets every wheel of the lock (each proven: by its hash, or, where the lock has
none, by the content digest of the installed files), runyard's own wheel built from the recorded commit
or the installed tree, and `requirements.txt`, the lock with every hash filled in. When the lock's
environment is already built in the cache, its archives (proven when it was built) are copied from there:

    pip install --no-index --find-links env/wheelhouse --no-deps --require-hashes -r env/wheelhouse/requirements.txt

The wheelhouse is assembled in a temporary folder and renamed into place, so a half-made one never
reads as complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from runyard.reproduce.build import completed_requirements, fetch_archives, ready_environment, runyard_wheel
from runyard.reproduce.errors import LockUnsatisfiable
from runyard.reproduce.lock import KIND_LOCAL, KIND_UNRECORDED, LOCK_DIR, read_lock
from runyard.system.files import atomic_write_text, fsync_dir, sha256_file

WHEELHOUSE = "wheelhouse"
BUNDLE_FILE = "bundle.json"


@dataclass
class Bundle:
    path: Path
    wheels: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    completed: int = 0
    runyard_origin: str | None = None
    runyard_source_changes: list[str] = field(default_factory=list)

    @property
    def size_bytes(self) -> int:
        return sum((self.path / name).stat().st_size for name in self.wheels)


def wheelhouse_of(run_dir: Path) -> Path | None:
    """The run's complete wheelhouse, if it has one."""
    path = run_dir / LOCK_DIR / WHEELHOUSE
    return path if (path / BUNDLE_FILE).is_file() else None


def bundle_run(run_dir: Path, find_links: list[Path] | None = None,
               say: Callable[[str], None] = lambda _msg: None) -> Bundle:
    """Write `run_dir/env/wheelhouse` (see the module docstring); replaces an earlier one."""
    lock = read_lock(run_dir / LOCK_DIR)
    stuck = [(d.pin, f"{d.kind}: there is no archive of it to put in a wheelhouse")
             for d in lock.distributions if d.kind in (KIND_LOCAL, KIND_UNRECORDED)]
    if stuck:
        raise LockUnsatisfiable(stuck)
    final = run_dir / LOCK_DIR / WHEELHOUSE
    tmp = run_dir / LOCK_DIR / f".{WHEELHOUSE}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    direct = {str(Path(d.direct_url["url"].removeprefix("file://")).parent)
              for d in lock.distributions if (d.direct_url or {}).get("archive_info") and
              str(d.direct_url.get("url", "")).startswith("file://")}
    source_args = [a for d in [*(find_links or []), *sorted(direct)] for a in ("--find-links", str(d))]
    try:
        built = ready_environment(lock)
        if built is not None:  # its archives were proven when it was built: copy them
            say(f"copying the proven archives of the cached environment {built.root}")
            for wheel in sorted(built.archives.glob("*.whl")):
                shutil.copy2(wheel, tmp / wheel.name)
            shutil.copy2(built.root / "requirements.txt", tmp / "requirements.txt")
            completed, origin, changes = built.completed_hashes, built.runyard_origin, built.runyard_source_changes
        else:
            say(f"fetching {len(lock.distributions)} archives into the wheelhouse ({len(lock.unhashed())} to prove)")
            completed = fetch_archives(lock, tmp, source_args)
            say("building runyard's wheel")
            wheel, origin, changes = runyard_wheel(lock, tmp)
            atomic_write_text(tmp / "requirements.txt", completed_requirements(lock, completed, wheel))
        wheels = {p.name: sha256_file(p) for p in sorted(tmp.glob("*.whl"))}
        record = {"lock_sha256": lock.sha256, "wheels": wheels, "runyard_origin": origin,
                  "runyard_source_changes": changes, "completed_hashes": completed}
        atomic_write_text(tmp / BUNDLE_FILE, json.dumps(record, indent=1, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Bundle(final, wheels, len(completed), origin, changes)
