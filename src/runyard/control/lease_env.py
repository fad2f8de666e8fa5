"""A lease job's environment, built from the lock its demand carries and cached by the lock's hash.

A demand's job may carry its run's environment lock (`runyard.reproduce.lock`: env/requirements.txt
and env/environment.json). The job then runs with exactly those versions, not whatever the provider
has installed: the sandbox launcher builds the environment before the job starts (once per lock:
`runyard.reproduce.build`'s cache layout, so `ready_environment` finds it, and a second lease with the
same lock reinstalls nothing), then runs the job's `python` from it, inside the sandbox.

The lock is a stranger's, and its packages' code must not run outside the sandbox, so the build is
split in two:

1. in the launcher, on the provider's network: the refusals that need no work (`platform_problems`:
   an interpreter of the lock's version, wheels for this platform), every archive of the lock
   fetched and proven (`fetch_archives`: `pip download` of binary wheels in hash-checking mode --
   no package's code runs), runyard's own wheel built from this provider's checkout
   (`runyard_wheel`), and the requirements with every hash filled in;
2. inside a sandbox with no network, where only the environment's own folder is writable
   (`python -m runyard.control.lease_env install ...`): the venv made, the lock installed from those
   archives alone (`pip --no-index --require-hashes`), and the result verified against the lock by
   running it -- the first time any of the tenant's packages' code runs. `ready.json` comes last: a
   folder without it is a build that did not finish, and is built again.

A lock that cannot be satisfied here is refused with its problems named (`LockUnsatisfiable`); the
launcher then fails the attempt with that reason and the agent ends the lease with it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from runyard.reproduce.build import (
    completed_requirements,
    fetch_archives,
    find_interpreter,
    platform_problems,
    ready_environment,
    runyard_wheel,
    verify_environment,
)
from runyard.reproduce.env_cache import READY_FILE, exclusive_build
from runyard.reproduce.errors import EnvironmentBuildFailed, LockUnsatisfiable
from runyard.reproduce.lock import EnvironmentLock, read_lock
from runyard.system.files import atomic_write_text

PIP_TIMEOUT_S = 1800


def check_lock(lock_dir: Path) -> EnvironmentLock:
    """The lock in `lock_dir`, if this machine could install it; LockUnsatisfiable (naming every
    package) or NotReproducible (a malformed lock) otherwise. Reads only: nothing is fetched."""
    lock = read_lock(lock_dir)
    problems = platform_problems(lock)
    if problems:
        raise LockUnsatisfiable(problems)
    return lock


def ensure(lock_dir: Path, cache_root: Path, install: Callable[[list[str], Path], None],
           say: Callable[[str], None] = lambda _m: None) -> Path:
    """The python of the lock's environment: found in `cache_root`, or built now (phase 1 here,
    phase 2 through `install(command, writable_folder)`, which runs the command confined)."""
    lock = check_lock(lock_dir)
    root = cache_root / lock.sha256[:24]
    with exclusive_build(cache_root, lock.sha256):
        ready = ready_environment(lock, cache_root)
        if ready is not None:
            say(f"environment {lock.sha256[:16]} reused from {ready.root}")
            return ready.python
        started = time.monotonic()
        shutil.rmtree(root, ignore_errors=True)  # an unfinished earlier build
        root.mkdir(parents=True)
        try:
            archives = root / "archives"
            earlier = sorted(p for p in cache_root.glob("*/archives") if p.is_dir() and p != archives)
            source_args = [arg for d in earlier for arg in ("--find-links", str(d))]
            say(f"environment {lock.sha256[:16]}: fetching and proving {len(lock.distributions)} archives")
            completed = fetch_archives(lock, archives, source_args)
            wheel, origin, changes = runyard_wheel(lock, archives)
            atomic_write_text(root / "requirements.txt", completed_requirements(lock, completed, wheel))
            interpreter = find_interpreter(lock.python["major_minor"])
            record = {"key": lock.sha256, "runyard_origin": origin, "runyard_source_changes": changes,
                      "completed_hashes": completed}
            atomic_write_text(root / "build.json", json.dumps({**record, "interpreter": str(interpreter)}))
            say("installing and verifying it inside the sandbox (no network)")
            install([sys.executable, "-m", "runyard.control.lease_env", "install", str(root), str(lock_dir)], root)
            if not (root / READY_FILE).is_file():
                raise EnvironmentBuildFailed(f"the confined install of {root} did not finish")
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        say(f"environment built in {time.monotonic() - started:.0f} s")
        return root / "venv" / "bin" / "python"


def _run(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise EnvironmentBuildFailed(f"{what} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr).strip()[-2000:]}")


def install(root: Path, lock_dir: Path) -> None:
    """Phase 2, run confined: the venv from `root/requirements.txt` and `root/archives` alone, verified
    against the lock, then `ready.json`."""
    started = time.monotonic()
    # Neither pip nor the new environment may see the launcher's tree: on PYTHONPATH, its runyard (and
    # its .egg-info) reads to pip as runyard already installed, and the lock's wheel is skipped.
    os.environ.pop("PYTHONPATH", None)
    lock = read_lock(lock_dir)
    build = json.loads((root / "build.json").read_text())
    venv = root / "venv"
    python = venv / "bin" / "python"
    _run([build["interpreter"], "-m", "venv", "--without-pip", str(venv)], "creating the venv")
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-cache-dir", "--python", str(python),
          "install", "--no-index", "--no-deps", "--require-hashes", "--no-compile", "--find-links",
          str(root / "archives"), "-r", str(root / "requirements.txt")], "installing the lock")
    mismatches = verify_environment(python, lock)
    if mismatches:
        raise EnvironmentBuildFailed("the built environment differs from the lock:\n  " + "\n  ".join(mismatches))
    record = {k: build[k] for k in ("key", "runyard_origin", "runyard_source_changes", "completed_hashes")}
    record["seconds"] = round(time.monotonic() - started, 1)
    atomic_write_text(root / READY_FILE, json.dumps(record, indent=1, sort_keys=True))


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "install":
        print("usage: python -m runyard.control.lease_env install ENV_ROOT LOCK_DIR", file=sys.stderr)
        return 2
    try:
        install(Path(argv[1]), Path(argv[2]))
    except EnvironmentBuildFailed as exc:
        print(f"runyard: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
