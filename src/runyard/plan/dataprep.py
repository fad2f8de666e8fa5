"""What the data is, and how long its preparation will take, measured on a sample of it.

For text (a language model's data) the sample runs through the data stage's own steps: `clean_part`
(read, normalise, filter, PII, hashes, MinHash), `train_bpe` at the spec's vocabulary on half the sample
and on all of it (a straight line through the two extrapolates to the text the tokenizer will train on,
capped by `train_max_bytes`), and `encode_batch_fast` (bytes per token, and the encoding rate). Each rate
then scales to the whole corpus: cleaning runs in `min(workers, cores)` processes, hashing the inputs for
the fingerprint at the measured sha256 rate. Deduplication (hashes and signatures only) is not timed.

When the dataset is already prepared in the cache (the run's own fingerprint finds it), preparation is
just that fingerprint, timed here for real, and the facts (tokens, vocabulary) are the prepared ones.

Tables and images are read and checked by the run's own readers (plan/task_data.py), so the plan sees the
rows, features, classes and image shape the run will, and refuses (exit 2) the data the run would; their
preparation is that reading, timed (with or without calibration: the checks read everything anyway).
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from runyard.data.budget import MemoryBudget
from runyard.data.clean import clean_part
from runyard.data.footprint import COMPRESSION_RATIO
from runyard.data.partstore import PartReader
from runyard.data.pipeline import dataset_fingerprint, fingerprint_inputs, load_prepared, resolve_cache_dir
from runyard.data.sources import InputFile, read_bytes
from runyard.data.tokenize import cpu_count
from runyard.data.tokenizer import train_bpe
from runyard.plan.recommend import DATA_KINDS, DataFacts
from runyard.plan.task_data import check_task_data
from runyard.spec.data import DataSpec

SAMPLE_BYTES = 512 << 10  # text run through the data stage's steps to time them
FINGERPRINT_LIMIT = 256 << 20  # a corpus up to this size is fingerprinted for real to find a cached copy
STATED_BYTES_PER_TOKEN = 3.5  # when nothing could be measured (byte-level BPE on English and code)
POOL_START_S = 0.5  # starting the cleaning processes, stated
REPORT_S = 1.0  # the data report and its plots, stated
# Bytes/s of each step without a measurement (2 CPU cores of a 2020s x86 server, stdlib-like text).
STATED_RATES = {"sha256": 500e6, "clean": 4e6, "bpe": 4e6, "encode": 2e6, "read": 200e6}


@dataclass(frozen=True)
class DataEstimate:
    """The data's facts and how long preparing it takes here."""

    facts: DataFacts
    seconds: float
    parts: dict[str, float]
    how: str
    cached: bool
    bytes_per_token: float | None = None
    kept_fraction: float = 1.0
    text_bytes: int = 0  # text the preparation holds in memory after cleaning
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "facts": {k: v for k, v in vars(self.facts).items() if k != "extra"},
            "seconds": self.seconds,
            "parts": self.parts,
            "how": self.how,
            "cached": self.cached,
            "bytes_per_token": self.bytes_per_token,
            "kept_fraction": self.kept_fraction,
        }


def _text_bytes(spec: DataSpec, f: InputFile) -> int:
    source = spec.sources[f.source]
    compressed = source.compression in ("gzip", "zstd") or (
        source.compression == "infer" and f.path.endswith((".gz", ".zst", ".zstd")))
    return f.size * (COMPRESSION_RATIO if compressed else 1)


def estimate_data(task: str, spec: DataSpec, seed: int, files: list[InputFile], cores: int,
                  cache_dir: Path | None = None, measure: bool = True) -> DataEstimate:
    """Facts and preparation time of `files` for `task` (see the module doc). `measure=False` times
    nothing of a text corpus and takes the stated rates in STATED_RATES."""
    kind = DATA_KINDS[task]
    if kind == "text":
        return _estimate_text(spec, seed, files, cores, cache_dir, measure)
    return _estimate_other(task, kind, spec, seed, files)


def _estimate_text(spec: DataSpec, seed: int, files: list[InputFile], cores: int, cache_dir: Path | None,
                   measure: bool) -> DataEstimate:
    total = sum(_text_bytes(spec, f) for f in files)
    raw = sum(f.size for f in files)
    if raw <= FINGERPRINT_LIMIT:
        t0 = time.perf_counter()
        inputs = fingerprint_inputs(spec, files)
        fingerprint_s = time.perf_counter() - t0
        root = resolve_cache_dir(spec, cache_dir)
        prepared = load_prepared(root / "datasets" / dataset_fingerprint(spec, seed, inputs)[:32])
        if prepared is not None:
            split = prepared.stats.get("split", {})
            tokens = sum(split.get(s, {}).get("tokens", 0) for s in ("train", "heldout"))
            facts = DataFacts("text", len(files), total, rows=sum(split.get(s, {}).get("documents", 0)
                                                                  for s in ("train", "heldout")),
                              tokens=tokens, vocab_size=prepared.vocab_size,
                              extra={"train_tokens": split.get("train", {}).get("tokens", 0),
                                     "heldout_tokens": split.get("heldout", {}).get("tokens", 0)})
            kept = sum(split.get(s, {}).get("bytes", 0) for s in ("train", "heldout"))
            return DataEstimate(facts, fingerprint_s, {"fingerprint": fingerprint_s},
                                f"prepared already in {prepared.dataset_dir}: only its fingerprint, timed",
                                True, kept / max(1, tokens), kept / max(1, total), kept)
    else:
        fingerprint_s = None
    if not measure:
        return _stated_text(spec, files, total, cores, fingerprint_s)
    with tempfile.TemporaryDirectory(prefix="runyard-plan-") as tmp:
        sample = _sample_files(spec, files, Path(tmp))
        return _calibrated_text(spec, files, sample, total, cores, fingerprint_s)


def _sample_files(spec: DataSpec, files: list[InputFile], tmp: Path) -> list[InputFile]:
    """About SAMPLE_BYTES of the corpus: whole files taken at an even stride, or, for one file larger than
    the sample, its first lines copied to `tmp` (text and JSONL; compressed and Parquet files whole)."""
    if not files:
        return []
    total = sum(f.size for f in files)
    wanted = max(1, math.ceil(len(files) * SAMPLE_BYTES / max(1, total)))  # files of average size
    stride = max(1, len(files) // wanted)
    chosen: list[InputFile] = []
    size = 0
    for f in files[::stride]:
        if size >= SAMPLE_BYTES:
            break
        if f.size > 2 * SAMPLE_BYTES and _cuttable(spec, f):
            f = _head_copy(f, tmp, SAMPLE_BYTES - size)
        chosen.append(f)
        size += f.size
    return chosen


def _cuttable(spec: DataSpec, f: InputFile) -> bool:
    source = spec.sources[f.source]
    return (source.format in ("text", "jsonl") and source.compression in ("infer", "none")
            and not f.path.endswith((".gz", ".zst", ".zstd")) and "://" not in f.path)


def _head_copy(f: InputFile, tmp: Path, nbytes: int) -> InputFile:
    with open(f.path, "rb") as src:
        head = src.read(max(4096, nbytes))
    cut = head.rfind(b"\n")
    head = head[: cut + 1] if cut > 0 else head
    path = tmp / f"sample-{len(os.listdir(tmp))}{Path(f.path).suffix}"
    path.write_bytes(head)
    return InputFile(f.source, str(path), len(head))


def _calibrated_text(spec: DataSpec, files: list[InputFile], sample: list[InputFile], total: int, cores: int,
                     fingerprint_s: float | None) -> DataEstimate:
    sample_bytes = sum(_text_bytes(spec, f) for f in sample)
    t0 = time.perf_counter()
    for f in sample:
        hashlib.sha256(read_bytes(f.path)).digest()
    hash_rate = sum(f.size for f in sample) / max(time.perf_counter() - t0, 1e-6)

    budget = MemoryBudget.for_array_task(int(spec.memory_limit))
    with tempfile.TemporaryDirectory(prefix="runyard-plan-clean-") as parts_dir:
        clean_part(sample[:1], spec, Path(parts_dir) / "warm-up", budget)  # first-call costs (regex, MinHash tables)
        t0 = time.perf_counter()
        clean_part(sample, spec, Path(parts_dir) / "sample", budget)
        clean_rate = sample_bytes / max(time.perf_counter() - t0, 1e-6)
        part = PartReader(Path(parts_dir) / "sample")
        texts = part.texts(0, part.n_docs)
    kept = sum(len(t.encode("utf-8")) for t in texts)
    kept_fraction = kept / max(1, sample_bytes)

    train_bytes = min(int(total * kept_fraction * (1 - spec.heldout_fraction)), spec.tokenizer.train_max_bytes)
    if spec.tokenizer.path is None and kept > 0:
        half = _head_texts(texts, kept // 2)
        t_half = _time(lambda: train_bpe(half, spec.tokenizer.vocab_size, spec.tokenizer.min_frequency, kept))
        t0 = time.perf_counter()
        tok = train_bpe(texts, spec.tokenizer.vocab_size, spec.tokenizer.min_frequency, kept)
        t_full = time.perf_counter() - t0
        slope = max(0.0, (t_full - t_half) / max(1, kept - sum(len(t.encode("utf-8")) for t in half)))
        slope = slope or t_full / kept
        tokenizer_s = max(t_full, t_full + slope * (train_bytes - kept))
    else:
        tok = None
        tokenizer_s = 0.0
    if tok is not None and texts:
        t0 = time.perf_counter()
        encodings = tok.encode_batch_fast(texts)
        encode_rate = kept / max(time.perf_counter() - t0, 1e-6)
        bytes_per_token = kept / max(1, sum(len(e.ids) + 1 for e in encodings))
        how_tokens = "measured on the sample with a tokenizer trained on it"
    else:
        encode_rate, bytes_per_token = 2e6, STATED_BYTES_PER_TOKEN
        how_tokens = f"stated {STATED_BYTES_PER_TOKEN} bytes/token"
    workers = max(1, min(spec.workers or cpu_count(), len(files), cores))
    kept_total = int(total * kept_fraction)
    parts = {
        "fingerprint": fingerprint_s if fingerprint_s is not None else sum(f.size for f in files) / hash_rate,
        "clean": total / clean_rate / workers + (POOL_START_S if workers > 1 else 0.0),
        "tokenizer": tokenizer_s,
        "tokenize": kept_total / encode_rate,
        "report": REPORT_S,
    }
    tokens = int(kept_total / bytes_per_token)
    heldout = int(tokens * spec.heldout_fraction)
    facts = DataFacts("text", len(files), total, rows=None, tokens=tokens,
                      vocab_size=None, extra={"train_tokens": tokens - heldout, "heldout_tokens": heldout})
    how = (f"calibrated on a {sample_bytes / 1e6:.2f} MB sample ({len(sample)} files) through the data stage's own "
           f"steps, {workers} cleaning process{'es' if workers > 1 else ''}; tokens {how_tokens}")
    return DataEstimate(facts, sum(parts.values()), parts, how, False, bytes_per_token, kept_fraction, kept_total)


def _stated_text(spec: DataSpec, files: list[InputFile], total: int, cores: int,
                 fingerprint_s: float | None) -> DataEstimate:
    """The text estimate at STATED_RATES, nothing measured (`plan --no-calibrate`)."""
    r = STATED_RATES
    workers = max(1, min(spec.workers or cpu_count(), len(files), cores))
    train_bytes = min(int(total * (1 - spec.heldout_fraction)), spec.tokenizer.train_max_bytes)
    parts = {
        "fingerprint": fingerprint_s if fingerprint_s is not None else sum(f.size for f in files) / r["sha256"],
        "clean": total / r["clean"] / workers,
        "tokenizer": 0.0 if spec.tokenizer.path else train_bytes / r["bpe"],
        "tokenize": total / r["encode"],
        "report": REPORT_S,
    }
    tokens = int(total / STATED_BYTES_PER_TOKEN)
    heldout = int(tokens * spec.heldout_fraction)
    facts = DataFacts("text", len(files), total, tokens=tokens,
                      extra={"train_tokens": tokens - heldout, "heldout_tokens": heldout})
    how = "stated rates (nothing measured): " + ", ".join(f"{k} {v / 1e6:g} MB/s" for k, v in r.items())
    return DataEstimate(facts, sum(parts.values()), parts, how, False, STATED_BYTES_PER_TOKEN, 1.0, total)


def _head_texts(texts: list[str], nbytes: int) -> list[str]:
    out, size = [], 0
    for t in texts:
        if size >= nbytes:
            break
        out.append(t)
        size += len(t.encode("utf-8"))
    return out


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _estimate_other(task: str, kind: str, spec: DataSpec, seed: int, files: list[InputFile]) -> DataEstimate:
    """Tables and images: read and checked by the run's own readers (plan/task_data.py; DataRefused, exit
    2, for data the run would refuse), their facts as the run will see them; preparation is that reading,
    timed here, and the data report."""
    checked = check_task_data(task, spec, seed)
    s = checked.summary
    facts = DataFacts(kind, len(files), sum(f.size for f in files), rows=s.rows, features=s.features,
                      classes=s.classes, image_shape=s.image_shape)
    how = "the run's own reader and checks on every row, timed here; the report stated"
    return DataEstimate(facts, checked.seconds + REPORT_S, {"read": checked.seconds, "report": REPORT_S}, how, False,
                        text_bytes=s.bytes or sum(f.size for f in files),
                        extra={"data": checked.stats, "table": checked.table})


def with_vocab(estimate: DataEstimate, vocab_size: int) -> DataEstimate:
    """The estimate with the vocabulary a plan sizes with (the prepared one, or the spec's request)."""
    if estimate.facts.vocab_size is not None:
        return estimate
    return replace(estimate, facts=replace(estimate.facts, vocab_size=vocab_size))
