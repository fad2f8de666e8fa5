"""The reproducibility manifest: everything needed to repeat a run elsewhere.

`manifest.json` records the resolved spec's hash, dataset fingerprints, code version (and git commit
when known), package versions, hardware, seeds, the command line and timestamps. It is rewritten
atomically as the run advances (`update_manifest`).

`record_environment` (called once per session, at its start) writes the lock of the Python environment
beside it, in `env/` (reproduce/lock.py), and records what `runyard reproduce` checks again: the working
directory relative data paths resolve from, and the sha256 of every data source file.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import runyard
from runyard.errors import RunyardError
from runyard.reproduce import lock as env_lock
from runyard.reproduce import source as runyard_source
from runyard.reproduce.datacheck import record_data_files
from runyard.spec.job import JobSpec
from runyard.system.cpus import cpu_model
from runyard.system.files import atomic_write_text

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
PACKAGES = ("torch", "tokenizers", "numpy", "safetensors", "pydantic", "pyarrow")


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version(), "runyard": runyard.__version__}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit() -> str | None:
    """The commit of the runyard checkout, when it is one; '+dirty' when it has uncommitted changes."""
    return runyard_source.git_commit()


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "gpus": [],
    }
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                info["gpus"].append({"name": props.name, "memory_bytes": props.total_memory})
    except ImportError:
        pass
    return info


def new_manifest(spec_hash: str, seed: int, argv: list[str] | None = None) -> dict[str, Any]:
    return {
        "spec_sha256": spec_hash,
        "seeds": {"spec": seed},
        "code": {"runyard": runyard.__version__, "git_commit": git_commit()},
        "packages": package_versions(),
        "hardware": hardware(),
        "command_line": list(argv if argv is not None else sys.argv),
        "started_at": now_iso(),
        "finished_at": None,
        "sessions": [],
    }


def read_manifest(run_dir: Path) -> dict[str, Any]:
    path = run_dir / MANIFEST_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    atomic_write_text(run_dir / MANIFEST_FILE, json.dumps(manifest, indent=2, default=str))


def update_manifest(run_dir: Path, **fields: Any) -> dict[str, Any]:
    manifest = read_manifest(run_dir)
    manifest.update(fields)
    write_manifest(run_dir, manifest)
    return manifest


def record_environment(run_dir: Path, spec: JobSpec) -> None:
    """Write the environment lock into `run_dir/env` and record the data files' digests and the working
    directory. A session whose environment differs from the first one's keeps its own lock under
    `env/sessions/<n>/`. A failure here is logged and recorded, never fatal to the run."""
    manifest = read_manifest(run_dir)
    session = len(manifest.get("sessions", []))
    environment = dict(manifest.get("environment") or {})
    try:
        lock = env_lock.capture_environment()
        env_dir = run_dir / env_lock.LOCK_DIR
        if not (env_dir / env_lock.REQUIREMENTS_FILE).is_file():
            env_lock.write_lock(env_dir, lock)
            environment.update(lock_sha256=lock.sha256, unhashed=[d.name for d in lock.unhashed()])
        elif lock.sha256 != environment.get("lock_sha256"):
            env_lock.write_lock(env_dir / "sessions" / str(session), lock)
            environment.setdefault("changed_in_sessions", {})[str(session)] = lock.sha256
    except (OSError, ValueError, RunyardError) as exc:
        log.warning("could not write the environment lock: %s", exc)
        environment["error"] = f"{type(exc).__name__}: {exc}"
    try:
        data_files = record_data_files(spec.data) if spec.data is not None else {}  # sft/dpo-only: no top-level data
    except (OSError, RunyardError) as exc:
        data_files = {"error": f"{type(exc).__name__}: {exc}"}
    update_manifest(run_dir, environment=environment, data_files=data_files, cwd=os.getcwd())
