"""External sorting: fixed-size records spilled to disk in sorted runs, then merged in bounded blocks.

Records are rows of bytes compared as bytes (memcmp order): callers lay their fields out big-endian,
most significant first, so byte order is numeric order (a record `key | document number` sorts by key,
then by document). `SortedRuns.add` gathers records until `block_bytes`, sorts them in memory and writes
them as one run; `merged()` reads every run a window at a time and yields the records in global order,
in blocks: from each run's window it takes the records no greater than the smallest "last record" among
the windows of runs that still have unread records, so nothing later can sort before them. When there
are more runs than fit in memory at once, groups of them are first merged into longer runs.

Memory: `block_bytes` for the gathering buffer (and its sort), then at most `block_bytes` of windows and
one output block while merging, whatever the number of records.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from runyard.system.diskspace import writing

MIN_WINDOW_RECORDS = 256


def as_records(columns: list[np.ndarray]) -> np.ndarray:
    """Rows of bytes from columns of unsigned integers (each [n] or [n, k]), big-endian, in order."""
    parts = []
    for col in columns:
        col = np.asarray(col)
        big = col.astype(col.dtype.newbyteorder(">"), copy=False)
        width = big.dtype.itemsize * (int(np.prod(col.shape[1:])) if col.ndim > 1 else 1)
        parts.append(np.ascontiguousarray(big).view(np.uint8).reshape(len(col), width))
    rows = np.ascontiguousarray(np.concatenate(parts, axis=1))
    return rows.view(np.dtype((np.void, rows.shape[1]))).ravel()


def field(records: np.ndarray, offset: int, dtype: str, count: int = 1) -> np.ndarray:
    """A big-endian field of every record, back as native integers ([n] or [n, count])."""
    width = np.dtype(dtype).itemsize * count
    raw = records.view(np.uint8).reshape(len(records), records.dtype.itemsize)[:, offset : offset + width]
    values = np.ascontiguousarray(raw).view(np.dtype(dtype).newbyteorder(">"))
    values = values.astype(np.dtype(dtype), copy=False)
    return values.reshape(len(records), count) if count > 1 else values.ravel()


class SortedRuns:
    """Gather records of `record_bytes` bytes; spill them as sorted runs under `directory`."""

    def __init__(self, directory: Path, record_bytes: int, block_bytes: int, name: str = "run"):
        self.directory, self.record_bytes, self.name = Path(directory), record_bytes, name
        self.block_records = max(MIN_WINDOW_RECORDS, block_bytes // record_bytes)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pending: list[np.ndarray] = []
        self._pending_count = 0
        self.runs: list[tuple[Path, int]] = []
        self.total = 0

    def add(self, records: np.ndarray) -> None:
        if len(records) == 0:
            return
        if records.dtype.itemsize != self.record_bytes:
            raise ValueError(f"records of {records.dtype.itemsize} bytes, expected {self.record_bytes}")
        self._pending.append(records)
        self._pending_count += len(records)
        self.total += len(records)
        if self._pending_count >= self.block_records:
            self._spill()

    def _spill(self) -> None:
        if not self._pending:
            return
        block = np.sort(np.concatenate(self._pending))
        self._pending, self._pending_count = [], 0
        self._write_run(block)

    def _write_run(self, block: np.ndarray) -> None:
        path = self.directory / f"{self.name}-{len(self.runs):06d}.bin"
        with writing(f"a sorted run of {self.name}", path.parent, needed=block.nbytes), open(path, "wb") as f:
            f.write(block.tobytes())
        self.runs.append((path, len(block)))

    def merged(self) -> Iterator[np.ndarray]:
        """Every record added, in sorted order, in blocks (see the module doc)."""
        if not self.runs:  # everything still fits in memory: no disk
            if self._pending:
                yield np.sort(np.concatenate(self._pending))
            return
        self._spill()
        fan_in = max(2, self.block_records // MIN_WINDOW_RECORDS)
        generation = 0
        while len(self.runs) > fan_in:  # too many to hold a window of each at once: merge groups first
            groups = [self.runs[i : i + fan_in] for i in range(0, len(self.runs), fan_in)]
            merged_runs = []
            for g, group in enumerate(groups):
                path = self.directory / f"{self.name}-merge{generation}-{g:06d}.bin"
                with open(path, "wb") as f:
                    count = 0
                    for block in _merge(group, self.record_bytes, self.block_records):
                        with writing(f"a sorted run of {self.name}", path.parent, needed=block.nbytes):
                            f.write(block.tobytes())
                        count += len(block)
                for run, _ in group:
                    run.unlink()
                merged_runs.append((path, count))
            self.runs = merged_runs
            generation += 1
        yield from _merge(self.runs, self.record_bytes, self.block_records)

    def remove(self) -> None:
        """Delete the run files."""
        for path, _ in self.runs:
            path.unlink(missing_ok=True)
        self.runs = []
        self._pending = []


class _RunCursor:
    def __init__(self, path: Path, count: int, record_bytes: int, window: int):
        self.path, self.count, self.record_bytes, self.window = path, count, record_bytes, window
        self.read = 0  # records read from the file so far
        self.buffer = np.zeros(0, dtype=np.dtype((np.void, record_bytes)))

    @property
    def exhausted(self) -> bool:
        return self.read >= self.count

    def refill(self) -> None:
        if len(self.buffer) or self.exhausted:
            return
        n = min(self.window, self.count - self.read)
        with open(self.path, "rb") as f:
            f.seek(self.read * self.record_bytes)
            data = f.read(n * self.record_bytes)
        self.buffer = np.frombuffer(data, dtype=np.dtype((np.void, self.record_bytes))).copy()
        self.read += n


def _merge(runs: list[tuple[Path, int]], record_bytes: int, block_records: int) -> Iterator[np.ndarray]:
    window = max(MIN_WINDOW_RECORDS, block_records // (2 * max(1, len(runs))))
    cursors = [_RunCursor(p, n, record_bytes, window) for p, n in runs]
    while True:
        for c in cursors:
            c.refill()
        live = [c for c in cursors if len(c.buffer)]
        if not live:
            return
        bounded = [c.buffer[-1] for c in live if not c.exhausted]
        if bounded:
            # The smallest last record among windows with more behind them: nothing unread sorts below it.
            limit = np.sort(np.array(bounded, dtype=live[0].buffer.dtype))[0]
            takes = [int(np.searchsorted(c.buffer, limit, side="right")) for c in live]
        else:
            takes = [len(c.buffer) for c in live]
        out = [c.buffer[:t] for c, t in zip(live, takes, strict=True) if t]
        for c, t in zip(live, takes, strict=True):
            c.buffer = c.buffer[t:]
        yield np.sort(np.concatenate(out)) if len(out) > 1 else out[0]


class FlagFile:
    """One byte of flags per document, on disk, set in sorted batches and read by range."""

    def __init__(self, path: Path, n_docs: int | None = None):
        self.path = Path(path)
        if n_docs is not None:
            with writing("document flags", self.path.parent, needed=n_docs), open(self.path, "wb") as f:
                f.truncate(n_docs)
        self.n_docs = os.path.getsize(self.path)

    def read(self, lo: int, hi: int) -> np.ndarray:
        with open(self.path, "rb") as f:
            f.seek(lo)
            return np.frombuffer(f.read(hi - lo), dtype=np.uint8).copy()

    def write(self, lo: int, flags: np.ndarray) -> None:
        with writing("document flags", self.path.parent), open(self.path, "r+b") as f:
            f.seek(lo)
            f.write(np.ascontiguousarray(flags, dtype=np.uint8).tobytes())

    def set(self, docs: np.ndarray, bit: int, window: int = 1 << 24) -> None:
        """OR `bit` into the flags of `docs` (sorted document numbers), a window of the file at a time."""
        docs = np.asarray(docs, dtype=np.int64)
        if len(docs) == 0:
            return
        starts = np.flatnonzero(np.concatenate([[True], docs[1:] // window != docs[:-1] // window]))
        for a, b in zip(starts, [*starts[1:], len(docs)], strict=True):
            lo = int(docs[a] // window) * window
            hi = min(self.n_docs, lo + window)
            flags = self.read(lo, hi)
            flags[docs[a:b] - lo] |= np.uint8(bit)
            self.write(lo, flags)
