"""The disk a data preparation fills at its peak, estimated from the input files before any work: the
cleaned parts (text, per-document records, ids, MinHash signatures), the near-duplicate search's sorted
runs (LSH band records, merged once more while being sorted), the token shards, and the tokenized chunks
that sit beside the shards until they are assembled. `check_cache_space` refuses a preparation that
will not fit.

The estimate errs high: a preparation refused with room to spare costs a retry; one that fills the disk
half-way costs the work (and is then a clear error, nothing half-written reading as good).
"""

from __future__ import annotations

from pathlib import Path

from runyard.data.dedup import optimal_bands
from runyard.data.shards import dtype_for_vocab
from runyard.data.sources import InputFile
from runyard.spec.data import DataSpec
from runyard.system.diskspace import DiskNeed, check_disk

COMPRESSION_RATIO = 4  # text in a .gz/.zst file is taken to be this many times its size
DOC_BYTES_RECORD = 500  # an average record's text, to count the documents of JSONL and Parquet sources
MIN_BYTES_PER_TOKEN = 2.0  # a trained byte-level BPE packs at least this much text per token
TOKENIZER_BYTES_PER_TOKEN = 80  # tokenizer.json: vocabulary and merges


def _text_bytes(spec: DataSpec, files: list[InputFile]) -> int:
    total = 0
    for f in files:
        source = spec.sources[f.source]
        compressed = source.compression in ("gzip", "zstd") or (
            source.compression == "infer" and f.path.endswith((".gz", ".zst", ".zstd"))
        )
        total += f.size * (COMPRESSION_RATIO if compressed else 1)
    return total


def _documents(spec: DataSpec, files: list[InputFile]) -> int:
    return sum(1 if spec.sources[f.source].format == "text" else max(1, f.size // DOC_BYTES_RECORD) for f in files)


def data_cache_bytes(spec: DataSpec, files: list[InputFile]) -> int:
    """Bytes the data cache needs, at its peak, to prepare `files` under `spec`."""
    text = _text_bytes(spec, files)
    docs = _documents(spec, files)
    per_doc = 32 + 64 + 8  # offsets, characters and hash; id; its flags
    if spec.dedup.near:
        bands, rows = (
            (spec.dedup.bands, spec.dedup.num_perm // spec.dedup.bands) if spec.dedup.bands
            else optimal_bands(spec.dedup.threshold, spec.dedup.num_perm)
        )
        per_doc += 4 * spec.dedup.num_perm + 2 * bands * (2 + 4 * rows + 8)  # signature; LSH runs, twice
    cleaned = text + docs * per_doc
    vocab = spec.tokenizer.vocab_size if spec.tokenizer.path is None else 1 << 17  # loaded: assume wide ids
    tokens = int(text / MIN_BYTES_PER_TOKEN) * dtype_for_vocab(vocab).itemsize + docs * 8
    return cleaned + 2 * tokens + vocab * TOKENIZER_BYTES_PER_TOKEN


def data_need(spec: DataSpec, files: list[InputFile], cache_root: Path) -> DiskNeed:
    return DiskNeed("the data cache", cache_root, data_cache_bytes(spec, files))


def check_cache_space(spec: DataSpec, files: list[InputFile], cache_root: Path) -> None:
    """Refuse, with the figures, a data preparation that will not fit in the cache."""
    check_disk(
        [data_need(spec, files, cache_root)],
        hint="free some space, or point data.cache_dir (or $RUNYARD_CACHE_DIR) at a larger disk",
    )
