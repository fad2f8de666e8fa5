"""MinHash signatures over word n-grams: one compiled pass (numba, the `fast` extra) or numpy.

With numba installed, `signatures` runs one compiled loop over the bytes of a batch of texts (words,
shingles and the `num_perm` minima in registers, no intermediate arrays; 2.3x the numpy path on one
core in benchmarks/data_throughput.py) once a process has hashed enough text to pay for loading it (KERNEL_AFTER_CHARS). Before
that, and without numba, the numpy path below computes the same bits (tests/data/test_minhash_kernel.py).

The numpy path never calls Python per word or per shingle: a batch of documents is joined into one byte
array, words are found by a byte-class table, each word is hashed by a polynomial prefix hash (one
cumulative sum for the whole batch), shingles combine `ngram` consecutive word hashes, and the
`num_perm` hash functions are one broadcast multiply-add over a [num_perm, shingles] block reduced
per document with `np.minimum.reduceat` along the contiguous shingle axis.

Words are maximal runs of ASCII letters, digits, '_' and non-ASCII bytes, lower-cased (ASCII). Hash
family: h_p(x) = (a_p * x + b_p) mod 2^64 on 32-bit shingle hashes (multiply-add-shift; the minimum
is taken over all 64 bits and its top 32 bits are stored), seeded, so signatures are reproducible across processes and machines.
"""

from __future__ import annotations

from collections.abc import Iterator

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


def _joined_bytes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A batch's texts as one UTF-8 byte array, each followed by '\n' (never a word byte, so no word
    crosses from one text into the next), and each text's length in it, its '\n' included."""
    encoded = [t.encode("utf-8") for t in texts]
    lengths = np.fromiter((len(e) + 1 for e in encoded), dtype=np.int64, count=len(encoded))
    return np.frombuffer(b"\n".join(encoded) + b"\n", dtype=np.uint8), lengths


def _batches(texts: list[str]) -> Iterator[tuple[int, int]]:
    """[lo, hi) ranges covering `texts` in order, each about _BATCH_CHARS characters (at least one text):
    the intermediate arrays of a batch stay small."""
    lo, size = 0, 0
    for i, text in enumerate(texts):
        size += len(text)
        if size >= _BATCH_CHARS or i == len(texts) - 1:
            yield lo, i + 1
            lo, size = i + 1, 0


def shingle_hashes(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """32-bit hashes of every word n-gram of every text, and the index of the text each belongs to
    (non-decreasing). A text with fewer than `ngram` words (but at least one) gets one shingle of all
    its words; a text without words gets none."""
    buf, lengths = _joined_bytes(texts)
    doc_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(texts) else np.zeros(0, np.int64)
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


# The compiled kernel's first call in a process pays for numba's import and its cached machine code (more
# the first time it compiles), which its lead over the numpy path pays back only after some tens of MB of
# text (benchmarks/data_throughput.py prints both figures). A process therefore switches to it once it has
# hashed this many characters: a large prepare runs on the kernel, a small one (an example, a test) never
# loads numba.
KERNEL_AFTER_CHARS = 64 * 1024 * 1024
_hashed_chars = 0


def signatures(texts: list[str], num_perm: int = 128, ngram: int = 5, seed: int = 1,
               compiled: bool | None = None) -> np.ndarray:
    """[len(texts), num_perm] uint32 MinHash signatures; a text without words has all entries EMPTY.
    `compiled`: True runs numba's one compiled pass (the `fast` extra; numpy where numba is missing),
    False the numpy path, None the kernel once this process has hashed KERNEL_AFTER_CHARS. Both give the
    same bits."""
    global _hashed_chars
    if ngram < 1:
        raise ValueError(f"signatures: ngram must be at least 1, got {ngram}")
    if compiled is None:
        compiled = _hashed_chars >= KERNEL_AFTER_CHARS
        _hashed_chars += sum(map(len, texts))
    kernel = _numba_kernel() if compiled else None
    if kernel is None:
        return signatures_numpy(texts, num_perm, ngram, seed)
    a, b = permutations(num_perm, seed)
    out = np.full((len(texts), num_perm), EMPTY, dtype=np.uint32)
    qpow = np.ones(ngram, dtype=_U64)
    with np.errstate(over="ignore"):
        for k in range(1, ngram):
            qpow[k] = qpow[k - 1] * _U64(_Q)
    for lo, hi in _batches(texts):
        buf, lengths = _joined_bytes(texts[lo:hi])
        kernel(buf, np.cumsum(lengths) - 1, _WORD_BYTE, _LOWER_PLUS_1, a, b, qpow, out[lo:hi])  # each text's '\n'
    return out


_KERNEL: list = []  # [the compiled kernel, or None without numba], filled on first use


def _numba_kernel():
    """The compiled signature kernel, or None where numba is not installed (compiled on first use and
    cached on disk, so importing this module never pays for numba)."""
    if not _KERNEL:
        try:
            import numba
        except ImportError:
            _KERNEL.append(None)
        else:
            from numba.extending import register_jitable

            register_jitable(inline="always")(_min_into)  # compiled where the kernel calls it
            _KERNEL.append(numba.njit(cache=True, nogil=True, boundscheck=False)(_signature_kernel))
    return _KERNEL[0]


def _signature_kernel(buf, ends, word_byte, lower_plus_1, a, b, qpow, out):  # pragma: no cover - compiled
    """Numba body of `signatures`, the numpy path's arithmetic in one pass: per text, each word's hash
    (sum of (lower-cased byte + 1) * P^offset, then splitmix64), each shingle's sum of word hashes times
    Q^k, splitmix64'd to its top 32 bits, and per permutation the running minimum of the top 32 bits
    of a*x + b.
    Every constant is a uint64: numba widens a uint64 mixed with a Python int to float64."""
    p_mul = np.uint64(_P)
    m1, m2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    s30, s27, s31, s32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
    num_perm = a.shape[0]
    ngram = qpow.shape[0]
    # x < 2^32, so the top 32 bits of (a*x + b) mod 2^64 are aH*x + bH + ((aL*x + bL) >> 32) mod 2^32
    # (H, L: the top and bottom halves), and the top 32 bits of the 64-bit minimum are the minimum of
    # the top 32 bits: minima of 32-bit values, twice as many to a vector register.
    low = np.uint64(0xFFFFFFFF)
    a_lo = np.empty(num_perm, dtype=np.uint64)
    b_lo = np.empty(num_perm, dtype=np.uint64)
    a_hi = np.empty(num_perm, dtype=np.uint32)
    b_hi = np.empty(num_perm, dtype=np.uint32)
    for p in range(num_perm):
        a_lo[p], b_lo[p] = a[p] & low, b[p] & low
        a_hi[p], b_hi[p] = np.uint32(a[p] >> s32), np.uint32(b[p] >> s32)
    mins = np.empty(num_perm, dtype=np.uint32)
    ring = np.zeros(ngram, dtype=np.uint64)
    pos = 0
    for d in range(ends.shape[0]):
        end = ends[d]
        for p in range(num_perm):
            mins[p] = np.uint32(0xFFFFFFFF)
        nwords = 0
        while pos < end:
            if not word_byte[buf[pos]]:
                pos += 1
                continue
            h = np.uint64(0)
            pw = np.uint64(1)
            while word_byte[buf[pos]]:  # buf[end] is '\n': a word stops at its text's end
                h += lower_plus_1[buf[pos]] * pw
                pw *= p_mul
                pos += 1
            h ^= h >> s30
            h *= m1
            h ^= h >> s27
            h *= m2
            h ^= h >> s31
            ring[nwords % ngram] = h
            nwords += 1
            if nwords >= ngram:
                acc = np.uint64(0)
                for k in range(ngram):
                    acc += ring[(nwords - ngram + k) % ngram] * qpow[k]
                _min_into(mins, acc, a_lo, b_lo, a_hi, b_hi, m1, m2, s30, s27, s31, s32)
        if 0 < nwords < ngram:  # fewer words than the n-gram: one shingle of all of them
            acc = np.uint64(0)
            for k in range(nwords):
                acc += ring[k] * qpow[k]
            _min_into(mins, acc, a_lo, b_lo, a_hi, b_hi, m1, m2, s30, s27, s31, s32)
        if nwords > 0:
            for p in range(num_perm):
                out[d, p] = mins[p]
        pos = end + 1


def _min_into(mins, acc, a_lo, b_lo, a_hi, b_hi, m1, m2, s30, s27, s31, s32):  # pragma: no cover - compiled
    """Fold one shingle (its hash before the final mix, `acc`) into the running 32-bit minima."""
    acc ^= acc >> s30
    acc *= m1
    acc ^= acc >> s27
    acc *= m2
    acc ^= acc >> s31
    x = acc >> s32
    x32 = np.uint32(x)
    for p in range(mins.shape[0]):
        carry = np.uint32((a_lo[p] * x + b_lo[p]) >> s32)
        mins[p] = min(mins[p], np.uint32(a_hi[p] * x32 + b_hi[p] + carry))  # the cast wraps mod 2^32


def signatures_numpy(texts: list[str], num_perm: int = 128, ngram: int = 5, seed: int = 1) -> np.ndarray:
    """`signatures` without numba: numpy over ~4 MB batches of text."""
    a, b = permutations(num_perm, seed)
    out = np.full((len(texts), num_perm), EMPTY, dtype=np.uint32)
    for lo, hi in _batches(texts):
        _signatures_into(out[lo:hi], texts[lo:hi], a, b, ngram)
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
