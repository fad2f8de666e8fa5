"""The per-part cleaning step: read -> normalise -> filter -> scrub PII -> hash -> MinHash, streamed.

`clean_part` is a pure function of (its files' bytes, the data spec): it runs in a worker process, as
one task of a Slurm array or as a Ray task, and writes its result as a part directory (partstore.py)
keyed by `part_key`: the part's files as listed (path and identity) and every setting it reads. Nothing
in it depends on other parts. Documents stream through it: one document and one MinHash batch are held
at a time, so its memory does not depend on the part's size. Each file's sha256 is computed from the
bytes as they are read and recorded in the part, so the dataset's fingerprint comes from what was
cleaned, and a file is read once.

A part whose files changed while it was read is not committed (`InputChanged`); a part one of whose
files was modified just before it was read (racy: its identity cannot vouch for its content later) is
committed for this preparation but not reused by a later one.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from runyard.data import minhash
from runyard.data.budget import MemoryBudget
from runyard.data.filters import check_document
from runyard.data.normalize import normalize_text
from runyard.data.partstore import PartReader, PartWriter, is_complete
from runyard.data.pii import scrub_pii
from runyard.data.sources import InputFile, ReadLimits, iter_file_documents
from runyard.spec.data import DataSpec

SAMPLE_CHARS = 300


def text_hash(text: str) -> bytes:
    """The exact-duplicate key: 16-byte blake2b of the normalised text."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def part_key(files: list[InputFile], spec: DataSpec, version: int) -> str:
    """Fingerprint of one part's cleaning: its files as listed (path and identity) and every setting
    clean_part reads."""
    settings = {
        "v": version,
        "sources": {
            i: spec.sources[i].model_dump(mode="json", exclude={"path", "exclude"})
            for i in sorted({f.source for f in files})
        },
        "normalize": spec.normalize.model_dump(mode="json"),
        "filters": spec.filters.model_dump(mode="json"),
        "pii": spec.pii.model_dump(mode="json"),
        "minhash": [spec.dedup.near, spec.dedup.num_perm, spec.dedup.ngram, spec.dedup.seed],
        "files": [[f.source, f.path, f.identity] for f in files],
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


class _Batch:
    """Documents gathered until a MinHash batch is full."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.texts: list[str] = []
        self.size = 0


def clean_part(files: list[InputFile], spec: DataSpec, out: Path, budget: MemoryBudget,
               temp_dir: str | None = None) -> dict[str, Any]:
    """Read and clean every document of `files` into the part directory `out`; see the module doc.
    Returns the part's meta (counters and the files' digests)."""
    num_perm = spec.dedup.num_perm if spec.dedup.near else 0
    writer = PartWriter(out, num_perm)
    counts: Counter = Counter()
    removed: Counter = Counter()
    pii: Counter = Counter()
    samples: dict[str, list[dict]] = {}
    pii_samples: dict[str, list[dict]] = {}
    limits = ReadLimits(max_document_bytes=budget.max_document_bytes,
                        parquet_batch_bytes=budget.io_block_bytes, temp_dir=temp_dir)
    batch = _Batch()
    read_times: dict[str, float] = {}

    def flush() -> None:
        encoded = [t.encode("utf-8") for t in batch.texts]
        sigs = (minhash.signatures(batch.texts, spec.dedup.num_perm, spec.dedup.ngram, spec.dedup.seed)
                if spec.dedup.near else None)
        chars = np.fromiter((len(t) for t in batch.texts), dtype=np.int64, count=len(batch.texts))
        exact = [hashlib.blake2b(e, digest_size=16).digest() for e in encoded]
        writer.add(batch.ids, encoded, chars, exact, sigs)
        batch.__init__()

    # Per source: documents read, removed per reason and kept; a source with its own filters (a traffic
    # source) is counted there alone, so data.filters' table names only removals by data.filters' bounds.
    per_source: dict[int, dict[str, Any]] = {}
    kept_per_file: list[int] = []
    try:
        for file in files:
            source = spec.sources[file.source]
            filters = source.filters or spec.filters
            pii_spec = source.pii or spec.pii
            own = per_source.setdefault(file.source, {"read": 0, "kept": 0, "removed": Counter(), "samples": {}})
            # removals by this source's own filters are reported with the source, not with data.filters'
            into_removed, into_samples = (own["removed"], own["samples"]) if source.filters else (removed, samples)
            read_times[file.path] = time.time()
            kept_here = 0
            for doc_id, raw in iter_file_documents(source, file, counts, limits):
                counts["documents_read"] += 1
                counts["chars_read"] += len(raw)
                own["read"] += 1
                text = normalize_text(raw, spec.normalize)
                failed = check_document(text, filters)
                if failed is not None:
                    into_removed[failed.reason] += 1
                    kept = into_samples.setdefault(failed.reason, [])
                    if len(kept) < filters.samples_per_reason:
                        kept.append(failed.sample(doc_id, text[:SAMPLE_CHARS]))
                    continue
                text = scrub_pii(text, pii_spec, pii, pii_samples)
                kept_here += 1
                own["kept"] += 1
                if batch.texts and batch.size + len(text) > budget.minhash_batch_bytes:
                    flush()  # a batch holds at most minhash_batch_bytes, or one larger document alone
                batch.ids.append(doc_id)
                batch.texts.append(text)
                batch.size += len(text)
            kept_per_file.append(kept_here)
        if batch.texts:
            flush()
        meta = {
            "counts": dict(counts),
            "removed": dict(removed),
            "pii": dict(pii),
            "samples": samples,
            "pii_samples": pii_samples,
            "per_source": {str(i): {**c, "removed": dict(c["removed"])} for i, c in sorted(per_source.items())},
            "files": [
                {"source": f.source, "path": f.path, "identity": f.identity, **asdict(limits.digests[f.path]),
                 "read_at": read_times[f.path], "documents": n}
                for f, n in zip(files, kept_per_file, strict=True)
            ],
        }
        writer.commit(meta)
    except BaseException:
        writer.abort()
        raise
    return meta


def reusable_part(path: Path) -> dict[str, Any] | None:
    """The meta of a committed part that a later preparation may reuse: None if it is absent, or if one
    of its files was racy when read (see the module doc)."""
    if not is_complete(path):
        return None
    meta = PartReader(path).meta
    if any(f.get("racy") for f in meta["files"]):
        return None
    return meta
