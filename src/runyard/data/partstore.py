"""A cleaned part on disk: written document by document, read back in blocks, never held whole.

A part is a directory, committed by renaming its temporary directory into place once every file is
complete and fsynced, so a part directory that exists is whole:

    meta.json     counters, removal and PII samples, the files read (path, identity, sha256), n_docs
    text.bin      the documents' normalised UTF-8 text, concatenated
    docs.bin      per document 32 bytes: its end offset in text.bin (u64), its length in characters
                  (u64) and its 16-byte exact-duplicate hash
    sigs.u32      each document's MinHash signature (num_perm little-endian uint32), if near dedup is on
    ids.jsonl     each document's id (its path, `path#L<line>` or `path#<row>`), one JSON string a line

Readers take blocks by document range with plain reads (no memory maps), so what a step holds is what
it asked for.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from runyard.system.diskspace import writing
from runyard.system.files import fsync_dir

_FILES = ("text.bin", "docs.bin", "sigs.u32", "ids.jsonl")
DOC = np.dtype([("end", "<u8"), ("chars", "<u8"), ("exact", "u1", (16,))])


def temp_name(name: str) -> str:
    """`.NAME.tmp-HOST-PID`: whose an unfinished write is, so a later run on this host can tell it is stale."""
    return f".{name}.tmp-{socket.gethostname()}-{os.getpid()}"


class PartWriter:
    """Append documents to a new part; `commit()` makes it visible at `path`, `abort()` removes it."""

    def __init__(self, path: Path, num_perm: int):
        self.path, self.num_perm = Path(path), num_perm
        self.tmp = self.path.with_name(temp_name(self.path.name))
        self.tmp.mkdir(parents=True)
        self._files = {name: open(self.tmp / name, "wb") for name in _FILES}  # noqa: SIM115
        self.n_docs = 0
        self.text_bytes = 0

    def add(self, ids: list[str], texts: list[bytes], chars: np.ndarray, exact: list[bytes],
            signatures: np.ndarray | None) -> None:
        """Append a batch of documents (UTF-8 text, character counts, exact hashes, signatures)."""
        with writing(f"cleaned part {self.path.name}", self.path.parent):
            sizes = np.fromiter((len(t) for t in texts), dtype=np.uint64, count=len(texts))
            ends = np.cumsum(sizes, dtype=np.uint64) + np.uint64(self.text_bytes)
            docs = np.zeros(len(texts), dtype=DOC)
            docs["end"], docs["chars"] = ends, chars
            docs["exact"] = np.frombuffer(b"".join(exact), dtype=np.uint8).reshape(-1, 16)
            self._files["text.bin"].write(b"".join(texts))
            self._files["docs.bin"].write(docs.tobytes())
            if signatures is not None:
                self._files["sigs.u32"].write(np.ascontiguousarray(signatures, dtype="<u4").tobytes())
            self._files["ids.jsonl"].write("".join(json.dumps(i) + "\n" for i in ids).encode())
            self.n_docs += len(texts)
            self.text_bytes = int(ends[-1]) if len(texts) else self.text_bytes

    def commit(self, meta: dict[str, Any]) -> None:
        """Flush, fsync and rename into place. If another writer committed the same part first (same key,
        so the same content), theirs is kept."""
        with writing(f"cleaned part {self.path.name}", self.path.parent):
            for f in self._files.values():
                f.flush()
                os.fsync(f.fileno())
                f.close()
            meta = {**meta, "n_docs": self.n_docs, "text_bytes": self.text_bytes, "num_perm": self.num_perm}
            with open(self.tmp / "meta.json", "w") as f:
                json.dump(meta, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.tmp)
        try:
            os.rename(self.tmp, self.path)
        except OSError:
            if not (self.path / "meta.json").exists():
                raise
            self.abort()
            return
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Remove the unfinished part (after an error; a full disk may fail even the close)."""
        for f in self._files.values():
            with contextlib.suppress(OSError):
                f.close()
        for child in self.tmp.iterdir() if self.tmp.exists() else ():
            child.unlink()
        if self.tmp.exists():
            self.tmp.rmdir()


def is_complete(path: Path) -> bool:
    return (Path(path) / "meta.json").is_file()


class PartReader:
    """Read a committed part in blocks."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta: dict[str, Any] = json.loads((self.path / "meta.json").read_text())
        self.n_docs: int = self.meta["n_docs"]
        self.num_perm: int = self.meta["num_perm"]

    def _read(self, name: str, dtype, start: int, count: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        with open(self.path / name, "rb") as f:
            f.seek(start * dtype.itemsize)
            data = f.read(count * dtype.itemsize)
        return np.frombuffer(data, dtype=dtype)

    def docs(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The per-document records (end offset, characters, exact hash) of documents lo..hi."""
        hi = self.n_docs if hi is None else hi
        return self._read("docs.bin", DOC, lo, hi - lo)

    def offsets(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Byte offsets of documents lo..hi (hi - lo + 1 values: each document's start, and the last one's end)."""
        hi = self.n_docs if hi is None else hi
        first = 0 if lo == 0 else int(self.docs(lo - 1, lo)["end"][0])
        return np.concatenate([[first], self.docs(lo, hi)["end"].astype(np.int64)])

    def nbytes(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        return np.diff(self.offsets(lo, hi))

    def chars(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        return self.docs(lo, hi)["chars"].astype(np.int64)

    def exact(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """[hi - lo, 16] uint8 exact-duplicate hashes."""
        return np.ascontiguousarray(self.docs(lo, hi)["exact"])

    def signatures(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        hi = self.n_docs if hi is None else hi
        row = np.dtype(("<u4", (self.num_perm,)))
        return self._read("sigs.u32", row, lo, hi - lo).reshape(hi - lo, self.num_perm)

    def signature_rows(self, rows: np.ndarray) -> np.ndarray:
        """Signatures of the given documents (any order), gathered through a map dropped at once."""
        if len(rows) == 0:
            return np.zeros((0, self.num_perm), dtype=np.uint32)
        mapped = np.memmap(self.path / "sigs.u32", dtype="<u4", mode="r", shape=(self.n_docs, self.num_perm))
        try:
            return np.array(mapped[np.asarray(rows, dtype=np.int64)])
        finally:
            del mapped

    def texts(self, lo: int, hi: int) -> list[str]:
        """The texts of documents lo..hi."""
        offs = self.offsets(lo, hi)
        with open(self.path / "text.bin", "rb") as f:
            f.seek(int(offs[0]))
            blob = f.read(int(offs[-1] - offs[0]))
        base = int(offs[0])
        return [blob[a - base : b - base].decode("utf-8") for a, b in zip(offs[:-1].tolist(), offs[1:].tolist(), strict=True)]

    def text_blocks(self, block_bytes: int) -> Iterator[tuple[int, list[str]]]:
        """(first document, texts) in blocks of about `block_bytes` of text (a larger document alone)."""
        for lo, hi in self.block_ranges(block_bytes):
            yield lo, self.texts(lo, hi)

    def block_ranges(self, block_bytes: int, docs_per_read: int = 1 << 20) -> list[tuple[int, int]]:
        """Document ranges of about `block_bytes` of text each (a larger document alone)."""
        ranges, lo, base = [], 0, 0
        for first in range(0, self.n_docs, docs_per_read):
            ends = self.docs(first, min(self.n_docs, first + docs_per_read))["end"].astype(np.int64)
            while lo < first + len(ends):
                hi = first + int(np.searchsorted(ends, base + block_bytes, side="right"))
                hi = min(max(hi, lo + 1), first + len(ends))
                ranges.append((lo, hi))
                base = int(ends[hi - 1 - first])
                lo = hi
        return ranges

    def ids(self) -> Iterator[str]:
        with open(self.path / "ids.jsonl", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)

    def ids_at(self, wanted: set[int]) -> dict[int, str]:
        """The ids of the given documents (local numbers), read in one pass."""
        out = {}
        if not wanted:
            return out
        last = max(wanted)
        for i, doc_id in enumerate(self.ids()):
            if i in wanted:
                out[i] = doc_id
            if i >= last:
                break
        return out
