"""Drift monitoring: are the live prompts still like the training data, at a stated false-alarm rate?

The reference is saved beside the export: the training split's token histogram
(`drift_reference.json`) and a sample of its text as token windows (`drift_sample.safetensors`:
`DriftReference.CHUNKS` windows of `CHUNK_LEN` tokens cut from a held-out half of the training
documents, the other half's histogram beside them).

The statistic is the Jensen-Shannon divergence (bits, in [0, 1]) between the histogram of recent
prompts' tokens and the training histogram (of the half of the documents the null's excerpts are not
cut from, so live text and null excerpts are compared with the same thing), over the last 25, 100 and 500 requests (`scales`). A fixed
threshold cannot work: a few short prompts sit far from the corpus's histogram just because they are
few and bursty. So every judgement is a Monte Carlo test against a null of *request-shaped* samples of
held-out training text, built for the window being judged: each distinct live prompt is replaced by an
excerpt of held-out text of the same length, a prompt repeated in the window is replaced by the same
excerpt repeated (a smoke test of one prompt sent 40 times is one sample, not 40), and the tokens a chat
template wraps around a turn (`framing`) are kept verbatim around the excerpt. `null_draws` such windows
give each scale's null divergences; the alarm threshold is a quantile of the null's **maximum over all
scales at once** (ranks per scale, the minimum rank per draw: a max-statistic correction for testing
several windows together), chosen so that in-distribution traffic of the same shape alarms in at most
`false_alarm_rate` of judgements (default 1%). The rate is per judgement; an event further needs the
drift to hold over `--drift-sustain` requests (serve/watch.py).

No judgement before `warmup` requests (default 50: a smoke test is not judged) and a window of at least
`min_requests`. Prompt length is not judged: requests are not documents, and the server's own first
requests are no baseline. A report names, for its worst window, the tokens that moved the divergence most
and the prompts most unlike training (PII-scrubbed, cut short).
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from runyard.data.loader import SplitDocuments
from runyard.data.pii import scrub_pii
from runyard.spec.data import PiiSpec
from runyard.system.files import atomic_write_text

REFERENCE_FILE = "drift_reference.json"
SAMPLE_FILE = "drift_sample.safetensors"
DRIFT_FILES = (REFERENCE_FILE, SAMPLE_FILE)  # what `DriftReference.save` writes (the sample when it has one)
DEFAULT_FALSE_ALARM_RATE = 0.01  # per judgement, on in-distribution traffic
# Null windows per judgement, at least 2 x scales / rate: the rate's share of the draws must hold more
# than each scale's own maximum, or no cut is left (at 199 draws and 3 scales nothing could ever alarm).
NULL_DRAWS = 599
NULL_REFRESH = 0.1  # a scale's null is redrawn once this share of its window has changed
EXAMPLE_TOKENS, EXAMPLE_PROMPTS, EXAMPLE_CHARS = 10, 3, 160  # what a report shows of what moved
NULL_BATCH_TOKENS = 1 << 20  # tokens gathered at once when drawing null samples
PSI_FLOOR = 1e-4  # empty buckets count as this share, the usual PSI convention, so it stays finite


def _proportions(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(-1, keepdims=True)
    return np.divide(counts, total, out=np.full_like(counts, 1.0 / counts.shape[-1]), where=total > 0)


def js_divergence(p_counts: np.ndarray, q_counts: np.ndarray) -> np.ndarray | float:
    """Jensen-Shannon divergence in bits between count vectors (the last axis; q may be a batch
    [B, V] against one p). Finite without smoothing: the mixture is positive wherever either side is."""
    p, q = _proportions(p_counts), _proportions(q_counts)
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> np.ndarray:
        ratio = np.divide(a, m, out=np.ones_like(a * m), where=a > 0)
        return np.sum(np.where(a > 0, a * np.log2(ratio), 0.0), axis=-1)

    out = 0.5 * kl(np.broadcast_to(p, q.shape) if q.ndim > p.ndim else p) + 0.5 * kl(q)
    return float(out) if np.ndim(out) == 0 else out


def js_rows(reference_probs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """`js_divergence` of the reference against each row's token histogram, for token rows [n, T] (equal
    lengths), touching only the tokens present: a token the row lacks adds half its reference share, so
    JS = (1 - covered) / 2 + the present tokens' terms, without a [n, vocab] histogram."""
    n, length = tokens.shape
    if length == 0:
        return np.zeros(n)
    vocab = len(reference_probs)
    keys = np.sort(tokens, axis=1) + (np.arange(n, dtype=np.int64) * vocab)[:, None]
    keys = keys.ravel()
    first = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    counts = np.diff(np.r_[first, len(keys)])
    rows, token = np.divmod(keys[first], vocab)
    q = counts / length
    p = reference_probs[token]
    m = 0.5 * (p + q)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log2(p / m), 0.0) + q * np.log2(q / m)
    covered = np.bincount(rows, weights=p, minlength=n)
    return 0.5 * (1.0 - covered) + 0.5 * np.bincount(rows, weights=terms, minlength=n)


def psi(expected_counts: np.ndarray, actual_counts: np.ndarray) -> float:
    """Population stability index between two histograms."""
    e = np.maximum(_proportions(expected_counts), PSI_FLOOR)
    a = np.maximum(_proportions(actual_counts), PSI_FLOOR)
    return float(np.sum((a - e) * np.log(a / e)))


@dataclass(frozen=True)
class DriftReference:
    """The training distribution, and what its own samples look like.

    `token_counts`: the whole training split's histogram, that live prompts are compared with.
    `null_counts` and `chunks`: the training documents split at random into two halves; the first
    half's histogram, and token windows cut from the second half. A null sample is cut from the
    windows and compared with the first half's histogram, so it measures how far *unseen documents of
    the training kind* sit from a histogram of other documents (windows cut from the very documents a
    histogram counts would sit closer than new text ever does)."""

    token_counts: np.ndarray
    null_counts: np.ndarray | None = None
    chunks: np.ndarray | None = None

    CHUNKS = 512
    CHUNK_LEN = 256
    MAX_SAMPLE_TOKENS = 4_000_000  # per half: enough for a stable histogram, bounded for big corpora

    def save(self, export_dir: Path) -> Path:
        export_dir = Path(export_dir)
        path = export_dir / REFERENCE_FILE
        if self.chunks is not None:
            tmp = export_dir / f".{SAMPLE_FILE}.tmp"
            save_file({"chunks": np.ascontiguousarray(self.chunks, dtype=np.int32)}, str(tmp))
            tmp.replace(export_dir / SAMPLE_FILE)
        data = {"token_counts": [int(c) for c in self.token_counts]}
        if self.null_counts is not None:
            data["null_counts"] = [int(c) for c in self.null_counts]
        atomic_write_text(path, json.dumps(data))
        return path

    @classmethod
    def load(cls, export_dir: Path) -> DriftReference | None:
        """The reference saved with an export, or None (an export made without one)."""
        export_dir = Path(export_dir)
        path = export_dir / REFERENCE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        counts = np.asarray(data["token_counts"], dtype=np.int64)
        null_counts = np.asarray(data["null_counts"], dtype=np.int64) if "null_counts" in data else None
        chunks = None
        if (export_dir / SAMPLE_FILE).is_file():
            chunks = load_file(str(export_dir / SAMPLE_FILE))["chunks"].astype(np.int64)
        return cls(counts, null_counts, chunks)

    @classmethod
    def from_documents(cls, token_counts: np.ndarray, documents: Sequence[np.ndarray], seed: int) -> DriftReference:
        """Split `documents` (token arrays of the training split) into two random halves: the first's
        histogram, and `CHUNKS` windows of `CHUNK_LEN` tokens from the second."""
        vocab = len(token_counts)
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(documents))
        halves: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
        sizes = [0, 0]
        for i in order:
            side = 0 if sizes[0] <= sizes[1] else 1  # balance the halves by tokens
            if sizes[side] < cls.MAX_SAMPLE_TOKENS:
                halves[side].append(np.asarray(documents[i], dtype=np.int64))
                sizes[side] += len(documents[i])
        if not halves[1]:  # a single document: no unseen half to sample, so the histogram alone
            return cls(np.asarray(token_counts, dtype=np.int64))
        first, second = np.concatenate(halves[0]), np.concatenate(halves[1])
        null_counts = np.bincount(first[(first >= 0) & (first < vocab)], minlength=vocab)[:vocab]
        length = min(cls.CHUNK_LEN, len(second))
        starts = rng.integers(0, len(second) - length + 1, size=cls.CHUNKS)
        chunks = second[starts[:, None] + np.arange(length)]
        return cls(np.asarray(token_counts, dtype=np.int64), null_counts, chunks)


def training_documents(train_index: Path) -> SplitDocuments:
    """The documents of a token store split, as token arrays read on demand (shard boundaries joined)."""
    return SplitDocuments(Path(train_index))


def build_reference(token_counts: np.ndarray, train_index: Path, seed: int) -> DriftReference:
    """The drift reference of a run's training split (its token-store index), saved with the export."""
    return DriftReference.from_documents(token_counts, training_documents(train_index), seed)


@dataclass(frozen=True)
class WindowReport:
    requests: int
    tokens: int
    token_js: float
    token_js_threshold: float  # this scale's share of the max-statistic threshold

    @property
    def ratio(self) -> float:
        return self.token_js / self.token_js_threshold if self.token_js_threshold > 0 else float("inf")


@dataclass(frozen=True)
class DriftReport:
    requests_seen: int
    windows: tuple[WindowReport, ...]
    drifting: bool
    false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE
    null_draws: int = 0
    distinct_prompts: int = 0  # in the largest window judged
    moved_tokens: tuple[dict, ...] = ()  # the worst window's tokens with the largest JS contribution
    divergent_prompts: tuple[dict, ...] = ()  # the worst window's prompts least like training
    reason: str | None = None  # why nothing was judged (warm-up, too few requests)

    @property
    def worst(self) -> WindowReport | None:
        """The window furthest past (or closest to) its threshold."""
        if not self.windows:
            return None
        return max(self.windows, key=lambda w: w.ratio)


@dataclass(frozen=True)
class _Prompt:
    ids: np.ndarray
    prefix: int  # framing tokens at the start (a chat template's), kept verbatim in the null
    suffix: int
    text: str | None


def token_contributions(reference_counts: np.ndarray, live_counts: np.ndarray) -> np.ndarray:
    """Each token's term of JS(reference, live) in bits (non-negative; they sum to the divergence)."""
    p, q = _proportions(reference_counts), _proportions(live_counts)
    m = 0.5 * (p + q)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(p > 0, p * np.log2(np.where(p > 0, p, 1) / np.where(m > 0, m, 1)), 0.0)
        b = np.where(q > 0, q * np.log2(np.where(q > 0, q, 1) / np.where(m > 0, m, 1)), 0.0)
    return 0.5 * (a + b)


def _scrubbed(text: str, limit: int = EXAMPLE_CHARS) -> str:
    clean = scrub_pii(text, PiiSpec(), Counter())
    return clean if len(clean) <= limit else clean[:limit] + "..."


class DriftMonitor:
    """A thread-safe sliding window over recent prompts, judged against the training distribution."""

    def __init__(
        self,
        reference: DriftReference,
        scales: tuple[int, ...] = (25, 100, 500),
        min_requests: int = 20,
        warmup: int = 50,
        false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE,
        null_draws: int | None = None,
        framing: tuple[Sequence[int], Sequence[int]] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        seed: int = 0,
    ):
        if min_requests < 2 or not scales or min(scales) < min_requests:
            raise ValueError("scales must be >= min_requests >= 2")
        if not 0 < false_alarm_rate < 0.5:
            raise ValueError(f"false_alarm_rate must be in (0, 0.5), got {false_alarm_rate}")
        self.reference = reference
        self.vocab = len(reference.token_counts)
        self.scales = tuple(sorted(scales))
        self.min_requests, self.warmup, self.false_alarm_rate = min_requests, max(warmup, min_requests), false_alarm_rate
        # A Monte Carlo test at rate a needs draws whose a-quantile is above the smallest draw.
        self.null_draws = null_draws or max(NULL_DRAWS, math.ceil(2 * len(self.scales) / false_alarm_rate) - 1)
        if self.null_draws * false_alarm_rate < len(self.scales):
            raise ValueError(f"{self.null_draws} null draws cannot resolve a false-alarm rate of {false_alarm_rate}")
        self.framing = (np.asarray(framing[0], dtype=np.int64), np.asarray(framing[1], dtype=np.int64)) if framing else None
        self.decode = decode
        self.window: deque[_Prompt] = deque(maxlen=self.scales[-1])
        self.seen = 0
        self._rng = np.random.default_rng(seed)
        # Live prompts and null excerpts are both compared with the same histogram (the half of the
        # documents the excerpts are not cut from), so held-out text of the training kind is exchangeable
        # with the null draws and the stated rate is exact rather than only an upper bound.
        self._compare = reference.null_counts if reference.null_counts is not None else reference.token_counts
        self._null_probs = _proportions(self._compare)
        chunks = reference.chunks
        if chunks is None or chunks.shape[1] == 0:
            # An export without the sample: i.i.d. draws from the histogram (less bursty than text, so
            # the thresholds are lower and this alarms sooner).
            probs = _proportions(reference.token_counts)
            chunks = self._rng.choice(self.vocab, size=(DriftReference.CHUNKS, DriftReference.CHUNK_LEN), p=probs)
        self._chunks = chunks
        self._null_cache: dict[int, tuple[int, np.ndarray]] = {}  # scale: (requests seen when drawn, its draws)
        self._lock = threading.Lock()
        self._judging = threading.Lock()  # the null draws share one RNG and the cache

    def _framed(self, ids: np.ndarray) -> tuple[int, int]:
        if self.framing is None:
            return 0, 0
        pre, suf = self.framing
        if len(ids) < len(pre) + len(suf):
            return 0, 0
        if np.array_equal(ids[: len(pre)], pre) and (not len(suf) or np.array_equal(ids[len(ids) - len(suf) :], suf)):
            return len(pre), len(suf)
        return 0, 0

    def observe(self, token_ids: list[int], text: str | None = None) -> None:
        ids = np.asarray(token_ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < self.vocab)]
        prefix, suffix = self._framed(ids)
        with self._lock:
            self.window.append(_Prompt(ids, prefix, suffix, text))
            self.seen += 1

    def report(self) -> DriftReport:
        with self._lock:
            recent = list(self.window)
            seen = self.seen
        rate = self.false_alarm_rate
        if seen < self.warmup or len(recent) < self.min_requests:
            reason = (f"warming up: {seen} of {self.warmup} requests seen" if seen < self.warmup
                      else f"{len(recent)} requests in the window, fewer than {self.min_requests}")
            return DriftReport(seen, (), False, rate, self.null_draws, reason=reason)
        sizes = sorted({min(s, len(recent)) for s in self.scales})
        with self._judging:
            return self._judge(recent, sizes, seen)

    def _judge(self, recent: list[_Prompt], sizes: list[int], seen: int) -> DriftReport:
        lengths = np.array([len(p.ids) for p in recent], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])  # token offset of each prompt, laid end to end
        live_tokens = np.concatenate([p.ids for p in recent]) if lengths.sum() else np.zeros(0, dtype=np.int64)
        live_counts = [np.bincount(live_tokens[starts[len(recent) - k] :], minlength=self.vocab)[: self.vocab]
                       for k in sizes]
        live = np.array([float(js_divergence(self._compare, c)) if c.sum() else 0.0 for c in live_counts])
        null = self._null(recent, sizes, seen)  # [draws, scales]
        # Max-statistic correction: rank each draw per scale (1 = largest), take its best rank over the
        # scales, and find the rank cut `c` that at most rate x draws reach; a scale's threshold is its
        # c-th largest null value, and the live window alarms when any scale passes its threshold.
        draws = len(null)
        ranks = draws - np.argsort(np.argsort(null, axis=0), axis=0)
        best = ranks.min(axis=1)
        allowed = int(math.floor(self.false_alarm_rate * draws))
        cut = 0
        for c in range(1, draws + 1):
            if int((best <= c).sum()) > allowed:
                break
            cut = c
        ordered = np.sort(null, axis=0)[::-1]
        thresholds = ordered[cut - 1] if cut >= 1 else ordered[0]
        windows = tuple(
            WindowReport(k, int(lengths[len(recent) - k :].sum()), round(float(v), 6), round(float(t), 6))
            for k, v, t in zip(sizes, live, thresholds, strict=True)
        )
        drifting = bool(cut >= 1 and np.any(live > thresholds))
        worst_i = max(range(len(sizes)), key=lambda i: windows[i].ratio)
        tokens, prompts = self._what_moved(recent[len(recent) - sizes[worst_i] :], live_counts[worst_i])
        distinct = len({p.ids.tobytes() for p in recent})
        return DriftReport(seen, windows, drifting, self.false_alarm_rate, draws, distinct, tokens, prompts)

    def _null(self, recent: list[_Prompt], sizes: list[int], seen: int) -> np.ndarray:
        """JS divergence of `null_draws` request-shaped windows of held-out text per scale: [draws, scales].

        Each scale's draws are its own (the smaller windows are not cut from the larger ones' draws):
        pairing independent columns makes the max-statistic cut stricter than the nested live windows
        need, so the rate stays an upper bound, and it lets a large window's null be kept while less
        than `NULL_REFRESH` of that window has changed (a 500-request null costs ~20x a 25-request one;
        it is redrawn every 50 requests, not every 5)."""
        columns = []
        for k in sizes:
            cached = self._null_cache.get(k)
            if cached is None or seen - cached[0] >= max(1, int(k * NULL_REFRESH)):
                cached = (seen, self._null_scale(recent[len(recent) - k :]))
                self._null_cache[k] = cached
            columns.append(cached[1])
        return np.stack(columns, axis=1)

    def _null_scale(self, recent: list[_Prompt]) -> np.ndarray:
        """JS divergence of `null_draws` request-shaped windows shaped like `recent`: [draws]."""
        chunks = self._chunks
        chunk_len = chunks.shape[1]
        groups: dict[bytes, int] = {}
        group_len: list[int] = []
        fixed_ids, grp, within = [], [], []  # per token of the null window: a verbatim id, or (group, position)
        for p in recent:
            content = min(len(p.ids) - p.prefix - p.suffix, chunk_len)
            g = groups.setdefault(p.ids.tobytes(), len(groups))
            if g == len(group_len):
                group_len.append(content)
            pieces = [(p.ids[: p.prefix], -1), (np.arange(content), g), (p.ids[len(p.ids) - p.suffix :], -1)]
            for values, group in pieces:
                fixed_ids.extend(values.tolist() if group < 0 else [0] * len(values))
                grp.extend([group] * len(values))
                within.extend([0] * len(values) if group < 0 else values.tolist())
        total = len(fixed_ids)
        fixed = np.asarray(grp, dtype=np.int64) < 0
        fixed_ids_a, grp_a, within_a = (np.asarray(a, dtype=np.int64) for a in (fixed_ids, grp, within))
        grp_a[fixed] = 0
        room = chunk_len - np.asarray(group_len, dtype=np.int64) + 1
        flat_chunks = chunks.reshape(-1)
        # Long windows over a small vocabulary: a dense [draws, vocab] histogram is cheaper than sorting.
        dense = self.vocab <= 2 * total
        per_batch = max(1, NULL_BATCH_TOKENS // max(1, total, self.vocab if dense else 0))  # bounds one batch's memory
        out = []
        for start in range(0, self.null_draws, per_batch):
            n = min(per_batch, self.null_draws - start)
            rows = self._rng.integers(0, len(chunks), size=(n, len(group_len)))
            base = rows * chunk_len + (self._rng.random((n, len(group_len))) * room).astype(np.int64)
            tokens = np.where(fixed, fixed_ids_a, flat_chunks[base[:, grp_a] + within_a])
            if dense:
                flat = (np.arange(n)[:, None] * self.vocab + tokens).ravel()
                hist = np.bincount(flat, minlength=n * self.vocab).reshape(n, self.vocab)
                out.append(np.atleast_1d(js_divergence(self._compare, hist)))
            else:
                out.append(js_rows(self._null_probs, tokens))
        return np.concatenate(out)

    def _what_moved(self, prompts: list[_Prompt], live_counts: np.ndarray) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
        """The tokens with the largest JS contribution, and the distinct prompts whose tokens are most
        over-represented against training (mean log2 ratio of window share to training share)."""
        reference = self._compare  # the histogram the divergence was taken against: the contributions sum to it
        contrib = token_contributions(reference, live_counts)
        live_share, ref_share = _proportions(live_counts), _proportions(reference)
        tokens = []
        for t in np.argsort(-contrib)[:EXAMPLE_TOKENS]:
            if contrib[t] <= 0:
                break
            entry = {"token_id": int(t), "contribution_bits": round(float(contrib[t]), 6),
                     "live_share": round(float(live_share[t]), 6), "training_share": round(float(ref_share[t]), 6)}
            if self.decode is not None:
                entry["text"] = self.decode([int(t)])
            tokens.append(entry)
        eps = 1.0 / max(1, int(reference.sum()))
        log_ratio = np.log2((live_share + eps) / (ref_share + eps))
        scored: dict[bytes, tuple[float, _Prompt, int]] = {}
        for p in prompts:
            key = p.ids.tobytes()
            if key in scored:
                score, first, count = scored[key]
                scored[key] = (score, first, count + 1)
            elif len(p.ids):
                scored[key] = (float(log_ratio[p.ids].mean()), p, 1)
        top = sorted(scored.values(), key=lambda s: -s[0])[:EXAMPLE_PROMPTS]
        examples = []
        for score, p, count in top:
            text = p.text if p.text is not None else (self.decode(p.ids.tolist()) if self.decode else None)
            examples.append({"text": None if text is None else _scrubbed(text), "tokens": len(p.ids),
                             "times_in_window": count, "mean_log2_ratio": round(score, 4)})
        return tuple(tokens), tuple(examples)
