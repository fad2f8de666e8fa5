"""The training loader: (input, target) batches from a split's token shards, deterministic and resumable.

Sequences are non-overlapping windows of `seq_len + 1` tokens over the split's concatenated token stream
(documents separated by end-of-document tokens); sequence k covers tokens [k*(seq_len+1), (k+1)*(seq_len+1)),
possibly across a shard boundary. The input is the first seq_len tokens, the target the last seq_len.

Order: epoch e visits all sequences in a permutation drawn from (seed, e). The epochs are laid end to end
as one stream; global step s takes stream positions [s*G, (s+1)*G) where G = batch_size * world_size,
and rank r takes the r-th block of batch_size of them. So in every epoch each sequence is visited exactly
once, ranks never overlap, and the whole position is one integer (`position`, in sequences): restoring it
is O(1), and it means the same thing under any world size or batch size.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runyard.data.shards import load_index, open_shard, shard_doc_starts
from runyard.errors import DataError

STATE_VERSION = 1


class TokenStream:
    """Memory-mapped view of a split's shards as one token array (reads may cross shard boundaries)."""

    def __init__(self, index_path: Path):
        self.index_path = Path(index_path)
        self.index = load_index(self.index_path)
        # Plain ndarray views of the maps: slicing a np.memmap object costs far more than the copy itself.
        self.shards = [
            np.asarray(open_shard(self.index_path.parent / e["file"])) for e in self.index["shards"]
        ]
        for entry, shard in zip(self.index["shards"], self.shards, strict=True):
            if len(shard) != entry["tokens"]:
                raise DataError(
                    f"shard {entry['file']} holds {len(shard)} tokens, index says {entry['tokens']}"
                )
        sizes = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.total = int(self.offsets[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the stream."""
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        lo = start - int(self.offsets[i])
        shard = self.shards[i]
        if lo + length <= len(shard):
            return np.asarray(shard[lo : lo + length])
        parts, need = [], length
        while need > 0:
            take = min(need, len(self.shards[i]) - lo)
            parts.append(np.asarray(self.shards[i][lo : lo + take]))
            need -= take
            i, lo = i + 1, 0
        return np.concatenate(parts)

    def windows(self, ids: np.ndarray, width: int) -> np.ndarray:
        """int64 rows of `width` tokens starting at ids * width: one gather per shard for the rows that
        sit inside a shard, a concatenating read for the few that cross a boundary."""
        starts = np.asarray(ids, dtype=np.int64) * width
        shard = np.searchsorted(self.offsets, starts, side="right") - 1
        out = np.empty((len(starts), width), dtype=np.int64)
        inside = starts + width <= self.offsets[shard + 1]
        for s in np.unique(shard[inside]):
            sel = np.flatnonzero(inside & (shard == s))
            local = starts[sel] - self.offsets[s]
            out[sel] = self.shards[s][local[:, None] + np.arange(width)]
        for i in np.flatnonzero(~inside):
            out[i] = self.read(int(starts[i]), width)
        return out


class TokenLoader:
    """Batches of shape [batch_size, seq_len] for one rank. `next_batch()` never stops: after the last
    sequence of an epoch it continues with the next epoch's permutation."""

    def __init__(
        self,
        index_path: str | Path,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        prefetch: int = 0,
    ):
        if seq_len < 1 or batch_size < 1:
            raise DataError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world size {world_size}")
        self.stream = TokenStream(Path(index_path))
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.num_sequences = self.stream.total // (seq_len + 1)
        if self.num_sequences < 1:
            raise DataError(
                f"{index_path}: {self.stream.total} tokens cannot make one sequence of {seq_len + 1} tokens"
            )
        self.position = 0  # sequences consumed by all ranks together since epoch 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)
        self._perm_lock = threading.Lock()
        self.prefetch = prefetch
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="runyard-prefetch") if prefetch else None
        )
        self._pending: deque[tuple[int, Future]] = deque()

    # -- order -------------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self.position // self.num_sequences

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def _permutation(self, epoch: int) -> np.ndarray:
        with self._perm_lock:
            if epoch != self._perm_epoch:
                if self.shuffle:
                    rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                    self._perm = rng.permutation(self.num_sequences)
                else:
                    self._perm = np.arange(self.num_sequences)
                self._perm_epoch = epoch
            return self._perm

    def sequence_ids(self, position: int) -> np.ndarray:
        """The sequence numbers this rank reads for the global step starting at stream `position`."""
        stream_pos = position + self.rank * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        epochs = stream_pos // self.num_sequences
        out = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):  # a batch may straddle two epochs
            sel = epochs == epoch
            out[sel] = self._permutation(int(epoch))[stream_pos[sel] % self.num_sequences]
        return out

    def _assemble(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(self.stream.windows(self.sequence_ids(position), self.seq_len + 1))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    # -- batches -----------------------------------------------------------------------------------------
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (input, target) pair of torch.long tensors, shape [batch_size, seq_len]."""
        pos = self.position
        if self._pool is None:
            batch = self._assemble(pos)
        else:
            while self._pending and self._pending[0][0] != pos:  # stale after a position change
                self._pending.popleft()
            batch = self._pending.popleft()[1].result() if self._pending else self._assemble(pos)
            ahead = self._pending[-1][0] + self.global_batch if self._pending else pos + self.global_batch
            while len(self._pending) < self.prefetch:
                self._pending.append((ahead, self._pool.submit(self._assemble, ahead)))
                ahead += self.global_batch
        self.position = pos + self.global_batch
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    # -- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain ints and strings; `position` is in sequences consumed by all ranks together."""
        return {
            "version": STATE_VERSION,
            "position": int(self.position),
            "epoch": int(self.epoch),
            "seed": int(self.seed),
            "seq_len": int(self.seq_len),
            "num_sequences": int(self.num_sequences),
            "world_size": int(self.world_size),
            "batch_size": int(self.batch_size),
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the exact position in O(1). World size and batch size may differ from the saved ones;
        seed, seq_len and the data must match, or the position would mean other sequences."""
        for key in ("seed", "seq_len", "num_sequences"):
            if int(state[key]) != getattr(self, key):
                raise DataError(
                    f"loader state has {key}={state[key]}, but this loader has {getattr(self, key)}"
                )
        if bool(state.get("shuffle", 1)) != self.shuffle:
            raise DataError("loader state was saved with a different shuffle setting")
        self.position = int(state["position"])
        self._pending.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


@dataclass(frozen=True)
class EvalSample:
    """A fixed sample of a split's sequences for evaluation, and what it covers of the split."""

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    sequences: int  # sequences drawn
    tokens: int  # target tokens scored (sequences x seq_len)
    documents: int | None  # documents of the split the sample reads from (None: the index has no boundaries)
    split_documents: int | None  # documents in the split
    split_sequences: int  # sequences the split holds
    seed: int

    def coverage(self) -> dict[str, Any]:
        """The figures a report states: how much of the split this sample covers, and how it was drawn."""
        return {
            "sequences": self.sequences,
            "tokens": self.tokens,
            "documents": self.documents,
            "split_documents": self.split_documents,
            "split_sequences": self.split_sequences,
            "method": SAMPLE_METHOD,
            "seed": self.seed,
        }


SAMPLE_METHOD = "stratified: one sequence drawn from each of n equal stretches of the split, in stream order"


def documents_covered(doc_starts: np.ndarray, ids: np.ndarray, width: int) -> int:
    """How many documents the windows `ids * width .. + width` read from (a window crossing a
    document boundary counts every document it touches), given every document's global start."""
    if len(doc_starts) == 0 or len(ids) == 0:
        return 0
    first = np.searchsorted(doc_starts, ids * width, side="right") - 1
    last = np.searchsorted(doc_starts, ids * width + width - 1, side="right") - 1
    return _union_length(np.clip(first, 0, None), np.clip(last, 0, None))


def _union_length(first: np.ndarray, last: np.ndarray) -> int:
    """The number of integers in the union of the intervals [first[i], last[i]]."""
    order = np.argsort(first, kind="stable")
    first, last = first[order], last[order]
    reach = np.maximum.accumulate(last)
    # An interval starts a new stretch unless it begins within what the intervals before it reached.
    new = np.ones(len(first), dtype=bool)
    new[1:] = first[1:] > reach[:-1]
    stretch = np.cumsum(new) - 1
    ends = np.zeros(int(stretch[-1]) + 1, dtype=np.int64)
    np.maximum.at(ends, stretch, last)
    return int((ends - first[new] + 1).sum())


class DocumentIndex:
    """Where a split's documents start, read from the shards' offsets files one shard at a time: a
    global document number for any token position, without holding every document's start."""

    def __init__(self, stream: TokenStream):
        self.stream = stream
        entries = stream.index["shards"]
        self.available = all("docs_file" in e or "doc_starts" in e for e in entries)
        counts = [int(e.get("documents", len(e.get("doc_starts", [])))) for e in entries]
        self.docs_before = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @property
    def num_documents(self) -> int:
        return int(self.docs_before[-1])

    def shard_starts(self, shard: int) -> np.ndarray:
        starts = shard_doc_starts(self.stream.index_path, self.stream.index["shards"][shard])
        return np.zeros(0, np.int64) if starts is None else starts

    def document_at(self, positions: np.ndarray) -> np.ndarray:
        """The global number of the document each token position belongs to (a position before the
        first document start counts as document 0)."""
        positions = np.asarray(positions, dtype=np.int64)
        shard = np.searchsorted(self.stream.offsets, positions, side="right") - 1
        out = np.empty(len(positions), dtype=np.int64)
        for s in np.unique(shard):
            sel = np.flatnonzero(shard == s)
            local = positions[sel] - self.stream.offsets[s]
            out[sel] = self.docs_before[s] + np.searchsorted(self.shard_starts(int(s)), local, side="right") - 1
        return np.clip(out, 0, None)

    def documents_covered(self, ids: np.ndarray, width: int) -> int:
        """documents_covered() for this split, reading only the offsets of the shards the windows touch."""
        if self.num_documents == 0 or len(ids) == 0:
            return 0
        starts = np.asarray(ids, dtype=np.int64) * width
        return _union_length(self.document_at(starts), self.document_at(starts + width - 1))

    def starts(self) -> np.ndarray:
        """Every document's global start (8 bytes per document: for the few who need them all)."""
        parts = [self.shard_starts(s) + self.stream.offsets[s] for s in range(len(self.stream.shards))]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class SplitDocuments(Sequence):
    """A split's documents as token arrays, read on demand (shard boundaries joined)."""

    def __init__(self, index_path: str | Path):
        self.stream = TokenStream(Path(index_path))
        starts = DocumentIndex(self.stream).starts()
        self.bounds = np.concatenate([np.union1d(starts, [0]), [self.stream.total]]).astype(np.int64)
        if self.stream.total == 0:
            self.bounds = np.zeros(1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        a, b = int(self.bounds[i]), int(self.bounds[i + 1])
        return self.stream.read(a, b - a)


def eval_sample(index_path: str | Path, seq_len: int, batch_size: int, sequences: int, seed: int) -> EvalSample:
    """Up to `sequences` sequences (windows of the loader's grid) drawn across the whole split, in
    batches of `batch_size` (the last may be smaller). The split's sequences are cut into n equal
    stretches in stream order and one is drawn from each with a generator seeded by `seed`: every part
    of the split (and so every document long enough to hold a stretch) is represented, in proportion to
    its tokens, and the sample is the same for the same split, shape and seed, whatever else the run has
    drawn. A split with no more than `sequences` sequences is used whole."""
    if sequences < 1 or batch_size < 1:
        raise DataError(f"an evaluation sample needs sequences ({sequences}) and batch_size ({batch_size}) >= 1")
    stream = TokenStream(Path(index_path))
    width = seq_len + 1
    total = stream.total // width
    if total == 0:
        raise DataError(f"{index_path}: {stream.total} tokens cannot make one sequence of {width} tokens")
    n = min(sequences, total)
    bounds = (np.arange(n + 1, dtype=np.int64) * total) // n
    rng = np.random.Generator(np.random.PCG64(seed))
    ids = bounds[:-1] + (rng.random(n) * (bounds[1:] - bounds[:-1])).astype(np.int64)
    batches = []
    for lo in range(0, n, batch_size):
        rows = torch.from_numpy(stream.windows(ids[lo : lo + batch_size], width))
        batches.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    documents = DocumentIndex(stream)
    return EvalSample(
        batches=batches,
        sequences=n,
        tokens=n * seq_len,
        documents=documents.documents_covered(ids, width) if documents.available else None,
        split_documents=documents.num_documents if documents.available else None,
        split_sequences=total,
        seed=seed,
    )
