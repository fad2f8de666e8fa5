"""prepare_data: run the data stage and return where its outputs are.

Steps (each a pure function of its inputs and settings, so any of them can move to a cluster engine):
  1. list + fingerprint inputs (main process; sha256 of every file's bytes)
  2. clean parts in N processes (clean.py: read, normalise, filter, PII, exact hash, MinHash)
  3. exact + near-duplicate removal over all parts (dedup.py; needs only hashes and signatures)
  4. split train/held-out by a seeded hash of each document (split.py)
  5. tokenizer: train BPE on the train split (capped by train_max_bytes) or load one
  6. tokenize in chunks and assemble shards + index per split (tokenize.py; resumable chunk by chunk)
The outputs live in a content-addressed directory `<cache>/datasets/<fingerprint>/`; a second call
with the same inputs and settings finds `prepared.json` there and returns at once.

On a cluster: step 2 becomes a Slurm array (`--array=0-<parts-1>`, each task runs `clean_part` on its
part and writes its PartResult as files keyed by the part's fingerprint) or `ray.remote(clean_part)`;
step 3 is one small task reading every part's hashes and signatures; step 6's chunks are again an
array. Only the executor changes; the step functions stay as they are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from runyard.data import residency
from runyard.data.clean import PartResult, clean_part, load_part, part_key, save_part
from runyard.data.config import DataSpec
from runyard.data.dedup import exact_duplicates, near_duplicates
from runyard.data.footprint import check_cache_space
from runyard.data.progress import progress_bars
from runyard.data.report import write_report
from runyard.data.sources import InputFile, expand_path_template, list_input_files, read_bytes
from runyard.data.split import SPLIT_METHOD, heldout_mask
from runyard.data.tokenize import assemble_shards, cpu_count, tokenize_chunks
from runyard.data.tokenizer import (
    EOS_TOKEN,
    TOKENIZER_CONFIG_FILE,
    eos_id,
    eos_token_beside,
    load_tokenizer,
    train_bpe,
)
from runyard.errors import DataError
from runyard.fsutil import atomic_write_json, sha256_file
from runyard.lifetime import die_with_parent
from runyard.locking import LockHolder, ProcessLock

log = logging.getLogger(__name__)

PIPELINE_VERSION = 1  # bump when a step's output changes for the same inputs
_NOT_FINGERPRINTED = {"cache_dir", "workers", "residency", "store", "cache_region", "chunk_bytes"}


@dataclass(frozen=True)
class PreparedData:
    """Where a prepared dataset is and what it holds."""

    tokenizer_path: Path
    vocab_size: int
    eos_id: int
    train_index: Path
    heldout_index: Path
    fingerprint: str
    stats: dict[str, Any]
    input_fingerprints: dict[str, str]
    dataset_dir: Path = field(default=Path("."))


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


def fingerprint_inputs(
    spec: DataSpec, files: list[InputFile], file_hashes: dict[str, str] | None = None
) -> dict[str, str]:
    """sha256 per source over (relative path, sha256 of bytes) of its files, in path order. Per-file
    digests are stored into `file_hashes` when given."""
    per_source: dict[int, hashlib._Hash] = {}
    file_hashes = {} if file_hashes is None else file_hashes
    for f in files:
        base = _source_base(spec.sources[f.source].path)
        rel = os.path.relpath(f.path, base) if base and "://" not in f.path else f.path
        h = per_source.setdefault(f.source, hashlib.sha256())
        file_hashes[f.path] = hashlib.sha256(read_bytes(f.path)).hexdigest()
        h.update(f"{rel}\0{file_hashes[f.path]}\n".encode())
    return {f"sources[{i}] {spec.sources[i].path}": h.hexdigest() for i, h in sorted(per_source.items())}


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


@contextmanager
def _locked(directory: Path):
    """One preparer per dataset directory (e.g. several ranks started at once): the others wait.
    The lock dies with its holder and is never held by the holder's worker processes (runyard.locking),
    so a killed preparer never leaves a later one waiting."""

    def waiting(holder: LockHolder | None) -> None:
        who = holder.describe() if holder else "another process"
        log.info("waiting for the data cache %s: %s is preparing this dataset", directory, who)

    lock = ProcessLock(directory / ".lock", purpose="preparing this dataset")
    lock.acquire(blocking=True, on_wait=waiting)
    try:
        yield
    finally:
        lock.release()


def _is_temp(name: str) -> bool:
    # fsutil's `.NAME.tmp-PID` and the tokenizer's `.tokenizer.json.tmp`
    return name.startswith(".") and (".tmp-" in name or name.endswith(".tmp"))


def clean_interrupted(dataset_dir: Path, clean_step_dir: Path) -> list[Path]:
    """Remove temporary files that interrupted writes left. Called under the dataset's lock, so every
    temporary file in the dataset directory is stale; the clean step's directory is shared by all
    datasets, so there only files whose writer (the PID in their name) is gone are removed."""
    removed = []
    for directory in (dataset_dir, dataset_dir / "work"):
        if directory.is_dir():
            for path in directory.iterdir():
                if path.is_file() and _is_temp(path.name):
                    path.unlink(missing_ok=True)
                    removed.append(path)
    if clean_step_dir.is_dir():
        for path in clean_step_dir.iterdir():
            pid = path.name.rpartition(".tmp-")[2]
            if _is_temp(path.name) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                path.unlink(missing_ok=True)
                removed.append(path)
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
    return PreparedData(
        vocab_size=meta["vocab_size"],
        eos_id=meta["eos_id"],
        fingerprint=meta["fingerprint"],
        stats=meta["stats"],
        input_fingerprints=meta["input_fingerprints"],
        dataset_dir=dataset_dir,
        **paths,
    )


def prepare_data(
    data_spec: DataSpec,
    seed: int,
    report_dir: Path | None,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> PreparedData:
    """Run (or reuse) the data stage for `data_spec`; write the data report to `report_dir` if given."""
    root = resolve_cache_dir(data_spec, cache_dir)
    residency.check_cache(data_spec, root)
    files = list_input_files(data_spec.sources)
    file_hashes: dict[str, str] = {}
    inputs = fingerprint_inputs(data_spec, files, file_hashes)
    fp = dataset_fingerprint(data_spec, seed, inputs)
    dataset_dir = root / "datasets" / fp[:32]
    with _locked(dataset_dir):
        prepared = load_prepared(dataset_dir)
        if prepared is None:
            check_cache_space(data_spec, files, root)
            clean_interrupted(dataset_dir, root / "steps" / "clean")
            started = time.perf_counter()
            parts = _clean_all(data_spec, files, file_hashes, root / "steps" / "clean", progress)
            timings = {"clean_s": time.perf_counter() - started}
            prepared = _prepare(
                data_spec, seed, parts, len(files), inputs, fp, dataset_dir, progress, timings
            )
        (dataset_dir / ".last_used").touch()  # for least-recently-used eviction
    if report_dir is not None:
        write_report(Path(report_dir), prepared.stats)
    return prepared


def _worker_context():
    """fork where there is one (no re-import of the caller's __main__, no interpreter start-up per
    worker; the workers use only numpy and the standard library), else spawn."""
    return get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


def _clean_all(
    spec: DataSpec, files: list[InputFile], file_hashes: dict[str, str], step_dir: Path, progress: bool
) -> list[PartResult]:
    """Clean every part, reusing cached part results; new ones run in up to `workers` processes."""
    workers = min(spec.workers or cpu_count(), max(1, len(files)))
    # Parts of about equal bytes, several per worker so a slow part does not hold the others up.
    n_parts = max(1, min(len(files), workers * 4))
    target = sum(f.size for f in files) / n_parts
    parts: list[list[InputFile]] = [[]]
    size = 0
    for f in files:
        if size >= target and parts[-1]:
            parts.append([])
            size = 0
        parts[-1].append(f)
        size += f.size
    paths = [step_dir / f"{part_key(p, file_hashes, spec, PIPELINE_VERSION)}.npz" for p in parts]
    results: list[PartResult | None] = [load_part(p) if p.exists() else None for p in paths]
    todo = [i for i, r in enumerate(results) if r is None]
    with progress_bars(progress) as bars:
        task = bars.add_task(
            "clean + minhash",
            total=len(parts),
            completed=len(parts) - len(todo),
            info=f"{len(files)} files, {len(todo)} parts to do, {min(workers, max(1, len(todo)))} procs",
        )
        if workers == 1 or len(todo) <= 1:
            done = (clean_part(parts[i], spec) for i in todo)
            pool = None
        else:
            # Workers die with this process, however it dies: left alone they would wait for work forever.
            pool = ProcessPoolExecutor(min(workers, len(todo)), mp_context=_worker_context(),
                                       initializer=die_with_parent, initargs=(signal.SIGKILL, os.getpid()))
            done = (f.result() for f in [pool.submit(clean_part, parts[i], spec) for i in todo])
        try:
            for i, result in zip(todo, done, strict=True):  # in order: independent of scheduling
                save_part(paths[i], result)
                results[i] = result
                bars.advance(task)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    return [r for r in results if r is not None]


def _prepare(
    spec: DataSpec,
    seed: int,
    parts: list[PartResult],
    n_files: int,
    inputs: dict[str, str],
    fp: str,
    dataset_dir: Path,
    progress: bool,
    timings: dict[str, float],
) -> PreparedData:

    counts: dict[str, int] = {}
    removed: dict[str, int] = {}
    pii: dict[str, int] = {}
    samples: dict[str, list] = {}
    pii_samples: dict[str, list] = {}
    for p in parts:
        for target, source in ((counts, p.counts), (removed, p.removed), (pii, p.pii)):
            for k, v in source.items():
                target[k] = target.get(k, 0) + v
        for reason, s in p.samples.items():
            samples.setdefault(reason, []).extend(s)
        for kind, s in p.pii_samples.items():
            pii_samples.setdefault(kind, []).extend(s)
    samples = {r: s[: spec.filters.samples_per_reason] for r, s in samples.items()}
    pii_samples = {k: s[: spec.pii.samples_per_kind] for k, s in pii_samples.items()}
    ids = [i for p in parts for i in p.ids]
    texts = [t for p in parts for t in p.texts]
    hashes = [h for p in parts for h in p.exact]
    if counts.get("documents_read", 0) == 0:
        raise DataError(
            f"the data sources hold no documents ({counts.get('files', 0)} files read); "
            "check data.sources and their encoding_errors policy"
        )
    sizes = np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64)
    steps = [
        {"step": "read", "documents": counts.get("documents_read", 0), "bytes": counts.get("bytes_read", 0)},
        {"step": "filter", "documents": len(texts), "bytes": int(sizes.sum())},
    ]

    t = time.perf_counter()
    keep = np.ones(len(texts), dtype=bool)
    dedup_stats: dict[str, Any] = {"exact_removed": 0, "near_removed": 0, "threshold": spec.dedup.threshold}
    if spec.dedup.exact:
        dup = exact_duplicates(hashes)
        keep &= ~dup
        dedup_stats["exact_removed"] = int(dup.sum())
        steps.append({"step": "exact_dedup", "documents": int(keep.sum()), "bytes": int(sizes[keep].sum())})
    if spec.dedup.near and texts:
        sigs = np.concatenate([p.signatures for p in parts if p.signatures is not None])
        kept_idx = np.flatnonzero(keep)
        near = near_duplicates(sigs[kept_idx], spec.dedup.threshold, spec.dedup.bands)
        keep[kept_idx[near.duplicate]] = False
        dedup_stats.update(
            near_removed=int(near.duplicate.sum()),
            bands=near.bands,
            rows=near.rows,
            candidate_pairs=near.candidate_pairs,
            clusters=len(near.clusters),
            largest_clusters=[
                {"size": len(c), "kept": ids[kept_idx[c[0]]], "members": [ids[kept_idx[i]] for i in c[1:6]]}
                for c in near.clusters[: spec.dedup.report_clusters]
            ],
        )
        steps.append({"step": "near_dedup", "documents": int(keep.sum()), "bytes": int(sizes[keep].sum())})
    timings["dedup_s"] = time.perf_counter() - t
    ids = [i for i, k in zip(ids, keep, strict=True) if k]
    texts = [x for x, k in zip(texts, keep, strict=True) if k]
    hashes = [h for h, k in zip(hashes, keep, strict=True) if k]
    if len(texts) < 2:
        raise DataError(
            f"only {len(texts)} document(s) left after filtering and deduplication; "
            "a train/held-out split needs at least 2"
        )

    held = heldout_mask(hashes, seed, spec.heldout_fraction)
    split_docs = {
        "train": [x for x, h in zip(texts, held, strict=True) if not h],
        "heldout": [x for x, h in zip(texts, held, strict=True) if h],
    }
    heldout_ids = sorted(i for i, h in zip(ids, held, strict=True) if h)
    atomic_write_json(
        dataset_dir / "split.json", {"method": SPLIT_METHOD, "seed": seed, "heldout": heldout_ids}
    )

    t = time.perf_counter()
    tok_path = dataset_dir / "tokenizer.json"
    eos_token = eos_token_beside(spec.tokenizer.path) if spec.tokenizer.path else EOS_TOKEN
    if spec.tokenizer.path:
        tok = load_tokenizer(spec.tokenizer.path, eos_token)
        tok_source = str(spec.tokenizer.path)
    elif tok_path.exists():  # trained by an interrupted earlier attempt with the same fingerprint
        tok = load_tokenizer(tok_path)
        tok_source = "trained"
    else:
        with progress_bars(progress) as bars:
            bars.add_task("train BPE tokenizer", total=None, info=f"vocab {spec.tokenizer.vocab_size}")
            tok = train_bpe(
                split_docs["train"],
                spec.tokenizer.vocab_size,
                spec.tokenizer.min_frequency,
                spec.tokenizer.train_max_bytes,
            )
        tok_source = "trained"
    if not tok_path.exists():
        tmp = tok_path.with_name(".tokenizer.json.tmp")
        tok.save(str(tmp))
        os.replace(tmp, tok_path)
    eos = eos_id(tok, eos_token)
    vocab = tok.get_vocab_size()
    timings["tokenizer_s"] = time.perf_counter() - t

    t = time.perf_counter()
    work = dataset_dir / "work"
    split_stats = {}
    with progress_bars(progress, bytes_mode=True) as bars:
        for split, docs in split_docs.items():
            total = sum(len(d) for d in docs)
            task = bars.add_task(f"tokenize {split}", total=total, info=f"{len(docs)} docs")
            chunks = tokenize_chunks(
                tok,
                docs,
                eos,
                work,
                split,
                spec.chunk_bytes,
                on_chunk=lambda n, task=task: bars.advance(task, n),
            )
            result = assemble_shards(
                chunks, dataset_dir, split, shard_tokens=spec.shard_tokens, vocab_size=vocab, eos=eos
            )
            chars = sum(len(d) for d in docs)
            utf8 = sum(len(d.encode("utf-8")) for d in docs)
            split_stats[split] = {
                **result,
                "chars": chars,
                "bytes": utf8,
                "bytes_per_token": round(utf8 / max(1, result["tokens"] - result["documents"]), 4),
            }
    timings["tokenize_s"] = time.perf_counter() - t
    shutil.rmtree(work, ignore_errors=True)

    lengths = np.array([len(x) for x in texts], dtype=np.int64)
    edges = np.unique(np.logspace(0, np.log10(max(10, lengths.max()) + 1), 31).astype(np.int64))
    hist, _ = np.histogram(lengths, bins=edges)
    stats = {
        "fingerprint": fp,
        "seed": seed,
        "input_files": n_files,
        "read": counts,
        "steps": steps,
        "removed": removed,
        "removal_samples": samples,
        "filters": spec.filters.model_dump(mode="json"),
        "pii": pii,
        "pii_samples": pii_samples,
        "dedup": dedup_stats,
        "split": {
            "method": SPLIT_METHOD,
            "heldout_fraction": spec.heldout_fraction,
            "heldout_ids_sha256": hashlib.sha256("\n".join(heldout_ids).encode()).hexdigest(),
            **split_stats,
        },
        "tokenizer": {
            "source": tok_source,
            "vocab_size": vocab,
            "requested_vocab_size": None if spec.tokenizer.path else spec.tokenizer.vocab_size,
            "eos_id": eos,
            "train_max_bytes": spec.tokenizer.train_max_bytes,
        },
        "doc_length_histogram": {"unit": "characters", "edges": edges.tolist(), "counts": hist.tolist()},
        "timings": {k: round(v, 3) for k, v in timings.items()},
    }
    meta = {
        "fingerprint": fp,
        "vocab_size": vocab,
        "eos_id": eos,
        "tokenizer_path": "tokenizer.json",
        "train_index": "train.json",
        "heldout_index": "heldout.json",
        "stats": stats,
        "input_fingerprints": {
            **inputs,
            **{f"shards {n}.json": sha256_file(dataset_dir / f"{n}.json") for n in ("train", "heldout")},
        },
    }
    atomic_write_json(dataset_dir / "prepared.json", meta)  # last: its presence marks the dataset complete
    prepared = load_prepared(dataset_dir)
    assert prepared is not None
    return prepared
