"""Tokenize a split in fixed chunks and assemble its shards.

Chunk k of a split is a pure function of (its documents, the tokenizer): `encode_batch` (parallel
inside `tokenizers`) plus an end-of-document token after each document, saved atomically as
`<split>_<first doc>_<end doc>.npz`. A rerun after an interruption reuses every finished chunk, so the work resumes where
it stopped; on a cluster each chunk could be one array task. Assembly then streams the chunks, in
order, through a ShardWriter: fixed-size shards, each written atomically, then the index last, so a
split is complete exactly when its index exists.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from runyard.data.shards import ShardWriter, dtype_for_vocab, write_index
from runyard.fsutil import atomic_write_bytes

CHUNK_BYTES = 1 << 22  # ~4 MB of text per chunk: big enough for encode_batch to use every core


def chunk_ranges(texts: list[str], chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """[start, end) document ranges of about chunk_bytes characters each; depends only on the texts."""
    ranges, start, size = [], 0, 0
    for i, text in enumerate(texts):
        size += len(text)
        if size >= chunk_bytes:
            ranges.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(texts):
        ranges.append((start, len(texts)))
    return ranges


def encode_documents(
    tok: Tokenizer, texts: list[str], eos: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of all documents, each followed by eos; per-document lengths including eos)."""
    encodings = tok.encode_batch_fast(texts) if hasattr(tok, "encode_batch_fast") else tok.encode_batch(texts)
    lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for e, n in zip(encodings, lengths, strict=True):
        tokens[pos : pos + n - 1] = e.ids
        tokens[pos + n - 1] = eos
        pos += n
    return tokens, lengths


def tokenize_chunks(
    tok: Tokenizer,
    texts: list[str],
    eos: int,
    work_dir: Path,
    split: str,
    chunk_bytes: int = CHUNK_BYTES,
    on_chunk: Callable[[int], None] | None = None,
) -> list[Path]:
    """Encode `texts` chunk by chunk into work_dir, skipping chunks already there; returns the chunk files.
    Two chunks are in flight at once (encode_batch releases the GIL), so the tail of one chunk, where
    a few long documents leave cores idle, overlaps the start of the next."""
    dtype = dtype_for_vocab(tok.get_vocab_size())

    def one(lo: int, hi: int) -> Path:
        # Named by document range, so a resume with another chunk size never reuses a wrong chunk.
        path = work_dir / f"{split}_{lo:09d}_{hi:09d}.npz"
        if not path.exists():
            tokens, lengths = encode_documents(tok, texts[lo:hi], eos, dtype)
            buf = io.BytesIO()
            np.savez(buf, tokens=tokens, lengths=lengths)
            atomic_write_bytes(path, buf.getvalue())
        return path

    paths = []
    with ThreadPoolExecutor(2, thread_name_prefix="runyard-tokenize") as pool:
        ranges = chunk_ranges(texts, chunk_bytes)
        for (lo, hi), path in zip(ranges, pool.map(lambda r: one(*r), ranges), strict=True):
            paths.append(path)
            if on_chunk:
                on_chunk(sum(len(t) for t in texts[lo:hi]))
    return paths


def assemble_shards(
    chunks: list[Path], out_dir: Path, split: str, *, shard_tokens: int, vocab_size: int, eos: int
) -> dict:
    """Write the split's shards and index from its chunk files; returns totals for the report."""
    dtype = dtype_for_vocab(vocab_size)
    writer = ShardWriter(out_dir, split, shard_tokens, dtype)
    for path in chunks:
        with np.load(path, allow_pickle=False) as z:
            writer.add_tokens(z["tokens"], z["lengths"])
    entries = writer.finish()
    write_index(
        out_dir / f"{split}.json",
        entries,
        dtype=dtype,
        vocab_size=vocab_size,
        eos_id=eos,
        shard_tokens=shard_tokens,
        num_documents=writer.num_documents,
    )
    return {"tokens": writer.total_tokens, "documents": writer.num_documents, "shards": len(entries)}


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
