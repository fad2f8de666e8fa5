"""What a retraining demand carries to a provider: the job a served model's retraining runs on a lease.

A lease job reads only what its demand carries (`runyard.market.jobs`, `runyard.control.lease_job`), so
the retraining spec (serve/retrain.py's `derive_spec`: the spec renamed, the traffic added as a `kind:
traffic` source, `model.init` from the served export, its last stage alone) is made self-contained here:

- the spec's local sources are uploaded as the job's files, under `sources/<i>/` (the path keeps its
  glob, so the same files match); its http(s) sources become the job's data URLs;
- the logged traffic is uploaded as `traffic/requests.jsonl`: the newest sealed records that fit in what
  the files cap leaves (a larger log cannot travel with a demand; the newest traffic is the drift);
- the served export travels as the job's `init_export`: the files its runyard.json records (what a
  start from it verifies) and runyard.json itself, uploaded, or fetched by the provider from
  `export_url`/NAME when they are too large to upload; the provider points `model.init.path` at its copy;
- the original run's environment lock (RUN/env, runyard.reproduce.lock) when the export's run has one,
  so the retraining runs with the versions the served model was trained with.

`check_runnable` asks of a job what the market and the provider would: the market's checks of a job
(`JobIn`), `load_spec`, and `runnable_spec` over a scratch lease folder laid out as the provider would.
A server with a retraining policy runs it at start, so a spec the provider would reject is refused
then (exit 2, the field named), not at the first drift event.
"""

from __future__ import annotations

import copy
import glob
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runyard.control.lease_job import (
    LeaseFolder,
    LeaseJobRefused,
    runnable_spec,
    write_files,
    write_init_export,
)
from runyard.errors import SpecError
from runyard.market.jobs import (
    MAX_JOB_FILES_BYTES,
    check_env_lock,
    check_init_export,
    decode_files,
    encode_files,
    init_export_body,
)
from runyard.market.models import JobIn
from runyard.reproduce.lock import FACTS_FILE, LOCK_DIR, REQUIREMENTS_FILE
from runyard.serve.errors import ServeConfigError
from runyard.serve.request_log import SEGMENT_GLOB
from runyard.serve.retrain import derive_spec
from runyard.spec.job import load_spec

TRAFFIC_FILE = "traffic/requests.jsonl"
SOURCES_DIR = "sources"
PROVENANCE = "runyard.json"


@dataclass(frozen=True)
class RetrainJob:
    """One retraining's job as a demand carries it, and what went into it."""

    name: str
    job: dict[str, Any]
    records_carried: int
    traffic_bytes: int


def export_files_to_carry(export_dir: Path) -> list[str]:
    """The export's files a start from it needs: those its runyard.json records, and runyard.json
    (every file of the folder when it has none, e.g. a Hugging Face directory)."""
    export_dir = Path(export_dir)
    try:
        listed = json.loads((export_dir / PROVENANCE).read_text(encoding="utf-8"))["files"]
        return sorted({*listed, PROVENANCE})
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(p.relative_to(export_dir).as_posix() for p in export_dir.rglob("*") if p.is_file())


def init_export_for(export_dir: Path, export_url: str | None = None) -> dict[str, Any]:
    """The job's `init_export`: the export's needed files uploaded, or, with `export_url`, all of them
    fetched by the provider from `export_url`/NAME. ServeConfigError when they cannot travel."""
    names = export_files_to_carry(export_dir)
    if not names:
        raise ServeConfigError(f"{export_dir} holds no files to start a retraining from")
    try:
        if export_url is not None:
            base = export_url.rstrip("/")
            return init_export_body(None, {name: f"{base}/{name}" for name in names})
        return check_init_export({"export_files": encode_files({name: (Path(export_dir) / name).read_bytes()
                                                                 for name in names})})
    except ValueError as exc:
        raise ServeConfigError(f"--retrain-via market carries the served export {export_dir} with the demand, "
                               f"which it cannot: {exc}. Serve the export's files over http(s) and give "
                               "--retrain-export-url BASE (the provider fetches BASE/NAME)") from None


def env_lock_of(export_dir: Path) -> dict[str, str] | None:
    """The environment lock of the run that made the export (RUN/env beside RUN/export), or None."""
    folder = Path(export_dir).resolve().parent / LOCK_DIR
    if not (folder / REQUIREMENTS_FILE).is_file() or not (folder / FACTS_FILE).is_file():
        return None
    lock = {"requirements": (folder / REQUIREMENTS_FILE).read_text(encoding="utf-8"),
            "environment": (folder / FACTS_FILE).read_text(encoding="utf-8")}
    try:
        return check_env_lock(lock)
    except ValueError as exc:
        raise ServeConfigError(f"{folder}: the run's environment lock cannot travel with a demand: {exc}") from None


def carried_sources(spec: dict[str, Any]) -> tuple[dict[str, bytes], list[str]]:
    """Rewrite `spec`'s data sources (all but the last, the traffic) to what the job carries, in place;
    returns the files to upload and the data URLs. Local paths must already be absolute (derive_spec)."""
    files: dict[str, bytes] = {}
    urls: list[str] = []
    for i, source in enumerate(spec["data"]["sources"][:-1]):
        path = str(source.get("path", ""))
        if path.startswith(("http://", "https://")):
            urls.append(path)
        elif path.startswith("/") and "{" not in path:
            source["path"], found = _upload_glob(path, f"{SOURCES_DIR}/{i}")
            if not found:
                raise ServeConfigError(f"data.sources[{i}].path {path!r} matches no file to carry with the demand")
            files.update(found)
        # anything else (a {stdlib} path, a file:// URL) is left for check_runnable to refuse by name
    return files, urls


def _upload_glob(pattern: str, under: str) -> tuple[str, dict[str, bytes]]:
    """The files `pattern` matches, named under `under` by their path below the pattern's fixed
    folder, and the pattern that matches them there."""
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts) - 1)
    base = Path(*parts[:fixed])
    found = {f"{under}/{Path(p).relative_to(base).as_posix()}": Path(p).read_bytes()
             for p in sorted(glob.glob(pattern, recursive=True)) if Path(p).is_file()}
    return f"{under}/{Path(*parts[fixed:]).as_posix()}", found


def newest_records(directory: Path, room: int) -> tuple[bytes, int]:
    """The newest whole lines of the sealed segments in `directory` that fit in `room` bytes, oldest
    first, and how many they are."""
    taken: list[bytes] = []
    size = 0
    for path in sorted(Path(directory).glob(SEGMENT_GLOB), reverse=True):
        for line in reversed(path.read_bytes().splitlines(keepends=True)):
            if not line.strip():
                continue
            line = line if line.endswith(b"\n") else line + b"\n"
            if size + len(line) > room:
                return b"".join(reversed(taken)), len(taken)
            taken.append(line)
            size += len(line)
    return b"".join(reversed(taken)), len(taken)


def build_job(base: dict[str, Any], name: str, traffic_source: dict[str, Any], traffic_dir: Path | None,
              export_dir: Path, init_export: dict[str, Any], results_to: str, env_lock: dict[str, str] | None,
              base_dir: Path) -> RetrainJob:
    """The retraining's job: the derived spec made self-contained (see the module docstring), the
    traffic of `traffic_dir` (None: one placeholder record, for the check at start)."""
    source = {**copy.deepcopy(traffic_source), "path": str(Path(TRAFFIC_FILE).parent / SEGMENT_GLOB)}
    spec = derive_spec(base, name, source, export_dir, base_dir)
    files, urls = carried_sources(spec)
    room = MAX_JOB_FILES_BYTES - sum(len(data) for data in files.values())
    if room <= 0:
        raise ServeConfigError(f"the retraining spec's local sources hold more than {MAX_JOB_FILES_BYTES} bytes, all a "
                               "demand carries; give them as http(s) URLs so the traffic fits beside them")
    if traffic_dir is None:
        traffic, carried = json.dumps({"text": "a placeholder for the logged traffic"}).encode() + b"\n", 1
    else:
        traffic, carried = newest_records(traffic_dir, room)
    files[TRAFFIC_FILE] = traffic
    job: dict[str, Any] = {"spec": yaml.safe_dump(spec, sort_keys=False), "results_to": results_to,
                           "files": encode_files(files), "init_export": init_export}
    if urls:
        job["data_urls"] = urls
    if env_lock is not None:
        job["env_lock"] = env_lock
    return RetrainJob(name, job, carried, len(traffic))


def check_runnable(job: dict[str, Any]) -> None:
    """ServeConfigError naming the field when the market or a provider would refuse `job`: the market's
    checks, the spec's validity, and the provider's rules for a lease job's spec (runnable_spec)."""
    try:
        JobIn.model_validate(job)
    except ValueError as exc:
        raise ServeConfigError(f"the retraining demand's job would be refused by the market: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="runyard-retrain-check-") as scratch:
        folder = LeaseFolder(Path(scratch) / "lease").create()
        write_files(folder, decode_files(job.get("files") or {}))
        write_init_export(folder, job.get("init_export"))
        folder.spec.write_text(job["spec"], encoding="utf-8")
        try:
            load_spec(folder.spec)
            runnable_spec(yaml.safe_load(job["spec"]), folder, list(job.get("data_urls") or []),
                          init_export=folder.init_export.is_dir())
        except SpecError as exc:
            raise ServeConfigError(f"the retraining spec is invalid: {exc}") from None
        except LeaseJobRefused as exc:
            raise ServeConfigError(f"a provider would refuse the retraining job: {exc}") from None
