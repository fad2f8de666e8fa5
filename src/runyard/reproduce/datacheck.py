"""The run's inputs against what it recorded: the spec (its hash and seed) and every data source file.

A run records, per data source, the sha256 the data stage fingerprints it by (manifest `data.inputs`)
and, per file, its own sha256 (manifest `data_files`, written by `record_data_files` at the run's
start). Checking them again names the source and the very files whose content changed.
"""

from __future__ import annotations

import os
from contextlib import chdir
from pathlib import Path

from runyard.data.pipeline import fingerprint_inputs
from runyard.data.sources import list_input_files
from runyard.errors import DataError
from runyard.spec.data import DataSpec
from runyard.spec.job import JobSpec


def _source_key(spec: DataSpec, index: int) -> str:
    return f"sources[{index}] {spec.sources[index].path}"  # the data stage's own key (pipeline.fingerprint_inputs)


def record_data_files(spec: DataSpec) -> dict[str, dict]:
    """Per source: the data stage's fingerprint and each file's sha256 (names relative to the source's files'
    common directory, so they read the same on another machine)."""
    files = list_input_files(spec.sources)
    hashes: dict[str, str] = {}
    per_source = fingerprint_inputs(spec, files, hashes)
    grouped: dict[int, list[str]] = {}
    for f in files:
        grouped.setdefault(f.source, []).append(f.path)
    out = {}
    for index, paths in sorted(grouped.items()):
        local = [p for p in paths if "://" not in p]
        base = os.path.commonpath([os.path.dirname(p) for p in local]) if local else ""
        names = {p: (os.path.relpath(p, base) if base and "://" not in p else p) for p in paths}
        key = _source_key(spec, index)
        out[key] = {"sha256": per_source[key], "files": {names[p]: hashes[p] for p in sorted(paths)}}
    return out


def _describe_file_changes(recorded: dict[str, str], current: dict[str, str]) -> str:
    changed = sorted(n for n in set(recorded) & set(current) if recorded[n] != current[n])
    removed = sorted(set(recorded) - set(current))
    added = sorted(set(current) - set(recorded))
    parts = []
    for label, names in (("content changed", changed), ("missing", removed), ("new", added)):
        if names:
            parts.append(f"{label}: {', '.join(names[:10])}" + (f" and {len(names) - 10} more" if len(names) > 10 else ""))
    return "; ".join(parts) or "its files hash differently as a whole"


def check_inputs(spec: JobSpec, manifest: dict, cwd: Path | None = None) -> list[tuple[str, str]]:
    """What changed since the run: [(what, how)], empty when the spec and every data file are as recorded.
    Relative data paths are resolved from `cwd` (the run's recorded working directory)."""
    changes = []
    recorded_seed = (manifest.get("seeds") or {}).get("spec")
    if recorded_seed is not None and recorded_seed != spec.seed:
        changes.append(("seed", f"the run used seed {recorded_seed}; spec.yaml now says {spec.seed}"))
    if manifest.get("spec_sha256") and manifest["spec_sha256"] != spec.fingerprint():
        changes.append(("spec", f"spec.yaml's sha256 is {spec.fingerprint()[:16]}..., the run recorded "
                                f"{manifest['spec_sha256'][:16]}...: the spec was edited after the run"))
    recorded_files = {k: v for k, v in (manifest.get("data_files") or {}).items() if isinstance(v, dict)}
    recorded_sources = {k: v for k, v in ((manifest.get("data") or {}).get("inputs") or {}).items()
                        if k.startswith("sources[")}
    for key, entry in recorded_files.items():
        recorded_sources.setdefault(key, entry.get("sha256"))
    if not recorded_sources:
        return changes
    try:
        with chdir(cwd if cwd is not None and cwd.is_dir() else Path.cwd()):
            current = record_data_files(spec.data)
    except DataError as exc:
        return changes + [("data", str(exc))]
    for key, digest in sorted(recorded_sources.items()):
        now = current.get(key)
        if now is None:
            changes.append((f"data {key}", "no longer matches any file"))
        elif now["sha256"] != digest:
            how = _describe_file_changes((recorded_files.get(key) or {}).get("files", {}), now["files"]) \
                if key in recorded_files else "its files hash differently (the run recorded no per-file digests)"
            changes.append((f"data {key}", how))
    return changes
