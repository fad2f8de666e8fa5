"""prepare_data: run the data stage and return where its outputs are.

Steps (each a pure function of its inputs and settings; the two heavy ones run as tasks on an executor):
  1. list the inputs with their identities (size, mtime, inode; or a store's ETag/generation)
  2. clean: one task per part of the inputs (clean.py: read once while hashing, normalise, filter,
     PII, exact hash, MinHash), each writing a part directory keyed by its files' identities
  3. fingerprint: the dataset's fingerprint from the sha256 of every file as its part read it
  4. exact + near-duplicate removal over all parts (dedup_external.py: sorted runs on disk)
  5. split train/held-out by a seeded hash of each document (corpus.py, split.py)
  6. tokenizer: train BPE on the train split (capped by train_max_bytes) or load one
  7. tokenize: one task per part (tokenize.py; resumable chunk by chunk), then the shards of both
     splits assembled in one pass that also counts the training split's tokens
The outputs live in a content-addressed directory `<cache>/datasets/<fingerprint>/`. A second call with
the same inputs finds every part by the files' identities, the fingerprint from the hashes recorded in
them, and `prepared.json` in that directory: it returns without reading a byte of the sources.

Executors (executors/): `local` worker processes, a `slurm` job array per step, or `ray`; the tasks and
the dataset are the same on each. Memory: `data.memory_limit` bounds the whole tree (budget.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runyard.data import residency
from runyard.data.budget import PROCESS_BASE, MemoryBudget
from runyard.data.build import HELD_OUT_LIST, build_dataset
from runyard.data.clean import part_key, reusable_part
from runyard.data.errors import InputChanged
from runyard.data.executors import ExecutorChoice, make_executor
from runyard.data.footprint import check_cache_space
from runyard.data.partstore import PartReader
from runyard.data.report import write_report
from runyard.data.shards import load_index, open_shard
from runyard.data.sources import (
    InputFile,
    current_identity,
    expand_path_template,
    hash_file,
    list_input_files,
)
from runyard.data.tokenize import cpu_count
from runyard.data.tokenizer import TOKENIZER_CONFIG_FILE
from runyard.data.work_units import Task
from runyard.errors import DataError
from runyard.spec.data import DataSpec
from runyard.system.files import atomic_write_bytes
from runyard.system.locking import LockHolder, ProcessLock
from runyard.system.progress import progress_bars

log = logging.getLogger(__name__)

PIPELINE_VERSION = 2  # bump when a step's output changes for the same inputs (2: offsets beside shards)
_NOT_FINGERPRINTED = {
    "cache_dir", "workers", "residency", "store", "cache_region", "chunk_bytes", "memory_limit",
}
PARTS_TARGET = 64  # parts of a corpus: enough for any machine's workers to share evenly
MIN_PART_BYTES = 512 << 10
MAX_PART_BYTES = 256 << 20


@dataclass(frozen=True)
class PreparedData:
    """Where a prepared dataset is and what it holds."""

    tokenizer_path: Path
    vocab_size: int
    eos_id: int
    train_index: Path | None  # None: no top-level data (an sft/dpo-only run has the tokenizer alone)
    heldout_index: Path | None
    fingerprint: str
    stats: dict[str, Any]
    input_fingerprints: dict[str, str]
    dataset_dir: Path = field(default=Path("."))
    train_token_counts: Path | None = None  # int64 .npy: the training split's tokens per id


def resolve_cache_dir(spec: DataSpec, cache_dir: Path | str | None = None) -> Path:
    """The cache root: the argument, else data.cache_dir, else $RUNYARD_CACHE_DIR, else ~/.cache/runyard/data."""
    chosen = cache_dir or spec.cache_dir or os.environ.get("RUNYARD_CACHE_DIR")
    return Path(chosen).expanduser() if chosen else Path.home() / ".cache" / "runyard" / "data"


def _source_base(pattern: str) -> str:
    """The fixed directory part of a glob, so recorded input names do not depend on where it sits."""
    parts = expand_path_template(pattern).split("/")
    fixed = []
    for part in parts:
        if any(c in part for c in "*?["):
            break
        fixed.append(part)
    base = "/".join(fixed)
    return base if any(c in pattern for c in "*?[") else os.path.dirname(base)


def fingerprint_from_hashes(spec: DataSpec, files: list[InputFile], file_hashes: dict[str, str]) -> dict[str, str]:
    """sha256 per source over (relative path, sha256 of bytes) of its files, in path order."""
    per_source: dict[int, Any] = {}
    for f in files:
        base = _source_base(spec.sources[f.source].path)
        rel = os.path.relpath(f.path, base) if base and "://" not in f.path else f.path
        h = per_source.setdefault(f.source, hashlib.sha256())
        h.update(f"{rel}\0{file_hashes[f.path]}\n".encode())
    return {f"sources[{i}] {spec.sources[i].path}": h.hexdigest() for i, h in sorted(per_source.items())}


def fingerprint_inputs(
    spec: DataSpec, files: list[InputFile], file_hashes: dict[str, str] | None = None
) -> dict[str, str]:
    """fingerprint_from_hashes, reading (in blocks) each file whose hash `file_hashes` lacks."""
    file_hashes = {} if file_hashes is None else file_hashes
    for f in files:
        if f.path not in file_hashes:
            file_hashes[f.path] = hash_file(f).sha256
    return fingerprint_from_hashes(spec, files, file_hashes)


def dataset_fingerprint(spec: DataSpec, seed: int, inputs: dict[str, str]) -> str:
    settings = spec.model_dump(mode="json", exclude=_NOT_FINGERPRINTED)
    if spec.tokenizer.path:
        try:
            tok_bytes = Path(spec.tokenizer.path).read_bytes()
        except OSError as exc:
            raise DataError(
                f"data.tokenizer.path {spec.tokenizer.path!r}: cannot read it ({exc.strerror})"
            ) from None
        settings["tokenizer_sha256"] = hashlib.sha256(tok_bytes).hexdigest()
        beside = Path(spec.tokenizer.path).parent / TOKENIZER_CONFIG_FILE  # names the end-of-document token
        if beside.is_file():
            settings["tokenizer_config_sha256"] = hashlib.sha256(beside.read_bytes()).hexdigest()
    blob = json.dumps(
        {"v": PIPELINE_VERSION, "seed": seed, "settings": settings, "inputs": inputs}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def plan_parts(files: list[InputFile]) -> list[list[InputFile]]:
    """Consecutive files grouped into parts of about equal bytes: PARTS_TARGET of them, each between
    MIN_PART_BYTES and MAX_PART_BYTES. Depends on the listing alone (never on the worker count), so a
    later preparation finds the same parts whatever runs it."""
    total = sum(f.size for f in files)
    target = min(MAX_PART_BYTES, max(MIN_PART_BYTES, total // PARTS_TARGET))
    parts: list[list[InputFile]] = [[]]
    size = 0
    for f in files:
        if size >= target and parts[-1]:
            parts.append([])
            size = 0
        parts[-1].append(f)
        size += f.size
    return parts


@contextmanager
def _locked(lock_path: Path, what: str):
    """One preparer at a time (e.g. several ranks started at once): the others wait. The lock dies with
    its holder and is never held by its worker processes (runyard.system.locking), so a killed preparer never
    leaves a later one waiting."""

    def waiting(holder: LockHolder | None) -> None:
        who = holder.describe() if holder else "another process"
        log.info("waiting for %s: %s is preparing it", what, who)

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = ProcessLock(lock_path, purpose=f"preparing {what}")
    lock.acquire(blocking=True, on_wait=waiting)
    try:
        yield
    finally:
        lock.release()


def _temp_writer(name: str) -> tuple[str | None, int] | None:
    """(host or None, pid) of an unfinished write's temporary name (`.X.tmp-PID`, `.X.tmp-HOST-PID`)."""
    if not name.startswith(".") or ".tmp-" not in name:
        return None
    tail = name.rpartition(".tmp-")[2]
    host, _, pid = tail.rpartition("-")
    return (host or None, int(pid)) if pid.isdigit() else None


def _is_stale(path: Path) -> bool:
    writer = _temp_writer(path.name)
    if writer is None:
        return False
    host, pid = writer
    if host not in (None, socket.gethostname()):
        return time.time() - path.stat().st_mtime > 24 * 3600  # another node's: only when long abandoned
    return not os.path.exists(f"/proc/{pid}")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_writes(clean_step_dir: Path) -> list[Path]:
    """Remove the clean step's unfinished parts whose writer (the host and PID in their name) is gone:
    the directory is shared by every dataset, so a live writer's are left alone."""
    removed = []
    if clean_step_dir.is_dir():
        for path in clean_step_dir.iterdir():
            if _is_stale(path):
                _remove(path)
                removed.append(path)
    return removed


def clean_interrupted(dataset_dir: Path, clean_step_dir: Path) -> list[Path]:
    """Remove temporary files that interrupted writes left. Called under the dataset's lock, so every
    temporary file in the dataset directory is stale; in the clean step's directory see
    remove_stale_writes."""
    removed = []
    for directory in (dataset_dir, dataset_dir / "work"):
        if directory.is_dir():
            for path in directory.iterdir():
                if path.name.startswith(".") and (".tmp-" in path.name or path.name.endswith(".tmp")):
                    _remove(path)
                    removed.append(path)
    removed += remove_stale_writes(clean_step_dir)
    if removed:
        log.info("removed %d temporary file(s) left by an interrupted data preparation", len(removed))
    return removed


def load_prepared(dataset_dir: Path) -> PreparedData | None:
    """The PreparedData of a complete dataset directory, or None if it is absent or incomplete."""
    path = dataset_dir / "prepared.json"
    if not path.exists():
        return None
    meta = json.loads(path.read_text())
    paths = {k: dataset_dir / meta[k] for k in ("tokenizer_path", "train_index", "heldout_index")}
    if not all(p.exists() for p in paths.values()):
        return None
    counts = meta.get("train_token_counts")
    return PreparedData(
        vocab_size=meta["vocab_size"],
        eos_id=meta["eos_id"],
        fingerprint=meta["fingerprint"],
        stats=meta["stats"],
        input_fingerprints=meta["input_fingerprints"],
        dataset_dir=dataset_dir,
        train_token_counts=dataset_dir / counts if counts else None,
        **paths,
    )


def train_token_counts(prepared: PreparedData) -> np.ndarray:
    """The training split's tokens per id (int64, vocab_size long), as the tokenize step counted them;
    for a dataset prepared before they were kept, counted from its shards a shard at a time."""
    if prepared.train_token_counts is not None and prepared.train_token_counts.exists():
        counts = np.load(prepared.train_token_counts, allow_pickle=False)
        if counts.shape == (prepared.vocab_size,):
            return counts.astype(np.int64)
    counts = np.zeros(prepared.vocab_size, dtype=np.int64)
    index = load_index(prepared.train_index)
    for entry in index["shards"]:
        tokens = open_shard(prepared.train_index.parent / entry["file"])
        for lo in range(0, len(tokens), 1 << 24):
            counts += np.bincount(tokens[lo : lo + (1 << 24)], minlength=prepared.vocab_size)[: prepared.vocab_size]
    return counts


def _vouch(files: list[InputFile]) -> list[InputFile]:
    """Files whose listing cannot vouch for their content (a store that reports no version) are read
    once now and known by their sha256 instead."""
    out = []
    for f in files:
        if f.identity.startswith("unversioned:"):
            log.info("%s: the store reports no version for it; reading it to know its content", f.path)
            f = InputFile(f.source, f.path, f.size, f"sha256:{hash_file(f).sha256}")
        out.append(f)
    return out


class _Plan:
    """The inputs, their parts and where everything goes, for one call of prepare_data."""

    def __init__(self, spec: DataSpec, seed: int, root: Path, executor: ExecutorChoice | None):
        self.spec, self.seed, self.root = spec, seed, root
        self.choice = executor or ExecutorChoice()
        self.files = _vouch(list_input_files(spec.sources))
        self.parts = plan_parts(self.files)
        self.clean_dir = root / "steps" / "clean"
        self.part_dirs = [self.clean_dir / part_key(p, spec, PIPELINE_VERSION) for p in self.parts]
        listing = hashlib.sha256("\n".join(d.name for d in self.part_dirs).encode()).hexdigest()
        self.listing_lock = root / "steps" / "locks" / f"{listing[:32]}.lock"
        limit = int(spec.memory_limit)
        if self.choice.kind == "local":
            workers = spec.workers or cpu_count()
            self.budget = MemoryBudget.for_local(limit, workers)
            self.task_budget = (limit, workers)
        else:  # tasks run elsewhere, each alone with the whole limit; this process is alone here
            self.budget = MemoryBudget(limit, 0)
            self.task_budget = (limit + PROCESS_BASE, 1)
        self.executor = make_executor(self.choice, spec.workers if self.choice.kind != "local" else
                                      self.budget.workers, limit, root / "steps" / "logs" / listing[:16])

    def file_hashes(self, metas: list[dict[str, Any]]) -> dict[str, str]:
        """Every file's sha256 as its part read it; InputChanged if one file was read with two contents."""
        hashes: dict[str, str] = {}
        for meta in metas:
            for f in meta["files"]:
                if hashes.setdefault(f["path"], f["sha256"]) != f["sha256"]:
                    raise InputChanged(
                        f"{f['path']} was read twice (it is in two sources) and changed in between; "
                        "run the data stage again once the source is stable"
                    )
        return hashes

    def cached(self) -> PreparedData | None:
        """The prepared dataset, found from the parts alone (no source read), or None."""
        metas = [reusable_part(d) for d in self.part_dirs]
        if any(m is None for m in metas):
            return None
        inputs = fingerprint_from_hashes(self.spec, self.files, self.file_hashes(metas))
        fp = dataset_fingerprint(self.spec, self.seed, inputs)
        return load_prepared(self.root / "datasets" / fp[:32])


def prepare_data(
    data_spec: DataSpec,
    seed: int,
    report_dir: Path | None,
    cache_dir: Path | None = None,
    progress: bool | None = True,
    executor: ExecutorChoice | None = None,
) -> PreparedData:
    """Run (or reuse) the data stage for `data_spec`; write the data report to `report_dir` if given.
    `executor` says where the clean and tokenize tasks run (default: local worker processes). `progress`:
    True bars on a terminal, False log lines only, None silent (runyard.system.progress)."""
    root = resolve_cache_dir(data_spec, cache_dir)
    residency.check_cache(data_spec, root)
    plan = _Plan(data_spec, seed, root, executor)
    prepared = plan.cached()
    if prepared is None:
        with _locked(plan.listing_lock, "these inputs"), plan.executor:
            prepared = plan.cached() or _prepare(plan, progress)
    (prepared.dataset_dir / ".last_used").touch()  # for least-recently-used eviction
    if report_dir is not None:
        write_report(Path(report_dir), prepared.stats)
        held_out = prepared.dataset_dir / HELD_OUT_LIST
        if held_out.exists():  # a dataset prepared before the list was written has only the ids' digest
            atomic_write_bytes(Path(report_dir) / HELD_OUT_LIST, held_out.read_bytes())
    return prepared


def _prepare(plan: _Plan, progress: bool | None) -> PreparedData:
    spec = plan.spec
    remove_stale_writes(plan.clean_dir)
    check_cache_space(spec, plan.files, plan.root)
    started = time.perf_counter()
    metas = _clean(plan, progress)
    for f in plan.files:  # a file that changed after its part read it must not be taken as read
        if f.identity and not f.identity.startswith("sha256:") and current_identity(f.path) != f.identity:
            raise InputChanged(
                f"{f.path} (data.sources[{f.source}]) changed or disappeared while the data stage ran; the "
                "cleaned parts of the other files are kept. Run the data stage again once the source is stable"
            )
    inputs = fingerprint_from_hashes(spec, plan.files, plan.file_hashes(metas))
    fp = dataset_fingerprint(spec, plan.seed, inputs)
    dataset_dir = plan.root / "datasets" / fp[:32]
    timings = {"clean_s": time.perf_counter() - started}
    with _locked(dataset_dir / ".lock", f"the data cache {dataset_dir}"):
        prepared = load_prepared(dataset_dir)
        if prepared is None:
            clean_interrupted(dataset_dir, plan.clean_dir)
            build_dataset(
                spec, plan.seed, plan.part_dirs, metas, len(plan.files), inputs, fp,
                dataset_dir, plan.budget, plan.executor, plan.task_budget, progress, timings,
            )
            prepared = load_prepared(dataset_dir)
            assert prepared is not None
    return prepared


def _clean(plan: _Plan, progress: bool | None) -> list[dict[str, Any]]:
    """Run the clean task of every part not reusable; returns every part's meta, in order."""
    spec_json = plan.spec.model_dump(mode="json")
    tasks = []
    for i, (files, out) in enumerate(zip(plan.parts, plan.part_dirs, strict=True)):
        if reusable_part(out) is not None:
            continue
        if out.exists():  # committed from racy files: redo it
            shutil.rmtree(out)
        tasks.append(Task("clean", i, str(out), {"spec": spec_json, "files": [asdict(f) for f in files]},
                          plan.task_budget))
    with progress_bars(progress) as bars:
        bar = bars.add_task(
            "clean + minhash", total=len(plan.parts), completed=len(plan.parts) - len(tasks),
            info=f"{len(plan.files)} files, {len(tasks)} parts to do on {plan.executor.name}",
        )
        plan.executor.run("clean", tasks, lambda task: bars.advance(bar))
    return [PartReader(d).meta for d in plan.part_dirs]
