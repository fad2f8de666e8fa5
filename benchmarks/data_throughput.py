"""Data-stage throughput and quality against named peers, each measured in this run on the same corpus.

Corpus: the running interpreter's stdlib .py files (tests excluded), plus planted near-copies of 300 large
files: 150 with 1 % of their words replaced (true Jaccard ~0.9: duplicates at threshold 0.8) and 150 with
4 % replaced (~0.7: hard negatives).

1. Near-duplicate signatures (128 hashes, word 5-grams), MB/s, every contender the same number of
   interleaved repeats, one process each:
   - runyard `signatures` (its compiled kernel, numba, which a prepare switches to after 64 MB of text),
     and its numpy path (what a process runs before it switches; the same bits), with the kernel's load
     in a fresh process;
   - datasketch MinHash (num_perm=128, update_batch), the shingles built by the same word regex;
   - datatrove's MinhashDedupSignature step at 16 buckets x 8 hashes (128), as shipped: spaCy word
     tokenizer, signatures written to disk;
   - datatrove at its fastest: the same step given a whitespace `str.split` WordTokenizer (its documented
     hook for custom tokenizers) and an in-memory output folder.
   Quality: precision and recall of each tool's own decision (runyard: clusters at Jaccard 0.8, pairs near
   the threshold checked exactly against the texts, as the data stage does;
   datasketch: MinHashLSH(threshold=0.8) queries; datatrove: documents sharing any whole bucket, then
   clustered, as its buckets+cluster steps do) against one ground truth: the exact Jaccard similarity
   of word 5-gram sets (>= 0.8) of every planted pair and every pair any tool reported.
2. Tokenization, MB/s: runyard's tokenize (chunks in 2 overlapping threads) + shard writing, against
   `tokenizers` `encode_batch_fast` (the call runyard makes) over the same chunks in the same 2 threads,
   and against one `encode_batch_fast` call over the whole corpus.
3. Loader, tokens/s: runyard's TokenLoader as training runs it (no prefetch) against nanoGPT's
   `get_batch` (random windows of a np.memmap stacked into tensors) over the same shard.

Run: python benchmarks/data_throughput.py [--max-mb 30] [--repeats 3] [--record]
Needs the `bench` extra (datasketch, datatrove, spacy).
"""

from __future__ import annotations

import argparse
import functools
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, Samples, add_common_args, interleaved, paired_ratio  # noqa: E402

from runyard.data.dedup import near_duplicates  # noqa: E402
from runyard.data.loader import TokenLoader  # noqa: E402
from runyard.data.minhash import KERNEL_AFTER_CHARS, signatures  # noqa: E402
from runyard.data.shards import load_index, open_shard  # noqa: E402
from runyard.data.tokenize import assemble_shards, chunk_ranges, tokenize_chunks  # noqa: E402
from runyard.data.tokenizer import eos_id, train_bpe  # noqa: E402

WORD = re.compile(r"[A-Za-z0-9_\x80-\U0010ffff]+")
THRESHOLD = 0.8
NUM_PERM, NGRAM = 128, 5
NUMPY_PATH = "runyard (numpy path)"


def load_corpus(max_mb: float) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("/test/", "/tests/", "/idle_test/", "/site-packages/")
    texts, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if any(s in str(path) for s in skip):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size > max_mb * 1e6:
            break
    return texts


def plant(texts: list[str], plan: list[tuple[int, float]], seed: int = 0) -> tuple[list[str], list[tuple[int, int]]]:
    """For each (count, rate) append `count` near-copies of distinct large files with a `rate` fraction of
    their words replaced; returns the new corpus and the (original, copy) index pairs."""
    rng = random.Random(seed)
    candidates = [i for i, t in enumerate(texts) if len(t) > 3000]
    want = sum(n for n, _ in plan)
    chosen = rng.sample(candidates, min(want, len(candidates)))
    out, pairs = list(texts), []
    for n, rate in plan:
        n = n * len(chosen) // want if want > len(candidates) else n  # a small corpus: scaled down alike
        for i in chosen[:n]:
            spans = [m.span() for m in WORD.finditer(texts[i])]
            text = texts[i]
            for a, b in sorted(rng.sample(spans, max(1, int(rate * len(spans)))), reverse=True):
                text = text[:a] + f"edit{rng.randrange(10**6)}" + text[b:]
            pairs.append((i, len(out)))
            out.append(text)
        chosen = chosen[n:]
    return out, pairs


# -- ground truth ------------------------------------------------------------------------------------------


class Truth:
    """Exact Jaccard similarity of two documents' word 5-gram sets, cached per document."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    @functools.cache  # noqa: B019  (one Truth per run; the cache is the point)
    def shingles(self, i: int) -> frozenset:
        words = WORD.findall(self.texts[i].lower())
        return frozenset(" ".join(words[k : k + NGRAM]) for k in range(max(1, len(words) - NGRAM + 1)))

    def jaccard(self, a: int, b: int) -> float:
        x, y = self.shingles(a), self.shingles(b)
        return len(x & y) / len(x | y) if x or y else 1.0


def cluster_pairs(clusters) -> set[tuple[int, int]]:
    return {(min(a, b), max(a, b)) for c in clusters for k, a in enumerate(c) for b in c[k + 1 :]}


def union_find_clusters(n: int, edges) -> list[list[int]]:
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        parent[find(a)] = find(b)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def precision_recall(found: dict[str, set], planted, truth: Truth) -> dict[str, tuple[float, float, int]]:
    candidates = set().union(*found.values()) | {(min(a, b), max(a, b)) for a, b in planted}
    true = {p for p in candidates if truth.jaccard(*p) >= THRESHOLD}
    out = {}
    for name, pairs in found.items():
        hits = len(pairs & true)
        out[name] = (hits / len(pairs) if pairs else 1.0, hits / len(true) if true else 1.0, len(pairs))
    return out


# -- contenders ----------------------------------------------------------------------------------------------


def datasketch_sigs(texts: list[str]):
    from datasketch import MinHash  # the bench extra's peer

    out = []
    for text in texts:
        words = WORD.findall(text.lower())
        shingles = [" ".join(words[i : i + NGRAM]).encode() for i in range(max(1, len(words) - NGRAM + 1))]
        m = MinHash(num_perm=NUM_PERM, seed=1)
        m.update_batch(shingles)
        out.append(m)
    return out


def datasketch_pairs(mhs) -> set[tuple[int, int]]:
    from datasketch import MinHashLSH  # the bench extra's peer

    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM)
    for i, m in enumerate(mhs):
        lsh.insert(i, m)
    return {(min(i, j), max(i, j)) for i, m in enumerate(mhs) for j in lsh.query(m) if j != i}


def datatrove_step(folder: str, fast: bool):
    from datatrove.pipeline.dedup.minhash import (  # the bench extra's peer
        MinhashConfig,
        MinhashDedupSignature,
    )
    from datatrove.utils.word_tokenizers import WordTokenizer

    class SplitTokenizer(WordTokenizer):
        """The least work a word tokenizer can do: str.split."""

        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> list[str]:
            return [text]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    config = MinhashConfig(n_grams=NGRAM, num_buckets=16, hashes_per_bucket=8)
    if fast:
        return MinhashDedupSignature(output_folder=folder, config=config, language=SplitTokenizer())
    return MinhashDedupSignature(output_folder=folder, config=config)


def datatrove_run(step, texts: list[str]) -> None:
    from datatrove.data import Document  # the bench extra's peer

    docs = (Document(text=t, id=str(i)) for i, t in enumerate(texts))
    for _ in step.run(docs, rank=0, world_size=1) or ():
        pass


def datatrove_pairs(step, texts: list[str]) -> set[tuple[int, int]]:
    """Its buckets step pairs documents equal on any whole bucket; its cluster step joins the pairs."""
    edges = []
    buckets: dict[tuple, int] = {}
    for i, t in enumerate(texts):
        shingles = step.get_shingles(t)
        if shingles.size == 0:
            continue
        for b, sig in enumerate(step.get_signature(shingles)):
            first = buckets.setdefault((b, *sig), i)
            if first != i:
                edges.append((first, i))
    return cluster_pairs(union_find_clusters(len(texts), edges))


def near_duplicate_figures(texts, planted, mb: float, args, report: Report) -> None:
    print(f"\n== near-duplicate signatures ({NUM_PERM} hashes, word {NGRAM}-grams), one process each ==")
    mem = tempfile.mkdtemp(prefix="runyard-bench-datatrove-")
    slow, fast = datatrove_step(mem + "/disk", fast=False), datatrove_step(f"memory://{mem}", fast=True)
    logging_quiet()
    outputs: dict[str, object] = {}

    def keep(name, fn):
        return lambda: outputs.__setitem__(name, fn())

    # The compiled kernel as a large prepare runs it, loaded already (a process switches to it after 64 MB:
    # minhash.py); its load is measured on its own, in a fresh process (kernel_load_seconds).
    signatures(["loaded before the rounds"], compiled=True)
    samples = interleaved({
        "runyard": keep("runyard", lambda: signatures(texts, NUM_PERM, NGRAM, 1, compiled=True)),
        # what a process runs before it switches: the same bits
        NUMPY_PATH: keep(NUMPY_PATH, lambda: signatures(texts, NUM_PERM, NGRAM, 1, compiled=False)),
        "datasketch": keep("datasketch", lambda: datasketch_sigs(texts)),
        "datatrove (spaCy, disk)": lambda: datatrove_run(slow, texts),
        "datatrove (str.split, memory)": lambda: datatrove_run(fast, texts),
    }, args.repeats, warmup=0)
    shutil.rmtree(mem, ignore_errors=True)
    truth = Truth(texts)
    found = {
        "runyard": cluster_pairs(near_duplicates(outputs["runyard"], THRESHOLD, texts=texts, ngram=NGRAM).clusters),
        "datasketch": datasketch_pairs(outputs["datasketch"]),
        "datatrove (spaCy, disk)": datatrove_pairs(slow, texts),
        "datatrove (str.split, memory)": datatrove_pairs(fast, texts),
    }
    quality = precision_recall(found, planted, truth)
    assert np.array_equal(outputs["runyard"], outputs[NUMPY_PATH]), "the kernel and the numpy path disagree"
    for name, s in samples.items():
        p, r, n = quality.get(name, quality["runyard"])  # the numpy path: the kernel's very signatures
        print(f"  {name:<30} {s.rate(mb).spread()} MB/s   precision {p:.3f} recall {r:.3f} ({n} pairs)")
    ours = samples["runyard"]
    # minhash.KERNEL_AFTER_CHARS rests on these: the kernel's lead over the numpy path and its load in a
    # fresh process; the text after which the kernel has paid for its load
    load_s = kernel_load_seconds()
    kernel_mb_s, numpy_mb_s = mb / ours.median, mb / samples[NUMPY_PATH].median
    break_even_mb = load_s / (1 / numpy_mb_s - 1 / kernel_mb_s) if kernel_mb_s > numpy_mb_s else float("inf")
    print(f"  kernel load in a fresh process: {load_s:.2f} s; it pays for itself after {break_even_mb:.0f} MB "
          f"(a process switches at {KERNEL_AFTER_CHARS / 2**20:.0f} MiB)")
    report.ratio("minhash_kernel_vs_numpy_path", paired_ratio(samples[NUMPY_PATH], ours), "runyard's numpy path",
                 ">=", 1.5, {"kernel_mb_s": kernel_mb_s, "numpy_mb_s": numpy_mb_s, "kernel_load_s": load_s,
                             "break_even_mb": break_even_mb})
    # targets: issue 32 asks >= 5x datatrove at its fastest documented configuration
    for key, peer, target in [("datasketch", "datasketch", 1.0), ("datatrove_defaults", "datatrove (spaCy, disk)", 5.0),
                              ("datatrove_fastest", "datatrove (str.split, memory)", 5.0)]:
        report.ratio(f"minhash_vs_{key}", paired_ratio(samples[peer], ours), f"{peer}, 1 process", ">=", target,
                     {"runyard_mb_s": mb / ours.median, "peer_mb_s": mb / samples[peer].median,
                      "precision_recall": {k: quality[k][:2] for k in ("runyard", peer)}})
    p_ours, r_ours, _ = quality["runyard"]
    best_peer_f1 = max(f1(*quality[k][:2]) for k in quality if k != "runyard")
    report.ratio("minhash_f1_vs_best_peer", Samples([f1(p_ours, r_ours) / best_peer_f1]),
                 "best F1 among datasketch and datatrove", ">=", 0.98,
                 {name: {"precision": q[0], "recall": q[1], "pairs": q[2]} for name, q in quality.items()})


def kernel_load_seconds() -> float:
    """The compiled kernel's first call in a new process (numba's import and its cached machine code),
    less the same call on the numpy path in that process."""
    code = ("import time\nfrom runyard.data.minhash import signatures\nt = time.perf_counter()\n"
            "signatures(['a b c d e f'], compiled=False)\nt1 = time.perf_counter()\n"
            "signatures(['a b c d e f'], compiled=True)\nprint(time.perf_counter() - t1 - (t1 - t))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    return float(done.stdout.strip().splitlines()[-1])


def f1(p: float, r: float) -> float:
    return 2 * p * r / (p + r) if p + r else 0.0


def logging_quiet() -> None:
    try:
        from loguru import logger  # datatrove's logger: its per-step INFO lines would drown the figures

        logger.remove()
    except ImportError:
        pass


def tokenize_and_loader_figures(texts, mb: float, args, report: Report) -> None:
    print("\n== tokenization (byte-level BPE, vocab 4096) ==")
    tok = train_bpe(texts, 4096, 2, 4_000_000)
    eos = eos_id(tok)
    chunks = [texts[lo:hi] for lo, hi in chunk_ranges(texts)]
    root = Path(tempfile.mkdtemp(prefix="runyard-bench-tokenize-"))
    work = root / "work"
    info: dict = {}
    try:
        def ours() -> None:
            paths = tokenize_chunks(tok, texts, eos, work, "train")
            info.update(assemble_shards(paths, work, "train", shard_tokens=1 << 20,
                                        vocab_size=tok.get_vocab_size(), eos=eos))

        def same_threads() -> None:
            with ThreadPoolExecutor(2) as pool:  # runyard's two chunks in flight, without its own work
                list(pool.map(tok.encode_batch_fast, chunks))

        def clear(_name: str) -> None:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)

        samples = interleaved({
            "runyard tokenize + shards": ours,
            "encode_batch_fast, 2 threads": same_threads,
            "encode_batch_fast, one call": lambda: tok.encode_batch_fast(texts),
        }, args.repeats, before=clear)
        for name, s in samples.items():
            print(f"  {name:<32} {s.rate(mb).spread()} MB/s")
        print(f"  ({info['tokens']:,} tokens in {info['shards']} shards)")
        ours_s = samples["runyard tokenize + shards"]
        report.ratio("tokenize_vs_encode_batch_fast_same_threads",
                     paired_ratio(samples["encode_batch_fast, 2 threads"], ours_s),
                     "tokenizers encode_batch_fast, same chunks, same 2 threads", ">=", 0.9)
        report.ratio("tokenize_vs_encode_batch_fast_one_call",
                     paired_ratio(samples["encode_batch_fast, one call"], ours_s),
                     "tokenizers encode_batch_fast, one call", ">=", 0.9)

        print("\n== loader batches (seq_len 256, batch 32), as training runs it: no prefetch ==")
        clear("")
        ours()
        index = work / "train.json"
        loader_figure(index, args, report)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def loader_figure(index: Path, args, report: Report, seq_len: int = 256, batch: int = 32, n: int = 200) -> None:
    entries = load_index(index)["shards"]
    shard_path = index.parent / max(entries, key=lambda e: e["tokens"])["file"]
    loader = TokenLoader(index, seq_len, batch, seed=0, prefetch=0)
    gen = torch.Generator().manual_seed(0)

    def runyard_batches() -> None:
        for _ in range(n):
            loader.next_batch()

    def nanogpt_batches() -> None:
        for _ in range(n):  # nanoGPT's train.py get_batch, verbatim in substance (CPU branch)
            data = open_shard(shard_path)  # it recreates the memmap every batch to avoid a memory leak
            ix = torch.randint(len(data) - seq_len, (batch,), generator=gen)
            x = torch.stack([torch.from_numpy(data[i : i + seq_len].astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + seq_len].astype(np.int64)) for i in ix])
            del x, y

    samples = interleaved({"runyard TokenLoader": runyard_batches, "nanoGPT get_batch": nanogpt_batches},
                          args.repeats)
    loader.close()
    tokens = n * batch * seq_len
    for name, s in samples.items():
        print(f"  {name:<24} {s.rate(tokens / 1e6).spread()} M tokens/s")
    report.ratio("loader_vs_nanogpt_get_batch",
                 paired_ratio(samples["nanoGPT get_batch"], samples["runyard TokenLoader"]),
                 "nanoGPT get_batch over the same shard", ">=", 0.8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-mb", type=float, default=30.0, help="cap on corpus size in MB (default 30)")
    ap.add_argument("--skip-dedup", action="store_true", help="only the tokenization and loader figures")
    add_common_args(ap, repeats=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = Report("data_throughput", args, packages=["tokenizers", "datasketch", "datatrove", "spacy"])

    texts, planted = plant(load_corpus(args.max_mb), [(150, 0.01), (150, 0.04)])
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"corpus: {len(texts)} documents, {mb:.1f} MB ({len(planted)} planted near-copies, half at 1% "
          "word edits, half at 4%)")
    if not args.skip_dedup:
        near_duplicate_figures(texts, planted, mb, args, report)
    tokenize_and_loader_figures(texts, mb, args, report)
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())
