"""The reproducibility manifest: everything needed to repeat a run elsewhere.

`manifest.json` records the resolved spec's hash, dataset fingerprints, code version (and git commit
when known), package versions, hardware, seeds, the command line and timestamps. It is rewritten
atomically as the run advances (`update_manifest`).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import runyard
from runyard.fsutil import atomic_write_text

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
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
