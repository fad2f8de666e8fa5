"""Reading a file into the memory its bytes belong in, on several threads, checked as it lands.

A read is a list of spans, each a file offset and the bytes it fills (a tensor's own memory), tiling the
file in order. The file is cut at the checksum's piece boundaries (checksums.PIECEWISE); each piece is read
on a pool thread with pread straight into its destinations, a slice at a time, and hashed while that
slice is still in the CPU cache. So checking costs no second pass over memory, and a load goes as fast
as the page cache or the disk serves several reads at once. A file whose manifest entry is a whole-file
hash (formats 1 and 2) is one piece, read and hashed in order on one thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import xxhash

from runyard.errors import CheckpointCorrupt
from runyard.train.checkpoint.checksums import CHECKSUM, HASHERS, PIECEWISE, combine

_SLICE = 1 << 20  # read, then hash, a slice that stays in the CPU cache between the two
_MAX_THREADS = 8


@dataclass(frozen=True)
class Span:
    offset: int  # in the file
    view: memoryview  # the bytes it fills (format "B")
    read: bool = True  # False: already in memory (a parsed header), only hashed


def threads() -> int:
    return max(1, min(_MAX_THREADS, len(os.sched_getaffinity(0))))


@contextmanager
def reading_pool() -> Iterator[ThreadPoolExecutor]:
    """The threads a load's pieces are read on (one per CPU this process may use, at most 8); leaving
    the block waits for every piece handed to it."""
    with ThreadPoolExecutor(max_workers=threads(), thread_name_prefix="runyard-ckpt-read") as pool:
        yield pool


class PendingRead:
    """The pieces of one file in flight. `result()` waits for them, closes the file and checks its
    checksum; `close()` only waits and closes (the way out when something else failed)."""

    def __init__(self, fd: int, path: Path, futures: list[Future], algorithm: str | None, expected: str | None):
        self._fd, self.path, self._futures = fd, path, futures
        self._algorithm, self._expected = algorithm, expected

    def close(self) -> None:
        wait(self._futures)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def result(self) -> None:
        self.close()
        hashers = [f.result() for f in self._futures]  # a short read raises its CheckpointCorrupt here
        if self._algorithm is not None and _digest(self._algorithm, hashers) != self._expected:
            raise CheckpointCorrupt(f"{self.path} fails its {self._algorithm} checksum")


def start(fd: int, path: Path, spans: list[Span], pool: ThreadPoolExecutor, algorithm: str | None = None,
          expected: str | None = None) -> PendingRead:
    """Read `spans` (tiling the file `fd` from offset 0) on `pool`'s threads, hashed with `algorithm`
    against the hex digest `expected` when given. The returned read owns `fd` and closes it; if this
    raises, `fd` is still the caller's, and nothing reads from it any more."""
    # Unchecked reads are cut as checked ones are; a whole-file hash (no piece size) reads as one piece.
    piece = PIECEWISE[CHECKSUM] if algorithm is None else PIECEWISE.get(algorithm)
    futures: list[Future] = []
    try:
        for part in _cut(spans, piece):
            futures.append(pool.submit(_read_piece, fd, path, part, _hasher_for(algorithm)))
    except BaseException:
        wait(futures)  # none may still be reading when the caller closes `fd`
        raise
    return PendingRead(fd, path, futures, algorithm, expected)


def _hasher_for(algorithm: str | None):
    if algorithm is None:
        return None
    return xxhash.xxh3_128() if algorithm in PIECEWISE else HASHERS[algorithm]()


def _cut(spans: list[Span], piece: int | None) -> list[list[Span]]:
    """The spans cut at every multiple of `piece` bytes, grouped by piece (None: one piece, the file)."""
    if piece is None:
        return [spans]
    parts: list[list[Span]] = []
    for span in spans:
        done = 0
        while done < span.view.nbytes:
            at = span.offset + done
            index = at // piece
            n = min(span.view.nbytes - done, (index + 1) * piece - at)
            while len(parts) <= index:
                parts.append([])
            parts[index].append(Span(at, span.view[done : done + n], span.read))
            done += n
    return parts


def _read_piece(fd: int, path: Path, spans: list[Span], hasher):
    for span in spans:
        for start in range(0, span.view.nbytes, _SLICE):
            part = span.view[start : start + _SLICE]
            if span.read:
                pread_exactly(fd, part, span.offset + start, path)
            if hasher is not None:
                hasher.update(part)
    return hasher


def pread_exactly(fd: int, into: memoryview, offset: int, path: Path | str) -> None:
    """Fill `into` with the file's bytes from `offset`; CheckpointCorrupt naming `path` if the file ends first."""
    got = 0
    while got < into.nbytes:
        n = os.preadv(fd, [into[got:]], offset + got)
        if not n:
            raise CheckpointCorrupt(f"{path} ends early: no bytes at offset {offset + got}")
        got += n


def file_checksum(path: Path, algorithm: str, pool: ThreadPoolExecutor | None = None) -> str:
    """The checksum of a file as it is on disk, its pieces hashed on `pool`'s threads when given."""
    size = os.path.getsize(path)
    piece = PIECEWISE.get(algorithm)
    bounds = [(lo, min(size, lo + piece)) for lo in range(0, size, piece)] if piece else [(0, size)]
    fd = os.open(path, os.O_RDONLY)
    try:
        if pool is None:
            hashers = [_hash_range(fd, path, lo, hi, _hasher_for(algorithm)) for lo, hi in bounds]
        else:
            futures = [pool.submit(_hash_range, fd, path, lo, hi, _hasher_for(algorithm)) for lo, hi in bounds]
            try:
                hashers = [f.result() for f in futures]
            finally:
                wait(futures)  # none may still be reading when `fd` is closed
    finally:
        os.close(fd)
    return _digest(algorithm, hashers)


def _digest(algorithm: str, hashers: list) -> str:
    """The file's hex checksum from its pieces' hashers (one, for a whole-file algorithm)."""
    return combine([h.digest() for h in hashers]) if algorithm in PIECEWISE else hashers[0].hexdigest()


def _hash_range(fd: int, path: Path, lo: int, hi: int, hasher):
    buf = memoryview(bytearray(min(_SLICE, max(hi - lo, 1))))
    for at in range(lo, hi, _SLICE):
        part = buf[: min(_SLICE, hi - at)]
        pread_exactly(fd, part, at, path)
        hasher.update(part)
    return hasher
