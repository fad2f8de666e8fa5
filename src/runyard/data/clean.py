"""The per-part cleaning step: read -> normalise -> filter -> scrub PII -> hash -> MinHash.

`clean_part` is a pure function of (its files' bytes, the data spec): it runs in a worker process, and
the same call could run as one task of a Slurm array (`part = SLURM_ARRAY_TASK_ID`) or a Ray task, its
result written next to the others; nothing in it depends on other parts. The global steps after it
(deduplication, split) only need the small per-document hashes and signatures it returns.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from runyard.data import minhash
from runyard.data.config import DataSpec
from runyard.data.filters import check_document
from runyard.data.normalize import normalize_text
from runyard.data.pii import scrub_pii
from runyard.data.sources import InputFile, iter_file_documents

SAMPLE_CHARS = 300


@dataclass
class PartResult:
    """What one part yields: kept documents (ids, texts, exact hashes, signatures) and counters."""

    ids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    exact: list[bytes] = field(default_factory=list)
    signatures: np.ndarray | None = None
    counts: Counter = field(default_factory=Counter)
    removed: Counter = field(default_factory=Counter)
    pii: Counter = field(default_factory=Counter)
    samples: dict[str, list[dict]] = field(default_factory=dict)
    doc_chars_in: list[int] = field(default_factory=list)


def text_hash(text: str) -> bytes:
    """The exact-duplicate key: 16-byte blake2b of the normalised text."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def clean_part(files: list[InputFile], spec: DataSpec) -> PartResult:
    """Read and clean every document of `files`; see the module doc."""
    out = PartResult()
    for file in files:
        source = spec.sources[file.source]
        for doc_id, raw in iter_file_documents(source, file, out.counts):
            out.counts["documents_read"] += 1
            out.counts["chars_read"] += len(raw)
            text = normalize_text(raw, spec.normalize)
            failed = check_document(text, spec.filters)
            if failed is not None:
                reason, value = failed
                out.removed[reason] += 1
                samples = out.samples.setdefault(reason, [])
                if len(samples) < spec.filters.samples_per_reason:
                    samples.append({"id": doc_id, "value": round(value, 4), "text": text[:SAMPLE_CHARS]})
                continue
            text = scrub_pii(text, spec.pii, out.pii)
            out.ids.append(doc_id)
            out.texts.append(text)
            out.exact.append(text_hash(text))
    if spec.dedup.near:
        out.signatures = minhash.signatures(out.texts, spec.dedup.num_perm, spec.dedup.ngram, spec.dedup.seed)
    return out
