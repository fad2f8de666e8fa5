"""The checksums of checkpoint manifests, and the file that computes one while it is written.

The manifest's checksum guards against torn writes and flipped bits, so it needs to be fast, not
cryptographic (an unsigned manifest is no defence against someone who can rewrite it anyway). Since
checkpoint format 3 it is a tree of xxh3-128 hashes: the xxh3-128 of the 16-byte xxh3-128 digests of the
file's 64 MiB pieces, in order. A writer computes it in one pass; a reader hashes the pieces apart, each on
its own thread while it reads it (parallel_read.py), so a verified load goes at the speed of parallel reads.
Entries written with a whole-file xxh3-128 (format 2) or sha256 (format 1) still verify, in one pass.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import xxhash

from runyard.errors import CheckpointCorrupt

CHECKSUM = "xxh3_128_tree_64MiB"

# The algorithms whose pieces of this many bytes a reader may hash apart (combine gives the checksum).
PIECEWISE = {CHECKSUM: 64 << 20}

# A manifest entry: {CHECKSUM: hex digest, "bytes": size}.
FileEntry = dict[str, Any]


def combine(piece_digests: list[bytes]) -> str:
    """The tree checksum of a file from its pieces' xxh3-128 digests, in file order."""
    return xxhash.xxh3_128(b"".join(piece_digests)).hexdigest()


class TreeHasher:
    """The tree checksum (CHECKSUM) fed with a file's bytes in order, as hashlib's hashers are fed."""

    def __init__(self):
        self._size = PIECEWISE[CHECKSUM]
        self._digests: list[bytes] = []
        self._piece = xxhash.xxh3_128()
        self._filled = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, self._size - self._filled)
            self._piece.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self._size:
                self._digests.append(self._piece.digest())
                self._piece, self._filled = xxhash.xxh3_128(), 0

    def hexdigest(self) -> str:
        return combine(self._digests + ([self._piece.digest()] if self._filled else []))


HASHERS = {CHECKSUM: TreeHasher, "xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def algorithm_of(entry: FileEntry, where: str) -> str:
    """The checksum algorithm a manifest entry records; CheckpointCorrupt naming `where` if none known."""
    algorithm = next((a for a in HASHERS if a in entry), None)
    if algorithm is None:
        raise CheckpointCorrupt(f"{where}: its manifest entry has no known checksum")
    return algorithm


def entry(hasher, nbytes: int) -> FileEntry:
    return {CHECKSUM: hasher.hexdigest(), "bytes": nbytes}


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
        self._hasher = TreeHasher()
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
