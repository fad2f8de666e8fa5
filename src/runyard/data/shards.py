"""Token shards: fixed-size files of token ids with a header, and an index that lists them.

Shard file: a 32-byte header then `count` little-endian token ids.
    magic  8 bytes  b"RYTOKENS"
    version u32     1
    itemsize u32    2 (uint16) or 4 (uint32)
    count  u64      number of tokens
    reserved u64    0
The index (JSON) holds per shard its file name, token count, sha256 of the whole file, and the offsets
(within the shard) at which documents start, so document boundaries survive sharding. uint16 is used
whenever the vocabulary fits in it. Every file is written to a temporary name, fsynced and renamed, so
a crash leaves either the old file or the complete new one, never half a shard under the real name.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from runyard.errors import DataError
from runyard.fsutil import atomic_write_bytes, atomic_write_json, sha256_file

MAGIC = b"RYTOKENS"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")
INDEX_FORMAT = "runyard-token-shards"


class ShardCorrupt(DataError):
    """A shard's bytes do not match its header or the checksum in its index."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def write_shard(path: Path, tokens: np.ndarray, dtype: np.dtype) -> str:
    """Write one shard atomically; returns the sha256 of the file."""
    body = np.ascontiguousarray(tokens, dtype=dtype.newbyteorder("<")).tobytes()
    data = HEADER.pack(MAGIC, VERSION, dtype.itemsize, len(tokens), 0) + body
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def open_shard(path: Path) -> np.ndarray:
    """Memory-map a shard's tokens after checking its header against the file size."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
        size = os.path.getsize(path)
    except OSError as exc:
        raise DataError(f"cannot read shard {path}: {exc.strerror}") from None
    if len(head) < HEADER.size:
        raise ShardCorrupt(f"shard {path} is truncated ({size} bytes, shorter than its header)")
    magic, version, itemsize, count, _ = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION or itemsize not in (2, 4):
        raise ShardCorrupt(f"shard {path} has a bad header (magic {magic!r}, version {version})")
    if size != HEADER.size + count * itemsize:
        raise ShardCorrupt(
            f"shard {path} holds {size} bytes but its header says {count} tokens of {itemsize}"
        )
    dtype = np.dtype("<u2" if itemsize == 2 else "<u4")
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER.size, shape=(count,))


def verify_shard(path: Path, expected_sha256: str) -> None:
    """Raise ShardCorrupt unless the file's sha256 is the expected one."""
    actual = sha256_file(path)
    if actual != expected_sha256:
        raise ShardCorrupt(
            f"shard {path} fails its checksum: sha256 {actual[:16]}..., index says {expected_sha256[:16]}..."
        )


class ShardWriter:
    """Cut a stream of documents' tokens into shards of exactly `shard_tokens` tokens (the last one
    shorter). Call `add_document` for each document (tokens including its end-of-document token),
    then `finish()` to flush the last shard and get the index's shard entries."""

    def __init__(self, directory: Path, prefix: str, shard_tokens: int, dtype: np.dtype):
        self.directory, self.prefix, self.shard_tokens, self.dtype = directory, prefix, shard_tokens, dtype
        self.entries: list[dict[str, Any]] = []
        self._buf = np.empty(shard_tokens, dtype=dtype)
        self._fill = 0
        self._doc_starts: list[int] = []
        self.total_tokens = 0
        self.num_documents = 0

    def add_tokens(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Append a block of whole documents: `tokens` is their concatenation, `doc_lengths` their sizes."""
        starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]) + self.total_tokens
        self.num_documents += len(doc_lengths)
        pos = 0
        start_i = 0
        while pos < len(tokens):
            take = min(self.shard_tokens - self._fill, len(tokens) - pos)
            shard_begin = self.total_tokens - self._fill  # global offset of this shard's first token
            hi = np.searchsorted(starts, self.total_tokens + take, side="left")
            self._doc_starts.extend(int(s - shard_begin) for s in starts[start_i:hi])
            start_i = hi
            self._buf[self._fill : self._fill + take] = tokens[pos : pos + take]
            self._fill += take
            self.total_tokens += take
            pos += take
            if self._fill == self.shard_tokens:
                self._flush()

    def _flush(self) -> None:
        name = f"{self.prefix}_{len(self.entries):05d}.bin"
        sha = write_shard(self.directory / name, self._buf[: self._fill], self.dtype)
        self.entries.append(
            {"file": name, "tokens": self._fill, "sha256": sha, "doc_starts": self._doc_starts}
        )
        self._fill = 0
        self._doc_starts = []

    def finish(self) -> list[dict[str, Any]]:
        if self._fill or not self.entries:
            self._flush()
        return self.entries


def write_index(
    path: Path,
    shards: list[dict[str, Any]],
    *,
    dtype: np.dtype,
    vocab_size: int,
    eos_id: int,
    shard_tokens: int,
    num_documents: int,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write a split's shard index atomically; its presence marks the split as complete."""
    index = {
        "format": INDEX_FORMAT,
        "version": VERSION,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "shard_tokens": shard_tokens,
        "total_tokens": int(sum(s["tokens"] for s in shards)),
        "num_documents": num_documents,
        "shards": shards,
        **(extra or {}),
    }
    atomic_write_json(path, index)


def load_index(path: Path) -> dict[str, Any]:
    """Read and sanity-check a shard index."""
    try:
        index = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read shard index {path}: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise DataError(f"{path} is not a runyard shard index")
    return index


def verify_index(index_path: Path) -> None:
    """Check every shard of an index against its sha256; raises ShardCorrupt naming the first bad one."""
    index = load_index(index_path)
    for entry in index["shards"]:
        verify_shard(Path(index_path).parent / entry["file"], entry["sha256"])
