"""MinHash signatures over word n-grams, vectorised with numpy.

The hot path never calls Python per word or per shingle: a batch of documents is joined into one byte
array, words are found by a byte-class table, each word is hashed by a polynomial prefix hash (one
cumulative sum for the whole batch), shingles combine `ngram` consecutive word hashes, and the
`num_perm` hash functions are one broadcast multiply-add over a [num_perm, shingles] block reduced
per document with `np.minimum.reduceat` along the contiguous shingle axis.

Words are maximal runs of ASCII letters, digits, '_' and non-ASCII bytes, lower-cased (ASCII). Hash
family: h_p(x) = (a_p * x + b_p) mod 2^64 on 32-bit shingle hashes (multiply-add-shift; the minimum
is taken over all 64 bits and its top 32 bits are stored), seeded, so signatures are reproducible across processes and machines.
"""

from __future__ import annotations

import numpy as np

_U64 = np.uint64
_P = 0x100000001B3  # odd, so invertible mod 2^64
_P_INV = pow(_P, -1, 1 << 64)
_Q = 0x9E3779B97F4A7C15
EMPTY = np.uint32(0xFFFFFFFF)

_WORD_BYTE = np.zeros(256, dtype=bool)
for _c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_":
    _WORD_BYTE[_c] = True
_WORD_BYTE[0x80:] = True
_LOWER = np.arange(256, dtype=np.uint8)
_LOWER[ord("A") : ord("Z") + 1] += 32
_LOWER_PLUS_1 = _LOWER.astype(np.uint64) + np.uint64(1)  # a byte's term in the word hash, before P^i

_BATCH_CHARS = 4_000_000  # text per shingle_hashes call
_CHUNK = 8192  # shingles per broadcast block: [128, 8192] uint64 = 8 MiB; fewer, longer numpy calls


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads polynomial hashes over all 64 bits."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> _U64(30))
        x = x * _U64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> _U64(27))
        x = x * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


_POW_CACHE: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """P^i and P^-i mod 2^64 for i < n (cached, grown by doubling)."""
    cached = _POW_CACHE.get(0)
    if cached is None or len(cached[0]) < n:
        size = max(n, 1 << 20, 2 * (len(cached[0]) if cached else 0))
        pw, inv = np.ones(size, dtype=_U64), np.ones(size, dtype=_U64)
        pw[1:2], inv[1:2] = _U64(_P), _U64(_P_INV)
        step = 2  # [0, step) is filled; [step, 2 step) is that times P^step: log2(size) vector multiplies
        with np.errstate(over="ignore"):
            while step < size:
                m = min(step, size - step)
                np.multiply(pw[:m], pw[step - 1] * _U64(_P), out=pw[step : step + m])
                np.multiply(inv[:m], inv[step - 1] * _U64(_P_INV), out=inv[step : step + m])
                step *= 2
        _POW_CACHE[0] = cached = (pw, inv)
    return cached[0][:n], cached[1][:n]


def shingle_hashes(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """32-bit hashes of every word n-gram of every text, and the index of the text each belongs to
    (non-decreasing). A text with fewer than `ngram` words (but at least one) gets one shingle of all
    its words; a text without words gets none."""
    encoded = [t.encode("utf-8") for t in texts]
    lengths = np.fromiter((len(e) + 1 for e in encoded), dtype=np.int64, count=len(encoded))
    doc_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(encoded) else np.zeros(0, np.int64)
    buf = np.frombuffer(b"\n".join(encoded) + b"\n", dtype=np.uint8)
    is_word = _WORD_BYTE[buf].view(np.int8)  # case does not change a byte's class
    # Word boundaries alternate (start, end, start, ...) because the batch begins and ends outside a word.
    bounds = np.flatnonzero(np.diff(is_word, prepend=np.int8(0), append=np.int8(0)))
    starts, ends = bounds[0::2], bounds[1::2]
    if len(starts) == 0:
        return np.zeros(0, np.uint32), np.zeros(0, np.int64)
    pw, inv = _powers(len(buf) + 1)
    with np.errstate(over="ignore"):
        # Word hash: sum of (lower-cased byte + 1) * P^(offset in word), from one prefix sum over the batch.
        prefix = np.empty(len(buf) + 1, dtype=_U64)
        prefix[0] = 0
        np.take(_LOWER_PLUS_1, buf, out=prefix[1:], mode="clip")  # 'raise' would buffer `out`
        np.multiply(prefix[1:], pw[: len(buf)], out=prefix[1:])
        np.cumsum(prefix[1:], out=prefix[1:])
        words = _mix64((prefix[ends] - prefix[starts]) * inv[starts])
    word_doc = np.searchsorted(doc_start, starts, side="right") - 1
    nw = len(words)
    words_in_doc = np.bincount(word_doc, minlength=len(texts))
    first_of_doc = np.ones(nw, dtype=bool)
    first_of_doc[1:] = word_doc[1:] != word_doc[:-1]
    # Shingle i is sum_k words[i+k] * Q^k over its `ngram` words; positions whose window crosses into
    # the next document are dropped below, except a short document's single shingle, summed apart.
    short = np.flatnonzero(first_of_doc & (words_in_doc[word_doc] < ngram))
    short_len = words_in_doc[word_doc[short]]
    acc = words.copy()
    acc_short = words[short]
    q = _U64(1)
    with np.errstate(over="ignore"):
        for k in range(1, ngram):
            q = q * _U64(_Q)
            if nw > k:
                acc[: nw - k] += words[k:] * q
            more = short_len > k
            acc_short[more] += words[short[more] + k] * q
    full = np.zeros(nw, dtype=bool)
    if nw >= ngram:
        full[: nw - ngram + 1] = word_doc[ngram - 1 :] == word_doc[: nw - ngram + 1]
    acc[short] = acc_short
    full[short] = True
    return (_mix64(acc[full]) >> _U64(32)).astype(np.uint32), word_doc[full]


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The (a, b) parameters of the hash family; a is odd."""
    rng = np.random.Generator(np.random.PCG64(seed))
    a = rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64) * _U64(2) + _U64(1)
    b = rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64)
    return a, b


def signatures(texts: list[str], num_perm: int = 128, ngram: int = 5, seed: int = 1) -> np.ndarray:
    """[len(texts), num_perm] uint32 MinHash signatures; a text without words has all entries EMPTY."""
    a, b = permutations(num_perm, seed)
    out = np.full((len(texts), num_perm), EMPTY, dtype=np.uint32)
    # Batches of about 4 MB of text keep the intermediate arrays small.
    batch: list[str] = []
    size = 0
    first = 0
    for i, text in enumerate(texts):
        batch.append(text)
        size += len(text)
        if size >= _BATCH_CHARS or i == len(texts) - 1:
            _signatures_into(out[first : i + 1], batch, a, b, ngram)
            first, batch, size = i + 1, [], 0
    return out


def _signatures_into(out: np.ndarray, texts: list[str], a: np.ndarray, b: np.ndarray, ngram: int) -> None:
    hashes, doc = shingle_hashes(texts, ngram)
    if len(hashes) == 0:
        return
    x = hashes.astype(_U64)
    # Permutations on the outer axis: the per-document minimum then runs along contiguous memory
    # (reduceat over the outer axis of a [shingles, num_perm] block was 20x slower per element).
    block = np.empty((len(a), _CHUNK), dtype=_U64)
    a_col, b_col = a[:, None], b[:, None]
    for lo in range(0, len(x), _CHUNK):
        xs, ds = x[lo : lo + _CHUNK], doc[lo : lo + _CHUNK]
        h = block[:, : len(xs)]
        # The minimum of the full 64-bit (a*x + b) is the min-hash; its top 32 bits are stored.
        np.multiply(a_col, xs[None, :], out=h)
        h += b_col
        bounds = np.flatnonzero(np.concatenate([[True], ds[1:] != ds[:-1]]))
        mins = (np.minimum.reduceat(h, bounds, axis=1) >> _U64(32)).astype(np.uint32).T
        rows = ds[bounds]
        out[rows] = np.minimum(out[rows], mins)
