"""Token shards: fixed-size files of token ids with a header, each with a file of document offsets
beside it, and an index that lists them.

Shard file `<split>_NNNNN.bin`: a 32-byte header then `count` little-endian token ids.
    magic  8 bytes  b"RYTOKENS"
    version u32     1
    itemsize u32    2 (uint16) or 4 (uint32)
    count  u64      number of tokens
    reserved u64    0
Document offsets `<split>_NNNNN.docs`: the same header with magic b"RYDOCOFF" and itemsize 4 (8 for
shards of 2^32 tokens or more), then the offsets (within the shard) at which documents start, so
document boundaries survive sharding.
The index (JSON) holds per shard its file name, token count and sha256, and its offsets file's name,
document count and sha256: its size grows with the number of shards, never with the number of
documents. uint16 is used whenever the vocabulary fits in it. Every file is written to a temporary
name, fsynced and renamed, so a crash leaves either the old file or the complete new one, never half a
shard under the real name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from runyard.errors import DataError
from runyard.system.diskspace import writing
from runyard.system.files import atomic_write_bytes, atomic_write_json, fsync_dir, sha256_file

MAGIC = b"RYTOKENS"
DOCS_MAGIC = b"RYDOCOFF"
DOCS_SUFFIX = ".docs"
VERSION = 1
INDEX_VERSION = 2  # 2: document offsets in a file beside each shard, no longer in the index
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
    shorter), each with its document-offsets file. Call `add_tokens` with blocks of whole documents
    (tokens including each document's end-of-document token), then `finish()` to flush the last shard
    and get the index's shard entries. Tokens go straight to the shard's temporary file: the writer
    holds one block and the current shard's document offsets, whatever `shard_tokens` is."""

    def __init__(self, directory: Path, prefix: str, shard_tokens: int, dtype: np.dtype):
        self.directory, self.prefix, self.shard_tokens, self.dtype = Path(directory), prefix, shard_tokens, dtype
        self.offsets_dtype = np.dtype("<u4") if shard_tokens < 1 << 32 else np.dtype("<u8")
        self.entries: list[dict[str, Any]] = []
        self._file = None
        self._tmp: Path | None = None
        self._hash = None
        self._fill = 0
        self._doc_starts: list[np.ndarray] = []
        self.total_tokens = 0
        self.num_documents = 0

    def _name(self) -> str:
        return f"{self.prefix}_{len(self.entries):05d}.bin"

    def _open(self) -> None:
        path = self.directory / self._name()
        self._tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in _flush, or by abort()
        # Every shard but the last holds exactly shard_tokens: hash as we go, assuming so.
        header = HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.shard_tokens, 0)
        self._hash = hashlib.sha256(header)
        self._file.write(header)

    def add_tokens(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Append a block of whole documents: `tokens` is their concatenation, `doc_lengths` their sizes."""
        doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]).astype(np.int64) + self.total_tokens
        self.num_documents += len(doc_lengths)
        pos = 0
        start_i = 0
        while pos < len(tokens):
            if self._file is None:
                self._open()
            take = min(self.shard_tokens - self._fill, len(tokens) - pos)
            shard_begin = self.total_tokens - self._fill  # global offset of this shard's first token
            hi = int(np.searchsorted(starts, self.total_tokens + take, side="left"))
            self._doc_starts.append(starts[start_i:hi] - shard_begin)
            start_i = hi
            body = np.ascontiguousarray(tokens[pos : pos + take], dtype=self.dtype.newbyteorder("<")).tobytes()
            with writing(f"token shard {self._name()}", self.directory, needed=len(body)):
                self._file.write(body)
            self._hash.update(body)
            self._fill += take
            self.total_tokens += take
            pos += take
            if self._fill == self.shard_tokens:
                self._flush()

    def _flush(self) -> None:
        if self._file is None:
            self._open()
        name = self._name()
        path = self.directory / name
        with writing(f"token shard {name}", self.directory):
            if self._fill != self.shard_tokens:  # the last, shorter shard: its header says so
                self._file.seek(0)
                self._file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self._fill, 0))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            sha = sha256_file(self._tmp) if self._fill != self.shard_tokens else self._hash.hexdigest()
            os.replace(self._tmp, path)
            fsync_dir(self.directory)
        starts = np.concatenate(self._doc_starts) if self._doc_starts else np.zeros(0, np.int64)
        docs_name = name.removesuffix(".bin") + DOCS_SUFFIX
        docs_sha = write_doc_offsets(self.directory / docs_name, starts, self.offsets_dtype)
        self.entries.append(
            {"file": name, "tokens": self._fill, "sha256": sha,
             "docs_file": docs_name, "documents": len(starts), "docs_sha256": docs_sha}
        )
        self._fill = 0
        self._doc_starts = []

    def finish(self) -> list[dict[str, Any]]:
        if self._fill or not self.entries:
            self._flush()
        return self.entries

    def abort(self) -> None:
        """Close and remove the shard being written (after an error)."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # a full disk fails the flush in close(): the file goes anyway
                self._file.close()
            self._file = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)


def write_doc_offsets(path: Path, starts: np.ndarray, dtype: np.dtype) -> str:
    """Write a shard's document offsets file atomically; returns its sha256."""
    body = np.ascontiguousarray(starts, dtype=dtype).tobytes()
    data = HEADER.pack(DOCS_MAGIC, VERSION, dtype.itemsize, len(starts), 0) + body
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def read_doc_offsets(path: Path) -> np.ndarray:
    """A shard's document offsets (int64): where, within the shard, each document starting in it starts."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read document offsets {path}: {exc.strerror}") from None
    if len(data) < HEADER.size:
        raise ShardCorrupt(f"document offsets {path} are truncated ({len(data)} bytes)")
    magic, version, itemsize, count, _ = HEADER.unpack(data[: HEADER.size])
    if magic != DOCS_MAGIC or version != VERSION or itemsize not in (4, 8):
        raise ShardCorrupt(f"document offsets {path} have a bad header (magic {magic!r}, version {version})")
    if len(data) != HEADER.size + count * itemsize:
        raise ShardCorrupt(f"document offsets {path} hold {len(data)} bytes but the header says {count} offsets")
    return np.frombuffer(data, dtype="<u4" if itemsize == 4 else "<u8", offset=HEADER.size).astype(np.int64)


def shard_doc_starts(index_path: Path, entry: dict[str, Any]) -> np.ndarray | None:
    """The document offsets of one shard of an index: from its offsets file, or inline in an index
    written before they moved out of it (pipeline version 1); None when it records none."""
    if "docs_file" in entry:
        return read_doc_offsets(Path(index_path).parent / entry["docs_file"])
    if "doc_starts" in entry:
        return np.asarray(entry["doc_starts"], dtype=np.int64)
    return None


def document_lengths(index_path: Path) -> np.ndarray:
    """Every document's length in tokens (its end-of-document token included), in the split's order,
    from the index's shards and their offsets files."""
    index = load_index(index_path)
    starts, base = [], 0
    for entry in index["shards"]:
        local = shard_doc_starts(index_path, entry)
        if local is None:
            raise DataError(f"{index_path} records no document offsets for {entry['file']}")
        starts.append(local + base)
        base += int(entry["tokens"])
    flat = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    return np.diff(np.append(flat, base)).astype(np.int64)


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
        "version": INDEX_VERSION,
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
        if "docs_file" in entry:
            verify_shard(Path(index_path).parent / entry["docs_file"], entry["docs_sha256"])
