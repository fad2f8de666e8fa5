"""The per-part cleaning step: read -> normalise -> filter -> scrub PII -> hash -> MinHash.

`clean_part` is a pure function of (its files' bytes, the data spec): it runs in a worker process, and
the same call could run as one task of a Slurm array (`part = SLURM_ARRAY_TASK_ID`) or a Ray task, its
result written next to the others; nothing in it depends on other parts. Results are cached under
`<cache>/steps/clean/<part_key>.npz` (`save_part` / `load_part`), so a dataset that differs only in later
settings (tokenizer, split, dedup threshold) reuses them. The global steps after it
(deduplication, split) only need the small per-document hashes and signatures it returns.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runyard.data import minhash
from runyard.data.config import DataSpec
from runyard.data.filters import check_document
from runyard.data.normalize import normalize_text
from runyard.data.pii import scrub_pii
from runyard.data.sources import InputFile, iter_file_documents
from runyard.fsutil import atomic_write_bytes

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
    pii_samples: dict[str, list[dict]] = field(default_factory=dict)


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
                out.removed[failed.reason] += 1
                samples = out.samples.setdefault(failed.reason, [])
                if len(samples) < spec.filters.samples_per_reason:
                    samples.append(failed.sample(doc_id, text[:SAMPLE_CHARS]))
                continue
            text = scrub_pii(text, spec.pii, out.pii, out.pii_samples)
            out.ids.append(doc_id)
            out.texts.append(text)
            out.exact.append(text_hash(text))
    if spec.dedup.near:
        out.signatures = minhash.signatures(out.texts, spec.dedup.num_perm, spec.dedup.ngram, spec.dedup.seed)
    return out


def part_key(files: list[InputFile], file_hashes: dict[str, str], spec: DataSpec, version: int) -> str:
    """Fingerprint of one part's cleaning: its files' bytes and every setting clean_part reads."""
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
        "files": [[f.source, f.path, file_hashes[f.path]] for f in files],
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _json_bytes(obj) -> np.ndarray:
    return np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)


def save_part(path: Path, part: PartResult) -> None:
    """Store a PartResult as one .npz (no pickle), atomically."""
    encoded = [t.encode("utf-8") for t in part.texts]
    arrays = {
        "text": np.frombuffer(b"".join(encoded), dtype=np.uint8),
        "offsets": np.cumsum([0] + [len(e) for e in encoded]).astype(np.int64),
        "exact": np.frombuffer(b"".join(part.exact), dtype=np.uint8).reshape(-1, 16),
        "meta": _json_bytes(
            {
                "ids": part.ids,
                "counts": part.counts,
                "removed": part.removed,
                "pii": part.pii,
                "samples": part.samples,
                "pii_samples": part.pii_samples,
            }
        ),
    }
    if part.signatures is not None:
        arrays["signatures"] = part.signatures
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def load_part(path: Path) -> PartResult:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(z["meta"].tobytes())
        text, offsets = z["text"].tobytes(), z["offsets"]
        texts = [text[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(len(offsets) - 1)]
        exact = [bytes(row) for row in z["exact"]]
        sigs = z["signatures"] if "signatures" in z.files else None
    return PartResult(
        ids=meta["ids"],
        texts=texts,
        exact=exact,
        signatures=sigs,
        counts=Counter(meta["counts"]),
        removed=Counter(meta["removed"]),
        pii=Counter(meta["pii"]),
        samples=meta["samples"],
        pii_samples=meta.get("pii_samples", {}),
    )
