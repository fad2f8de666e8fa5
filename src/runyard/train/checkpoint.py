"""Checkpoints: atomic, checksummed, kept by a retention policy.

A checkpoint is a directory `step_00000123/` holding tensors (`*.pt`, saved with torch.save and read
back with `weights_only=True`), a `state.json` of plain values (step, loader position, RNG states,
anything JSON), and `MANIFEST.json` with the checksum (xxh3-128) and size of every other file. It is written into
a hidden temporary directory, every file fsynced, then renamed into place, so a crash leaves either
the whole checkpoint or nothing under its final name. `MANIFEST.json` is written last; a directory
without it, or whose files do not match it, is refused (`CheckpointCorrupt`) and `latest_good()`
falls back to the previous one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from runyard.diskspace import nbytes_of, writing
from runyard.errors import CheckpointCorrupt
from runyard.fsutil import fsync_dir, fsync_file

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
STATE = "state.json"
_PREFIX = "step_"
FORMAT_VERSION = 1


# The manifest's checksum guards against torn writes and flipped bits, so it needs to be fast, not
# cryptographic (an unsigned manifest is no defence against someone who can rewrite it anyway):
# xxh3-128 hashes at memory speed, which keeps a save near raw write speed (benchmarks/checkpoint_io.py
# measures the save against a raw write of the same bytes).
# Manifests written with sha256 (format 1) still verify.
CHECKSUM = "xxh3_128"
_HASHERS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def file_checksum(path: Path, algorithm: str = CHECKSUM, chunk: int = 8 << 20) -> str:
    h = _HASHERS[algorithm]()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def durable_entry(path: Path) -> dict[str, Any]:
    """fsync a written file and describe it for the manifest: checksum and size."""
    fsync_file(path)
    return {CHECKSUM: file_checksum(path), "bytes": path.stat().st_size}


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    path: Path


def write_checkpoint(
    root: Path,
    step: int,
    tensors: dict[str, Any],
    state: dict[str, Any],
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint for `step` atomically under `root` and return its final path.

    `tensors` maps file stems to objects torch.save can write and weights_only can read (state dicts).
    `write_extra(tmp_dir)` may add more files (e.g. sharded distributed state) before the manifest.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with writing(f"checkpoint {final.name}", root, needed=nbytes_of(tensors)):
            for stem, obj in tensors.items():
                torch.save(obj, tmp / f"{stem}.pt")
        (tmp / STATE).write_text(json.dumps({"format": FORMAT_VERSION, "step": step, **state}, indent=1))
        if write_extra is not None:
            write_extra(tmp)
        commit(tmp, final, step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def commit(tmp: Path, final: Path, step: int, **manifest_fields: Any) -> Path:
    """Make the files under `tmp` a checkpoint: fsync and checksum each, write the manifest last, fsync
    the directories, and install it as `final`. Used by one-process and sharded saves alike."""
    files = {path.relative_to(tmp).as_posix(): durable_entry(path)
             for path in sorted(p for p in tmp.rglob("*") if p.is_file())}
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"format": FORMAT_VERSION, "step": step, "files": files, **manifest_fields},
                                   indent=1))
    fsync_file(manifest)
    for sub in sorted({p.parent for p in tmp.rglob("*")}, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(sub)
    install(tmp, final)
    return final


_REPLACED = ".replaced-"


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


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check every file against the manifest; return the manifest. Raises CheckpointCorrupt."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointCorrupt(f"checkpoint {path} has no {MANIFEST}: it was never completed")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise CheckpointCorrupt(f"checkpoint {path}: unreadable {MANIFEST} ({exc})") from None
    for rel, meta in files.items():
        file = (path / rel).resolve()
        if path.resolve() not in file.parents:
            raise CheckpointCorrupt(f"checkpoint {path}: manifest names {rel!r}, outside the checkpoint")
        if not file.is_file():
            raise CheckpointCorrupt(f"checkpoint {path}: file {rel} is missing")
        if file.stat().st_size != meta["bytes"]:
            raise CheckpointCorrupt(
                f"checkpoint {path}: {rel} has {file.stat().st_size} bytes, manifest says {meta['bytes']}"
            )
        algorithm = next((a for a in _HASHERS if a in meta), None)
        if algorithm is None:
            raise CheckpointCorrupt(f"checkpoint {path}: manifest entry for {rel} has no known checksum")
        if file_checksum(file, algorithm) != meta[algorithm]:
            raise CheckpointCorrupt(f"checkpoint {path}: {rel} fails its {algorithm} checksum")
    return manifest


def read_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], dict]:
    """Verify, then load: returns (tensors by stem, state)."""
    manifest = verify_checkpoint(path)
    tensors = {}
    for rel in manifest["files"]:
        if rel.endswith(".pt") and "/" not in rel:
            tensors[rel[:-3]] = torch.load(path / rel, map_location=map_location, weights_only=True)
    if "model" not in tensors and (path / "dcp").is_dir():  # sharded (torch.distributed.checkpoint)
        from runyard.train.dist_checkpoint import read_full_state

        tensors.update(read_full_state(path, map_location))
    state = json.loads((path / STATE).read_text())
    return tensors, state


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
    for tmp in root.glob(".tmp-*"):
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
