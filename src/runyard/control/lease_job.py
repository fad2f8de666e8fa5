"""A lease's job on this machine: its folder, the data its demand carries, and the spec it may run.

A lease's job is a stranger's code. It reads only what its demand carries -- the files uploaded
with it and the URLs it names (`runyard.market.jobs`) -- and runs in a sandbox that shows it
nothing else (`runyard.control.sandbox`). This module lays out the lease's folder and checks the
spec against that rule before the lease is accepted, so a spec that names anything else is
rejected with a reason (and its escrow returned) instead of failing later inside the sandbox.

    <state>/agent/lease-<id>/      the agent's; read-only inside the sandbox
        spec.yaml                  the tenant's spec, as carried
        spec.run.yaml              the spec the job runs: file paths as the tenant wrote them, URLs -> local copies,
                                   model.init.path -> ../init-export
        files/                     the demand's uploaded files; the job's working directory
        urls/                      the demand's data URLs, fetched before the job starts
        sandbox.json               the sandbox policy (runyard.control.sandbox)
        failure.json               why the launcher could not run the job, when it could not
        passwd, group              the only users the sandbox knows
        export/                    a deployment's export: its uploaded files, and its URLs fetched there
        init-export/               the export a block job starts from (job.init_export), laid out the same way
        env/                       the job's environment lock, when its demand carries one
        work/                      the only writable folder: run/ (the run directory), home/, tmp/, cache/,
                                   and a deployment's socket `s.sock` (runyard.control.serve_relay)
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runyard.errors import RunyardError
from runyard.market.jobs import check_env_lock, check_file_path, check_init_export, decode_files
from runyard.system.files import atomic_write_bytes, atomic_write_text

_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.+-]")


class LeaseJobRefused(RunyardError):
    """A lease's job asks for something this provider does not give a lease job; the message says what."""


@dataclass(frozen=True)
class LeaseFolder:
    """The paths of one lease's folder (see the module docstring)."""

    root: Path

    @property
    def spec(self) -> Path:
        return self.root / "spec.yaml"

    @property
    def run_spec(self) -> Path:
        return self.root / "spec.run.yaml"

    @property
    def files(self) -> Path:
        return self.root / "files"

    @property
    def urls(self) -> Path:
        return self.root / "urls"

    @property
    def policy(self) -> Path:
        return self.root / "sandbox.json"

    @property
    def failure(self) -> Path:
        return self.root / "failure.json"

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def env_lock(self) -> Path:
        return self.root / "env"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def init_export(self) -> Path:
        return self.root / "init-export"

    @property
    def socket(self) -> Path:
        return self.work / "s.sock"

    @property
    def run_dir(self) -> Path:
        return self.work / "run"

    def create(self) -> LeaseFolder:
        """Make the folder and its work area; `work/` is kept if it exists (a restarted attempt)."""
        for sub in (self.files, self.urls, self.work / "run", self.work / "home", self.work / "tmp",
                    self.work / "cache"):
            sub.mkdir(parents=True, exist_ok=True)
        uid, gid = os.getuid(), os.getgid()
        atomic_write_text(self.root / "passwd", f"lease:x:{uid}:{gid}:lease job:{self.work / 'home'}:/bin/false\n")
        atomic_write_text(self.root / "group", f"lease:x:{gid}:\n")
        return self


def write_files(folder: LeaseFolder, files: dict[str, bytes]) -> None:
    """Write the demand's files into `folder.files`, replacing whatever was there."""
    shutil.rmtree(folder.files, ignore_errors=True)
    folder.files.mkdir(parents=True)
    for rel, data in files.items():
        check_file_path(rel)  # never trust a path, even one the market checked
        atomic_write_bytes(folder.files / rel, data)


def copy_drop_folder(drop: Path, folder: LeaseFolder, max_bytes: int) -> None:
    """The files of a local drop folder (a job the market did not carry) become the lease's files:
    regular files only (no links), at most `max_bytes` in all, without the spec and earlier results."""
    files: dict[str, bytes] = {}
    total = 0
    for path in sorted(drop.rglob("*")):
        rel = path.relative_to(drop).as_posix()
        if rel == "spec.yaml" or rel.split("/")[0] == "results" or path.is_symlink() or not path.is_file():
            continue
        total += path.stat().st_size
        if total > max_bytes:
            raise LeaseJobRefused(f"the drop folder {drop} holds more than {max_bytes} bytes of data")
        try:
            check_file_path(rel)
        except ValueError as exc:
            raise LeaseJobRefused(f"drop folder {drop}: {exc}") from None
        files[rel] = path.read_bytes()
    write_files(folder, files)


def url_file_name(index: int, url: str) -> str:
    """The local name of the index-th data URL: its position and last path part (keeps `.gz`, `.jsonl`)."""
    last = url.split("?", 1)[0].split("#", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    return f"{index}-{_SAFE_NAME.sub('_', last)[:100] or 'data'}"


def url_files(data_urls: list[str]) -> dict[str, str]:
    """URL -> its local file name under `urls/`."""
    return {url: url_file_name(i, url) for i, url in enumerate(data_urls)}


def write_init_export(folder: LeaseFolder, init: dict | None) -> dict[str, str]:
    """Write the job's init export's uploaded files into `folder.init_export` (an earlier one removed);
    returns the URLs the launcher fetches there (URL -> path under the lease folder). ValueError for a
    bad init export (checked again here: never trust the wire)."""
    shutil.rmtree(folder.init_export, ignore_errors=True)
    if not init:
        return {}
    check_init_export(init)
    folder.init_export.mkdir(parents=True)
    for rel, data in decode_files(init.get("export_files") or {}).items():
        atomic_write_bytes(folder.init_export / check_file_path(rel), data)
    return {url: f"{folder.init_export.name}/{check_file_path(rel)}"
            for rel, url in (init.get("export_urls") or {}).items()}


def runnable_spec(raw: dict[str, Any], folder: LeaseFolder, data_urls: list[str],
                  init_export: bool = False) -> dict[str, Any]:
    """The spec a lease's job runs, or LeaseJobRefused naming the field that reaches outside what
    the demand carries.

    `data.sources[].path` and `data.tokenizer.path` may name a relative path (or glob) of the
    demand's files, which must match at least one of them, or exactly one of its data URLs. A file's
    path stays as the tenant wrote it: the job runs in `files/` (its sandbox policy's `cwd`), so the
    spec it runs, its hash and its data fingerprints' keys are the tenant's own, and two providers'
    deliveries (or a delivery and the tenant's local run) compare without a difference of paths. A
    URL becomes its local copy, `../urls/<name>`, the same on every provider. `data.cache_dir` and
    `data.store` must be unset: a lease job's cache lives in its own work area and it publishes
    nowhere.

    `model.init` (at the top level or a stage's) that starts from a model directory (`from: export` or
    `from: hf`) must start from the one the demand carries (`init_export`, with the flag set): its path
    becomes `../init-export`, the lease's copy. A job carries one such directory, so every such init
    must name the same path.
    """
    spec = yaml.safe_load(yaml.safe_dump(raw))  # a deep copy of plain data
    _point_init_at_carried_export(spec, folder, init_export)
    data = spec.get("data")
    if not isinstance(data, dict):
        return spec  # load_spec has already said what is wrong with it
    local_urls = url_files(data_urls)
    for i, source in enumerate(data.get("sources") or []):
        if isinstance(source, dict) and isinstance(source.get("path"), str):
            source["path"] = _local_path(f"data.sources[{i}].path", source["path"], folder, local_urls)
    tokenizer = data.get("tokenizer")
    if isinstance(tokenizer, dict) and isinstance(tokenizer.get("path"), str):
        tokenizer["path"] = _local_path("data.tokenizer.path", tokenizer["path"], folder, local_urls)
    for field, why in (("cache_dir", "a lease job's token cache lives in its own work folder"),
                       ("store", "a lease job publishes its shards nowhere")):
        if data.get(field) is not None:
            raise LeaseJobRefused(f"data.{field} must be unset for a lease job: {why}")
    return spec


def _model_inits(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(field, init) for every `model.init` of the spec that names a model directory."""
    found = []
    places = [("model.init", spec.get("model"))]
    places += [(f"stages[{i}].model.init", stage.get("model")) for i, stage in enumerate(spec.get("stages") or [])
               if isinstance(stage, dict)]
    for where, model in places:
        init = model.get("init") if isinstance(model, dict) else None
        if isinstance(init, dict) and init.get("from") in ("export", "hf") and isinstance(init.get("path"), str):
            found.append((where, init))
    return found


def _point_init_at_carried_export(spec: dict[str, Any], folder: LeaseFolder, carried: bool) -> None:
    inits = _model_inits(spec)
    paths = sorted({init["path"] for _where, init in inits})
    if inits and not carried:
        where, init = inits[0]
        raise LeaseJobRefused(
            f"{where}.path {init['path'][:200]!r} names a model directory the demand does not carry; a lease job "
            "starts only from the export its demand carries (job.init_export: `runyard market demand --init-export`)")
    if len(paths) > 1:
        raise LeaseJobRefused(f"model.init names {len(paths)} model directories ({', '.join(p[:100] for p in paths)}); "
                              "a lease job carries one (job.init_export)")
    for _where, init in inits:
        init["path"] = f"../{folder.init_export.name}"


def _local_path(where: str, value: str, folder: LeaseFolder, local_urls: dict[str, str]) -> str:
    if "://" in value:
        if value not in local_urls:
            raise LeaseJobRefused(
                f"{where} {value[:200]!r} is a URL the demand does not name; a lease job reads only the "
                f"files its demand carries and the URLs in its data_urls ({sorted(local_urls) or 'none'})")
        return f"../{folder.urls.name}/{local_urls[value]}"
    if value.startswith(("/", "~")) or "{" in value or "\\" in value or ".." in value.split("/"):
        raise LeaseJobRefused(
            f"{where} {value[:200]!r} reaches outside the demand's files; a lease job reads only the files "
            "its demand carries (named by their relative paths) and the URLs in its data_urls")
    matches = [p for p in glob.glob(str(folder.files / value), recursive=True)
               if Path(p).resolve().is_relative_to(folder.files.resolve())]
    if not matches:
        raise LeaseJobRefused(f"{where} {value[:200]!r} matches none of the files the demand carries "
                              f"({', '.join(sorted(_listing(folder.files))[:20]) or 'it carries none'})")
    return value


def _listing(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]


def write_env_lock(folder: LeaseFolder, lock: dict[str, str] | None) -> Path | None:
    """Write the job's environment lock (as its demand carries it) into `folder.env_lock`, or remove an
    earlier one; returns the folder, or None without a lock."""
    shutil.rmtree(folder.env_lock, ignore_errors=True)
    if not lock:
        return None
    check_env_lock(lock)  # never trust the wire
    atomic_write_text(folder.env_lock / "requirements.txt", lock["requirements"])
    atomic_write_text(folder.env_lock / "environment.json", lock["environment"])
    return folder.env_lock


def write_runnable_spec(folder: LeaseFolder, spec: dict[str, Any]) -> Path:
    atomic_write_text(folder.run_spec, yaml.safe_dump(spec, sort_keys=False))
    return folder.run_spec
