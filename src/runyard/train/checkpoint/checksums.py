"""File checksums for checkpoint manifests, computed while a file is written or read back from disk.

The manifest's checksum guards against torn writes and flipped bits, so it needs to be fast, not
cryptographic (an unsigned manifest is no defence against someone who can rewrite it anyway): xxh3-128
hashes at memory speed. Manifests written with sha256 (checkpoint format 1) still verify.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from pathlib import Path
from typing import Any

import xxhash

from runyard.system.files import fsync_file

CHECKSUM = "xxh3_128"
HASHERS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}

# A manifest entry: {"xxh3_128": hex digest, "bytes": size}.
FileEntry = dict[str, Any]


def new_hasher():
    return HASHERS[CHECKSUM]()


def entry(hasher, nbytes: int) -> FileEntry:
    return {CHECKSUM: hasher.hexdigest(), "bytes": nbytes}


def file_checksum(path: Path, algorithm: str = CHECKSUM, chunk: int = 8 << 20) -> str:
    """The checksum of a file as it is on disk (read back in chunks)."""
    h = HASHERS[algorithm]()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def durable_entry(path: Path) -> FileEntry:
    """fsync a file written by someone else and describe it for the manifest by reading it back."""
    fsync_file(path)
    return {CHECKSUM: file_checksum(path), "bytes": os.path.getsize(path)}


class BackgroundHasher:
    """A hasher fed from one thread and run on another: `update` queues a slice (which must not change
    until `hexdigest`), a worker hashes the slices in order while the caller reads the next ones, so a
    verified read costs the longer of the read and the hash, not their sum. Both release the GIL.
    `hexdigest` waits for the queue to drain; `close` stops the worker without a digest."""

    def __init__(self, hasher):
        self._hasher = hasher
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="runyard-ckpt-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (piece := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._hasher.update(piece)
                except BaseException as exc:  # handed to the caller by hexdigest
                    self._error = exc

    def update(self, piece) -> None:
        self._queue.put(piece)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def hexdigest(self) -> str:
        self.close()
        if self._error is not None:
            raise self._error
        return self._hasher.hexdigest()


# Hash and write in slices that stay in the CPU cache: the write then copies from cache what the hash
# just read, instead of reading a large tensor from memory twice.
_SLICE = 4 << 20


class HashingFile:
    """A file opened for writing that checksums every byte on its way out, so a manifest entry needs
    no second pass over the data. `close()` fsyncs it (once) and returns its manifest entry."""

    def __init__(self, path: Path):
        self.path = path
        # Buffered: a large write goes straight through, and is written in full. Closed by close()/abort().
        self._file = open(path, "wb")  # noqa: SIM115
        self._hasher = new_hasher()
        self.nbytes = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, _SLICE):
            piece = view[start : start + _SLICE]
            self._hasher.update(piece)
            self._file.write(piece)
        self.nbytes += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.nbytes

    def close(self) -> FileEntry:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return entry(self._hasher, self.nbytes)

    def abort(self) -> None:
        self._file.close()

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
