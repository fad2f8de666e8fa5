"""The cleaned corpus as the main process sees it: every part in order, a global document numbering,
and one byte of flags per document on disk (removed as an exact or near duplicate, held out). The
steps after cleaning read it in blocks and never hold a per-document list of texts, ids or hashes.

- `split_corpus`: the train/held-out split (split.py's rule, streamed), and the held-out ids in
  document order in a file.
- `corpus_stats`: documents and bytes after each step and the document-length histogram, from the
  parts' per-document records and the flags alone.
- `training_texts`: the training split's texts in order, for tokenizer training.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runyard.data.partstore import PartReader
from runyard.data.spill import FlagFile
from runyard.data.split import split_key
from runyard.system.diskspace import writing

DOCS_PER_BLOCK = 1 << 20

EXACT_DUP = 1
NEAR_DUP = 2
HELDOUT = 4
REMOVED = EXACT_DUP | NEAR_DUP

@dataclass(frozen=True)
class Corpus:
    """The cleaned parts in order, their global document numbering, and the per-document flags."""

    parts: list[PartReader]
    starts: np.ndarray  # [len(parts) + 1] first global document of each part, and the total
    flags: FlagFile

    @property
    def n_docs(self) -> int:
        return int(self.starts[-1])

    def locate(self, docs: np.ndarray) -> np.ndarray:
        """The part each global document number belongs to."""
        return np.searchsorted(self.starts, docs, side="right") - 1

    def blocks(self, docs_per_block: int) -> Iterator[tuple[int, int, int]]:
        """(part, lo, hi): local document ranges of at most `docs_per_block`, in global order."""
        for p, part in enumerate(self.parts):
            for lo in range(0, part.n_docs, docs_per_block):
                yield p, lo, min(part.n_docs, lo + docs_per_block)

    def signature_rows(self, docs: np.ndarray) -> np.ndarray:
        """Signatures of the given global documents (any order)."""
        docs = np.asarray(docs, dtype=np.int64)
        out = np.empty((len(docs), self.parts[0].num_perm), dtype=np.uint32)
        where = self.locate(docs)
        for p in np.unique(where):
            sel = np.flatnonzero(where == p)
            out[sel] = self.parts[p].signature_rows(docs[sel] - self.starts[p])
        return out

    def ids_of(self, docs: list[int]) -> dict[int, str]:
        """The ids of a few global documents (one pass over each part's id list that holds one)."""
        out: dict[int, str] = {}
        arr = np.asarray(sorted(set(docs)), dtype=np.int64)
        where = self.locate(arr)
        for p in np.unique(where):
            local = {int(d - self.starts[p]): int(d) for d in arr[where == p]}
            for i, doc_id in self.parts[p].ids_at(set(local)).items():
                out[local[i]] = doc_id
        return out

    @classmethod
    def open(cls, part_dirs: list[Path], flags_path: Path) -> Corpus:
        """The corpus of `part_dirs` (in order), with a new all-clear flag file at `flags_path`."""
        parts = [PartReader(d) for d in part_dirs]
        starts = np.concatenate([[0], np.cumsum([p.n_docs for p in parts])]).astype(np.int64)
        return cls(parts, starts, FlagFile(flags_path, int(starts[-1])))

    def flags_of(self, p: int, lo: int, hi: int) -> np.ndarray:
        base = int(self.starts[p])
        return self.flags.read(base + lo, base + hi)


def split_corpus(corpus: Corpus, seed: int, fraction: float, ids_path: Path) -> dict[str, Any]:
    """Flag the held-out documents (HELDOUT) among those kept, by split.py's rule: a document is held out
    when its key is below `fraction` of the key space, and with two or more documents each side gets at
    least one (the smallest key goes held-out, the largest to train). Writes the held-out documents' ids,
    in document order, one JSON string a line, to `ids_path`; returns their count and the file's sha256."""
    threshold = np.uint64(int(fraction * 2**64))
    kept = held = 0
    lowest = highest = None  # (key, document) of the first document with the smallest / largest key
    for p, lo, hi in corpus.blocks(DOCS_PER_BLOCK):
        flags = corpus.flags_of(p, lo, hi)
        live = np.flatnonzero((flags & REMOVED) == 0)
        if len(live) == 0:
            continue
        hashes = corpus.parts[p].exact(lo, hi)[live]
        keys = np.array([split_key(seed, h.tobytes()) for h in hashes], dtype=np.uint64)
        is_held = keys < threshold
        flags[live[is_held]] |= HELDOUT
        corpus.flags.write(int(corpus.starts[p]) + lo, flags)
        base = int(corpus.starts[p]) + lo
        i_min, i_max = int(np.argmin(keys)), int(np.argmax(keys))
        if lowest is None or keys[i_min] < lowest[0]:
            lowest = (keys[i_min], base + int(live[i_min]))
        if highest is None or keys[i_max] > highest[0]:
            highest = (keys[i_max], base + int(live[i_max]))
        kept += len(live)
        held += int(is_held.sum())
    if kept >= 2 and held == 0:
        corpus.flags.set(np.array([lowest[1]]), HELDOUT)
        held = 1
    if kept >= 2 and held == kept:
        doc = highest[1]
        corpus.flags.write(doc, corpus.flags.read(doc, doc + 1) & ~np.uint8(HELDOUT))
        held -= 1
    digest = hashlib.sha256()
    with writing("the held-out document ids", ids_path.parent), open(ids_path, "wb") as out:
        for p, part in enumerate(corpus.parts):
            flags = corpus.flags_of(p, 0, part.n_docs)
            wanted = (flags & (REMOVED | HELDOUT)) == HELDOUT
            for doc_id, w in zip(part.ids(), wanted, strict=True):
                if w:
                    line = (json.dumps(doc_id) + "\n").encode()
                    out.write(line)
                    digest.update(line)
    return {"documents": held, "sha256": digest.hexdigest()}


@dataclass
class _Tally:
    documents: int = 0
    bytes: int = 0
    chars: int = 0

    def add(self, mask: np.ndarray, nbytes: np.ndarray, chars: np.ndarray) -> None:
        self.documents += int(mask.sum())
        self.bytes += int(nbytes[mask].sum())
        self.chars += int(chars[mask].sum())


def held_out_documents(corpus: Corpus) -> Iterator[tuple[str, int]]:
    """(id, bytes) of each held-out document, in document order (the order of the held-out shards)."""
    for p, part in enumerate(corpus.parts):
        flags = corpus.flags_of(p, 0, part.n_docs)
        wanted = (flags & (REMOVED | HELDOUT)) == HELDOUT
        if not wanted.any():
            continue
        nbytes = part.nbytes()
        for i, (doc_id, w) in enumerate(zip(part.ids(), wanted, strict=True)):
            if w:
                yield doc_id, int(nbytes[i])


def corpus_stats(corpus: Corpus) -> dict[str, Any]:
    """Documents, bytes and characters after filtering, after exact and near dedup, and per split; the
    histogram of kept documents' lengths in characters (30 log-spaced bins up to the longest)."""
    tallies = {k: _Tally() for k in ("filter", "exact_dedup", "near_dedup", "train", "heldout")}
    longest = 0
    for p, lo, hi in corpus.blocks(DOCS_PER_BLOCK):
        flags = corpus.flags_of(p, lo, hi)
        part = corpus.parts[p]
        nbytes, chars = part.nbytes(lo, hi), part.chars(lo, hi)
        kept = (flags & REMOVED) == 0
        held = (flags & HELDOUT) != 0
        tallies["filter"].add(np.ones(len(flags), dtype=bool), nbytes, chars)
        tallies["exact_dedup"].add((flags & EXACT_DUP) == 0, nbytes, chars)
        tallies["near_dedup"].add(kept, nbytes, chars)
        tallies["train"].add(kept & ~held, nbytes, chars)
        tallies["heldout"].add(kept & held, nbytes, chars)
        if kept.any():
            longest = max(longest, int(chars[kept].max()))
    edges = np.unique(np.logspace(0, np.log10(max(10, longest) + 1), 31).astype(np.int64))
    hist = np.zeros(len(edges) - 1, dtype=np.int64)
    for p, lo, hi in corpus.blocks(DOCS_PER_BLOCK):
        kept = (corpus.flags_of(p, lo, hi) & REMOVED) == 0
        hist += np.histogram(corpus.parts[p].chars(lo, hi)[kept], bins=edges)[0]
    return {
        "tallies": {k: vars(v) for k, v in tallies.items()},
        "doc_length_histogram": {"unit": "characters", "edges": edges.tolist(), "counts": hist.tolist()},
    }


def training_texts(corpus: Corpus, block_bytes: int) -> Iterator[str]:
    """The training split's texts, in document order, read a block at a time."""
    for p, part in enumerate(corpus.parts):
        for lo, hi in part.block_ranges(block_bytes):
            flags = corpus.flags_of(p, lo, hi)
            train = (flags & (REMOVED | HELDOUT)) == 0
            if train.any():
                for text, keep in zip(part.texts(lo, hi), train, strict=True):
                    if keep:
                        yield text
