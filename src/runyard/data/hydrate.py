"""Hydration: copy a prepared dataset from where it is kept (the cold store: a path or any fsspec URL)
into the local cache next to the compute.

- Publish (`publish_dataset`) copies a prepared dataset directory into `<store>/<fingerprint>/`.
- Hydrate (`hydrate_dataset`) copies it back into `<cache>/datasets/<fingerprint>/`: shards, their
  document offsets and the other large files in parallel threads, each into `<name>.partial` and
  resumed from its current length after an interruption, every file checked against the sha256 its
  index (or prepared.json) records before it is renamed into place; the index files and
  `prepared.json` are written last, so a cache entry is usable exactly when `prepared.json` exists.
- Eviction: with a size limit, whole least-recently-used datasets are removed from the cache before
  the copy starts, never the one being hydrated.
- Residency: the destination's region is checked against `data.residency` before any byte moves.
On a cluster each node hydrates its own cache; the per-shard copy is the unit a Ray task would take.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import fsspec

from runyard.data import residency
from runyard.data.pipeline import (
    PreparedData,
    dataset_fingerprint,
    fingerprint_inputs,
    load_prepared,
    resolve_cache_dir,
)
from runyard.data.shards import HEADER, ShardCorrupt
from runyard.data.sources import list_input_files
from runyard.errors import DataError
from runyard.spec.data import DataSpec
from runyard.system.files import atomic_write_bytes, sha256_file
from runyard.system.progress import progress_bars

META_FILES = ("tokenizer.json", "split.json", "train.json", "heldout.json")
COPY_BLOCK = 1 << 22


@dataclass(frozen=True)
class HydrateResult:
    prepared: PreparedData
    bytes_copied: int
    bytes_reused: int
    seconds: float
    evicted: list[str]

    @property
    def mb_per_s(self) -> float:
        return self.bytes_copied / 1e6 / max(self.seconds, 1e-9)


def _join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def _store_region(spec: DataSpec, store_url: str | None) -> tuple[str, str | None]:
    if store_url is not None:
        region = spec.store.region if spec.store and spec.store.url == store_url else None
        return store_url, region
    if spec.store is None:
        raise DataError("no store given: set data.store.url in the spec or pass --store")
    return spec.store.url, spec.store.region


def payload_files(meta: dict[str, bytes]) -> list[tuple[str, int, str]]:
    """(name, bytes, sha256) of every file of a dataset besides its small metadata (`meta`: the
    contents of META_FILES and prepared.json): the shards and their document offsets (from the
    indexes), and the files prepared.json lists (token counts, held-out ids)."""
    out = []
    for idx in ("train.json", "heldout.json"):
        index = json.loads(meta[idx])
        itemsize = 2 if index["dtype"] == "uint16" else 4
        offset_size = 4 if index["shard_tokens"] < 1 << 32 else 8
        for e in index["shards"]:
            out.append((e["file"], HEADER.size + e["tokens"] * itemsize, e["sha256"]))
            if "docs_file" in e:  # pipeline version 2 on
                out.append((e["docs_file"], HEADER.size + e["documents"] * offset_size, e["docs_sha256"]))
    for name, info in json.loads(meta["prepared.json"]).get("files", {}).items():
        out.append((name, info["bytes"], info["sha256"]))
    for name, _, _ in out:
        if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", str(name)):
            raise DataError(f"the dataset lists a file {name!r} that is not a plain file name")
    return out


def publish_dataset(prepared: PreparedData, spec: DataSpec, store_url: str | None = None) -> str:
    """Copy a prepared dataset into the cold store; returns its URL there. Refused before any write if
    the store's region is outside data.residency."""
    url, region = _store_region(spec, store_url)
    residency.check_store(spec, url, region)
    fs, root = fsspec.core.url_to_fs(_join(url, prepared.fingerprint[:32]))
    fs.makedirs(root, exist_ok=True)
    meta = {name: (prepared.dataset_dir / name).read_bytes() for name in (*META_FILES, "prepared.json")}
    names = [name for name, _, _ in payload_files(meta)]
    for name in [*names, *META_FILES, "prepared.json"]:  # prepared.json last: marks the copy complete
        fs.put_file(str(prepared.dataset_dir / name), f"{root}/{name}")
    return _join(url, prepared.fingerprint[:32])


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def evict_for(cache_root: Path, keep: str, needed: int, max_bytes: int) -> list[str]:
    """Remove least-recently-used complete datasets (other than `keep`) until `needed` more bytes fit
    under `max_bytes`; returns the evicted fingerprints."""
    datasets = cache_root / "datasets"
    entries = [d for d in datasets.iterdir() if d.is_dir() and d.name != keep] if datasets.exists() else []
    used = sum(_dir_size(d) for d in entries)
    keep_dir = datasets / keep
    used += _dir_size(keep_dir) if keep_dir.exists() else 0
    evicted = []
    for d in sorted(
        entries, key=lambda d: (d / ".last_used").stat().st_mtime if (d / ".last_used").exists() else 0
    ):
        if used + needed <= max_bytes:
            break
        size = _dir_size(d)
        shutil.rmtree(d, ignore_errors=True)
        used -= size
        evicted.append(d.name)
    if used + needed > max_bytes:
        raise DataError(
            f"the dataset needs {needed / 1e6:.1f} MB more but the cache limit is "
            f"{max_bytes / 1e6:.1f} MB with {used / 1e6:.1f} MB still in use"
        )
    return evicted


def _copy_resumable(fs, src: str, dest: Path, expected_size: int, expected_sha: str) -> tuple[int, int]:
    """Copy src into dest via dest.partial, resuming from its length; verify sha256. Returns
    (bytes copied now, bytes reused from an earlier attempt)."""
    if dest.exists() and dest.stat().st_size == expected_size and sha256_file(dest) == expected_sha:
        return 0, expected_size
    partial = dest.with_name(dest.name + ".partial")
    for attempt in range(2):
        have = partial.stat().st_size if partial.exists() else 0
        if have > expected_size:
            partial.unlink()
            have = 0
        copied = 0
        with fs.open(src, "rb") as fin, open(partial, "ab") as fout:
            fin.seek(have)
            while block := fin.read(COPY_BLOCK):
                fout.write(block)
                copied += len(block)
            fout.flush()
            os.fsync(fout.fileno())
        if sha256_file(partial) == expected_sha:
            os.replace(partial, dest)
            return copied, have
        partial.unlink()  # a bad resume base or a bad copy: start this shard again once
        if attempt == 1:
            raise ShardCorrupt(
                f"{src}: sha256 after copy does not match its index; the store copy is corrupt"
            )
    raise AssertionError("unreachable")


def hydrate_dataset(
    spec: DataSpec,
    fingerprint: str,
    store_url: str | None = None,
    cache_dir: Path | None = None,
    max_cache_bytes: int | None = None,
    threads: int = 4,
    progress: bool | None = True,
) -> HydrateResult:
    """Copy dataset `fingerprint` from the store into the local cache (see the module doc)."""
    url, _ = _store_region(spec, store_url)
    cache_root = resolve_cache_dir(spec, cache_dir)
    residency.check_cache(spec, cache_root)  # before any byte moves
    # The key and the shard names become local paths: refuse anything that could leave the cache.
    if not re.fullmatch(r"[0-9a-f]{32,64}", fingerprint):
        raise DataError(f"dataset fingerprint {fingerprint!r} is not 32-64 lowercase hex digits")
    key = fingerprint[:32]
    src_root = _join(url, key)
    fs, root = fsspec.core.url_to_fs(src_root)
    if not fs.exists(f"{root}/prepared.json"):
        raise DataError(f"the store has no complete dataset {key} (no {src_root}/prepared.json)")
    meta = {name: fs.cat_file(f"{root}/{name}") for name in (*META_FILES, "prepared.json")}
    payload = payload_files(meta)
    sizes = {name: size for name, size, _ in payload}
    dest = cache_root / "datasets" / key
    evicted: list[str] = []
    if max_cache_bytes is not None:
        needed = sum(sizes.values()) + sum(len(v) for v in meta.values())
        needed -= _dir_size(dest) if dest.exists() else 0
        evicted = evict_for(cache_root, key, max(0, needed), max_cache_bytes)
    dest.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    copied = reused = 0
    with progress_bars(progress, bytes_mode=True) as bars:
        task = bars.add_task("hydrate", total=sum(sizes.values()), info=f"{len(payload)} files from {url}")

        def one(item: tuple[str, int, str]) -> tuple[int, int]:
            name, size, sha = item
            result = _copy_resumable(fs, f"{root}/{name}", dest / name, size, sha)
            bars.advance(task, size)
            return result

        with ThreadPoolExecutor(max(1, threads)) as pool:
            for c, r in pool.map(one, payload):
                copied, reused = copied + c, reused + r
    for name in (*META_FILES, "prepared.json"):
        atomic_write_bytes(dest / name, meta[name])
    (dest / ".last_used").touch()
    prepared = load_prepared(dest)
    if prepared is None:
        raise DataError(f"hydrated dataset {dest} is incomplete")
    return HydrateResult(prepared, copied, reused, time.perf_counter() - start, evicted)


def find_fingerprint(spec: DataSpec, seed: int, store_url: str | None = None) -> str:
    """The dataset to hydrate: from the spec's sources when they are readable here, else the store's only
    dataset; a clear error when neither decides."""
    try:
        files = list_input_files(spec.sources)
        return dataset_fingerprint(spec, seed, fingerprint_inputs(spec, files))
    except DataError:
        pass
    url, _ = _store_region(spec, store_url)
    fs, root = fsspec.core.url_to_fs(url)
    found = [
        p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if fs.exists(f"{p}/prepared.json")
    ]
    if len(found) != 1:
        raise DataError(
            f"cannot tell which dataset to hydrate from {url} (sources unreadable here, "
            f"{len(found)} datasets in the store); pass --fingerprint"
        )
    return found[0]
