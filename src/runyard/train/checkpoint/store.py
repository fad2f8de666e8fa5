"""Checkpoint directories on disk: names, the atomic commit with its checksum manifest, verification,
the newest good checkpoint, and retention. Both formats (plain.py, sharded.py) commit through here.

A checkpoint is a directory `step_00000123/` holding its files and `MANIFEST.json`, the checksum and
size of every other file. It is written into a hidden `.tmp-step_...` directory beside it; each file is
fsynced once by whoever wrote it, the manifest is written last, the directories are fsynced, and the
directory is renamed into place. So a crash leaves either the whole checkpoint or nothing under its
final name. A directory without a manifest, or whose files do not match it, is refused
(`CheckpointCorrupt`) and `latest_good` falls back to the previous one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runyard.errors import CheckpointCorrupt
from runyard.system.files import fsync_dir, fsync_file
from runyard.train.checkpoint.checksums import CHECKSUM, FileEntry, algorithm_of
from runyard.train.checkpoint.parallel_read import file_checksum, reading_pool

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
STATE = "state.json"
CHECKPOINT_LOG = "checkpoints.jsonl"  # beside the checkpoints directory: one line per save
FORMAT_VERSION = 3  # 1: torch.save files; 2: safetensors-layout files; 3: tree checksums (checksums.py)
_PREFIX = "step_"
_TMP = ".tmp-"
_REPLACED = ".replaced-"


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    path: Path


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def staging_dir(root: Path, step: int, token: str | None = None) -> Path:
    """A fresh hidden directory to write the checkpoint of `step` into (`token` names it when every
    rank of a job must agree on it)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_TMP}{step_dir_name(step)}-{token or uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def write_state_json(tmp: Path, step: int, state: dict[str, Any]) -> FileEntry:
    """state.json: the step and the plain values (loader position, the loop's own), fsynced."""
    path = tmp / STATE
    path.write_text(json.dumps({"format": FORMAT_VERSION, "step": step, **state}, indent=1))
    return durable_entry(path)


def durable_entry(path: Path) -> FileEntry:
    """fsync a file written by someone else and describe it for the manifest by reading it back."""
    fsync_file(path)
    return {CHECKSUM: file_checksum(path, CHECKSUM), "bytes": os.path.getsize(path)}


def read_state_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / STATE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointCorrupt(f"checkpoint {path}: unreadable {STATE} ({exc})") from None


def commit(tmp: Path, final: Path, step: int, written: dict[str, FileEntry] | None = None,
           **manifest_fields: Any) -> Path:
    """Make the files under `tmp` the checkpoint `final`. `written` holds the manifest entries of files
    their writers already fsynced and checksummed while writing; any other file is fsynced and read
    back here. Then the manifest, the directories' fsyncs, and the rename."""
    written = written or {}
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        rel = path.relative_to(tmp).as_posix()
        files[rel] = written[rel] if rel in written else durable_entry(path)
    missing = sorted(set(written) - set(files))
    if missing:
        raise CheckpointCorrupt(f"checkpoint {final}: files {missing} were written but are not in {tmp}")
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "files": files, **manifest_fields},
                                   indent=1))
    fsync_file(manifest)
    for sub in sorted({p.parent for p in tmp.rglob("*")}, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(sub)
    install(tmp, final)
    return final


def install(tmp: Path, final: Path) -> None:
    """Rename a complete temporary checkpoint into place. A checkpoint already there (the same step
    saved again) is moved aside first and deleted only once the new one is in, so a crash at any
    point leaves a complete checkpoint for the step: `recover_replaced` puts one back if needed."""
    root = final.parent
    aside = root / f"{_REPLACED}{final.name}"
    if final.exists():
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
        fsync_dir(root)
    os.rename(tmp, final)
    fsync_dir(root)
    if aside.exists():
        shutil.rmtree(aside)


def recover_replaced(root: Path) -> None:
    """Undo a replacement that a crash cut short: the moved-aside checkpoint returns to its name."""
    if not root.is_dir():
        return
    for aside in root.glob(f"{_REPLACED}{_PREFIX}*"):
        final = root / aside.name[len(_REPLACED) :]
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(aside, final)
            log.warning("restored checkpoint %s, set aside by a save that did not finish", final)


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest of a checkpoint (not checked against its files)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointCorrupt(f"checkpoint {path} has no {MANIFEST}: it was never completed")
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest["files"], dict):
            raise TypeError("'files' is not a mapping")
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointCorrupt(f"checkpoint {path}: unreadable {MANIFEST} ({exc})") from None
    return manifest


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check every file against the manifest (size, then checksum); return the manifest.
    Raises CheckpointCorrupt naming the checkpoint and the file. Large files are hashed piece by piece
    on a pool of threads."""
    manifest = read_manifest(path)
    with reading_pool() as pool:
        for rel, meta in manifest["files"].items():
            file = (path / rel).resolve()
            if path.resolve() not in file.parents:
                raise CheckpointCorrupt(f"checkpoint {path}: manifest names {rel!r}, outside the checkpoint")
            if not file.is_file():
                raise CheckpointCorrupt(f"checkpoint {path}: file {rel} is missing")
            if file.stat().st_size != meta["bytes"]:
                raise CheckpointCorrupt(
                    f"checkpoint {path}: {rel} has {file.stat().st_size} bytes, manifest says {meta['bytes']}"
                )
            algorithm = algorithm_of(meta, f"checkpoint {path}: {rel}")
            if file_checksum(file, algorithm, pool) != meta[algorithm]:
                raise CheckpointCorrupt(f"checkpoint {path}: {rel} fails its {algorithm} checksum")
    return manifest


def list_checkpoints(root: Path) -> list[CheckpointRef]:
    """Committed-looking checkpoint directories, oldest first (not yet verified)."""
    if not root.is_dir():
        return []
    refs = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit():
            refs.append(CheckpointRef(int(p.name[len(_PREFIX) :]), p))
    return sorted(refs, key=lambda r: r.step)


def latest_good(root: Path) -> CheckpointRef | None:
    """The newest checkpoint that passes verification; corrupt newer ones are logged and skipped."""
    recover_replaced(root)
    for ref in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(ref.path)
        except CheckpointCorrupt as exc:
            log.warning("skipping checkpoint: %s; falling back to the previous one", exc)
            continue
        return ref
    return None


def apply_retention(root: Path, keep_last: int, best_step: int | None) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints and the best one. Returns what was removed.
    Stale temporary directories from crashed writes are removed too."""
    removed = []
    for tmp in root.glob(f"{_TMP}*"):
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    refs = list_checkpoints(root)
    keep = {r.step for r in refs[-keep_last:]}
    if best_step is not None:
        keep.add(best_step)
    for ref in refs:
        if ref.step not in keep:
            shutil.rmtree(ref.path, ignore_errors=True)
            removed.append(ref.path)
    return removed


def log_checkpoint(root: Path, row: dict) -> None:
    """One line per checkpoint beside metrics.jsonl: its stall on the training loop and write time."""
    with open(root.parent / CHECKPOINT_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
