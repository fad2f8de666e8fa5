"""Tokenize the cleaned parts in chunks, then assemble each split's shards from the chunks.

`tokenize_part` is one task per cleaned part (a worker process, a Slurm array task or a Ray task): it
reads the part's kept documents in chunks of about `chunk_bytes` characters, encodes each (one thread:
the executor runs tasks side by side) and saves it atomically as `p<part>_<first doc>_<end doc>.npz`
holding the train and held-out documents' tokens, an end-of-document token after each document. A rerun
after an interruption reuses every finished chunk, so the work resumes where it stopped. Its output is
the list of its chunks, written last.

`assemble_splits` then streams every chunk, in corpus order, through two ShardWriters (train and
held-out): fixed-size shards, each written atomically, then the index last, so a split is complete
exactly when its index exists. On the way it counts the training split's tokens per id: the unigram
baseline and the drift reference read those counts, not a second pass over the shards.

Memory: one chunk's text and tokens in a task (the chunk is capped by the task's memory share; encode
calls see at most `encode_batch_bytes` at a time), one chunk and the vocabulary's counts in assembly.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

from runyard.data.budget import MemoryBudget
from runyard.data.corpus import HELDOUT, REMOVED
from runyard.data.partstore import PartReader
from runyard.data.shards import ShardWriter, dtype_for_vocab, write_index
from runyard.data.spill import FlagFile
from runyard.data.tokenizer import EOS_TOKEN, eos_id, load_tokenizer
from runyard.system.files import atomic_write_bytes, atomic_write_json

CHUNK_BYTES = 1 << 22  # ~4 MB of text per chunk
SPLITS = ("train", "heldout")

# The tokenizer of the last tokenize task in this process, by (path, identity, eos token): a worker runs
# many tasks with one tokenizer, and each Tokenizer loaded and dropped left ~3.5 MiB resident (its
# encode cache; measured), so a worker's resident size grew with the number of parts it tokenized.
_LOADED: dict[tuple, Tokenizer] = {}


def task_tokenizer(path: Path, eos_token: str) -> Tokenizer:
    """`load_tokenizer(path, eos_token)`, reused while the file is the same one."""
    st = os.stat(path)
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, eos_token)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = load_tokenizer(path, eos_token)
    return _LOADED[key]


@contextmanager
def single_threaded_tokenizers() -> Iterator[None]:
    """Encode on this thread only: tasks already run side by side, one per core."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def chunk_ranges(texts: list[str], chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """[start, end) document ranges of about chunk_bytes characters each; depends only on the texts."""
    return sized_ranges(np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts)), chunk_bytes)


def sized_ranges(sizes: np.ndarray, target: int) -> list[tuple[int, int]]:
    """[start, end) ranges cut as soon as their sizes reach `target` (the last may be smaller)."""
    ranges, start, size = [], 0, 0
    for i, n in enumerate(np.asarray(sizes).tolist()):
        size += n
        if size >= target:
            ranges.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(sizes):
        ranges.append((start, len(sizes)))
    return ranges


# Where a text may be cut without changing its tokens under byte-level BPE with GPT-2's split regex
# (`'s|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`): the regex looks only rightwards,
# and at these points every match of the whole text ends, and matching the two sides apart gives the
# same pieces. (1) before the last space of a whitespace run that follows and precedes printable ASCII:
# the run less that space is one pre-token (`\s+(?!\S)`), the space starts the next (` ?X`); (2) after
# a lone tab or line break between printable ASCII: it is a pre-token of its own. BPE merges never
# cross pre-tokens, so the pieces' tokens joined are the whole text's (tested on real text).
_CUT_BEFORE_SPACE = re.compile(r"(?<=[!-~])[ \t\r\n]* (?=[!-~])")
_CUT_AFTER_BREAK = re.compile(r"(?<=[!-~])[\t\r\n](?=[!-~])")


def cuts_at_lines(tok: Tokenizer) -> bool:
    """Whether `tok` encodes a text cut at those points to the tokens of the whole: byte-level BPE with
    the split regex, no prefix space, no normaliser, no dropout, and no added token that strips or holds
    whitespace (what runyard trains, and GPT-2's; other families are encoded whole)."""
    pre, model = tok.pre_tokenizer, tok.model
    if not (tok.normalizer is None and isinstance(model, models.BPE) and model.dropout is None
            and isinstance(pre, pre_tokenizers.ByteLevel) and pre.use_regex and not pre.add_prefix_space):
        return False
    return all(not (t.lstrip or t.rstrip or any(c.isspace() for c in t.content))
               for t in tok.get_added_tokens_decoder().values())


def cut_points(text: str) -> np.ndarray:
    """The positions (sorted) where `text` may be cut without changing its tokens (see above)."""
    points = [m.end() - 1 for m in _CUT_BEFORE_SPACE.finditer(text)]
    points += [m.end() for m in _CUT_AFTER_BREAK.finditer(text)]
    return np.unique(np.asarray(points, dtype=np.int64))


def line_pieces(text: str, max_chars: int) -> list[str]:
    """`text` cut at `cut_points` into pieces of at most `max_chars` characters (longer only where no cut
    point falls within `max_chars`): the pieces joined are the text."""
    if len(text) <= max_chars:
        return [text]
    points = cut_points(text)
    pieces, start = [], 0
    while len(text) - start > max_chars:
        k = int(np.searchsorted(points, start + max_chars, side="right")) - 1  # last cut within reach
        if k < 0 or points[k] <= start:
            k = int(np.searchsorted(points, start, side="right"))  # none: the first one beyond
            if k >= len(points):
                break
        pieces.append(text[start : points[k]])
        start = int(points[k])
    pieces.append(text[start:])
    return pieces


def _encode_ids(tok: Tokenizer, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
    encodings = tok.encode_batch_fast(texts) if hasattr(tok, "encode_batch_fast") else tok.encode_batch(texts)
    return [np.asarray(e.ids, dtype=dtype) for e in encodings]


def encode_documents(
    tok: Tokenizer, texts: list[str], eos: int, dtype: np.dtype, max_piece_chars: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of all documents, each followed by eos; per-document lengths including eos).

    With `max_piece_chars`, a document longer than that is encoded a piece at a time (`line_pieces`)
    when the tokenizer gives the same tokens that way (`cuts_at_lines`): the encoder's working memory
    (~110 bytes per character) then follows the piece, not the document."""
    if max_piece_chars is None or not cuts_at_lines(tok) or all(len(t) <= max_piece_chars for t in texts):
        pieces, owners = texts, np.arange(len(texts))
    else:
        # added tokens (`<|endoftext|>`) are split out before the regex runs: cut no text that holds one
        added = [t.content for t in tok.get_added_tokens_decoder().values()]
        cut = [[t] if any(a in t for a in added) else line_pieces(t, max_piece_chars) for t in texts]
        pieces = [p for ps in cut for p in ps]
        owners = np.repeat(np.arange(len(texts)), [len(ps) for ps in cut])
    ids: list[np.ndarray] = []
    for a, b in chunk_ranges(pieces, max_piece_chars) if max_piece_chars else [(0, len(pieces))]:
        ids += _encode_ids(tok, pieces[a:b], dtype)
    per_piece = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    lengths = np.bincount(owners, weights=per_piece, minlength=len(texts)).astype(np.int64) + 1
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths) - 1  # each document's eos
    tokens[ends] = eos
    body = np.ones(len(tokens), dtype=bool)
    body[ends] = False
    tokens[body] = np.concatenate(ids) if ids else np.zeros(0, dtype=dtype)
    return tokens, lengths


def _encode_chunk(tok: Tokenizer, texts: list[str], eos: int, dtype: np.dtype,
                  batch_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """encode_documents over `texts` in calls of at most about `batch_bytes` characters each (a longer
    document in pieces of about that, where the tokenizer allows)."""
    parts = [encode_documents(tok, texts[a:b], eos, dtype, batch_bytes) for a, b in chunk_ranges(texts, batch_bytes)]
    if not parts:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def chunk_name(part_index: int, lo: int, hi: int) -> str:
    # Named by document range, so a resume with another chunk size never reuses a wrong chunk.
    return f"p{part_index:05d}_{lo:09d}_{hi:09d}.npz"


def tokenize_part(
    part_dir: Path,
    flags_path: Path,
    first_doc: int,
    tokenizer_path: Path,
    work_dir: Path,
    part_index: int,
    chunk_bytes: int,
    budget: MemoryBudget,
    output: Path,
    eos_token: str = EOS_TOKEN,
) -> dict[str, Any]:
    """Encode one cleaned part's kept documents into chunk files, each document ended by `eos_token`;
    write their list to `output`."""
    part = PartReader(part_dir)
    flags = FlagFile(flags_path).read(first_doc, first_doc + part.n_docs)
    kept = (flags & REMOVED) == 0
    held = (flags & HELDOUT) != 0
    tok = task_tokenizer(tokenizer_path, eos_token)
    eos = eos_id(tok, eos_token)
    dtype = dtype_for_vocab(tok.get_vocab_size())
    chunks = []
    with single_threaded_tokenizers():
        for lo, hi in sized_ranges(np.where(kept, part.chars(), 0), budget.chunk_bytes(chunk_bytes)):
            if not kept[lo:hi].any():
                continue
            path = work_dir / chunk_name(part_index, lo, hi)
            chunks.append(path.name)
            if path.exists():
                continue
            sel = kept[lo:hi]
            texts = [t for t, k in zip(part.texts(lo, hi), sel, strict=True) if k]
            tokens, lengths = _encode_chunk(tok, texts, eos, dtype, budget.encode_batch_bytes)
            is_held = held[lo:hi][sel]
            token_held = np.repeat(is_held, lengths)
            buf = io.BytesIO()
            np.savez(
                buf,
                train_tokens=tokens[~token_held], train_lengths=lengths[~is_held],
                heldout_tokens=tokens[token_held], heldout_lengths=lengths[is_held],
            )
            atomic_write_bytes(path, buf.getvalue())
    result = {"part": part_index, "chunks": chunks}
    atomic_write_json(output, result)
    return result


def assemble_splits(
    chunk_paths: Iterable[Path], out_dir: Path, *, shard_tokens: int, vocab_size: int, eos: int,
    on_chunk: Callable[[Path], None] | None = None,
) -> tuple[dict[str, dict[str, int]], np.ndarray]:
    """Write both splits' shards and indexes from the chunk files, in order; returns each split's
    totals for the report and the training split's token counts per id."""
    dtype = dtype_for_vocab(vocab_size)
    writers = {split: ShardWriter(out_dir, split, shard_tokens, dtype) for split in SPLITS}
    counts = np.zeros(vocab_size, dtype=np.int64)
    try:
        for path in chunk_paths:
            with np.load(path, allow_pickle=False) as z:
                for split in SPLITS:
                    tokens = z[f"{split}_tokens"]
                    writers[split].add_tokens(tokens, z[f"{split}_lengths"])
                    if split == "train":
                        counts += np.bincount(tokens, minlength=vocab_size)[:vocab_size]
            if on_chunk:
                on_chunk(path)
        totals = {}
        for split, writer in writers.items():
            entries = writer.finish()
            write_index(out_dir / f"{split}.json", entries, dtype=dtype, vocab_size=vocab_size, eos_id=eos,
                        shard_tokens=shard_tokens, num_documents=writer.num_documents)
            totals[split] = {"tokens": writer.total_tokens, "documents": writer.num_documents,
                             "shards": len(entries)}
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    return totals, counts


# -- texts already in memory (benchmarks, small callers) ---------------------------------------------------


def tokenize_chunks(
    tok: Tokenizer,
    texts: list[str],
    eos: int,
    work_dir: Path,
    split: str,
    chunk_bytes: int = CHUNK_BYTES,
    on_chunk: Callable[[int], None] | None = None,
) -> list[Path]:
    """Encode `texts` held in memory chunk by chunk into work_dir (two chunks in flight: encode_batch
    releases the GIL), skipping chunks already there; returns the chunk files."""
    dtype = dtype_for_vocab(tok.get_vocab_size())

    def one(lo: int, hi: int) -> Path:
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
    """Write one split's shards and index from tokenize_chunks' files; returns totals for the report."""
    dtype = dtype_for_vocab(vocab_size)
    writer = ShardWriter(out_dir, split, shard_tokens, dtype)
    for path in chunks:
        with np.load(path, allow_pickle=False) as z:
            writer.add_tokens(z["tokens"], z["lengths"])
    entries = writer.finish()
    write_index(out_dir / f"{split}.json", entries, dtype=dtype, vocab_size=vocab_size, eos_id=eos,
                shard_tokens=shard_tokens, num_documents=writer.num_documents)
    return {"tokens": writer.total_tokens, "documents": writer.num_documents, "shards": len(entries)}


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
