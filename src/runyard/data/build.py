"""Build one dataset directory from its cleaned parts: deduplicate, split, train the tokenizer, tokenize
(tasks on the executor), assemble the shards, and write `prepared.json` last (its presence marks the
dataset complete). Everything here reads the parts in blocks (corpus.py); see pipeline.py for the whole.

The result is bitwise the dataset pipeline version 1 made from the same inputs (the same documents
kept, the same tokenizer, the same shard files), except where the layout changed on purpose: document
offsets live in `<shard>.docs` files beside the shards instead of the index, the held-out ids are a
file in document order (`heldout_ids.jsonl`) instead of a sorted list in split.json, and the training
split's token counts are a file (`train_token_counts.npy`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from runyard.data.budget import MemoryBudget, release_freed_memory
from runyard.data.corpus import (
    EXACT_DUP,
    HELDOUT,
    NEAR_DUP,
    REMOVED,
    Corpus,
    corpus_stats,
    held_out_documents,
    split_corpus,
    training_texts,
)
from runyard.data.dedup_external import exact_dedup, near_dedup
from runyard.data.shards import document_lengths
from runyard.data.split import SPLIT_METHOD
from runyard.data.tokenize import assemble_splits
from runyard.data.tokenizer import EOS_TOKEN, eos_id, eos_token_beside, load_tokenizer, train_bpe
from runyard.data.work_units import Task
from runyard.errors import DataError
from runyard.spec.data import DataSpec
from runyard.system.diskspace import writing
from runyard.system.files import atomic_write_bytes, atomic_write_json, sha256_file
from runyard.system.progress import progress_bars

log = logging.getLogger(__name__)

COUNTS_FILE = "train_token_counts.npy"
HELDOUT_IDS_FILE = "heldout_ids.jsonl"
HELD_OUT_LIST = "held_out.txt"  # copied beside the data report (a run's data/held_out.txt)


def _merge_counters(metas: list[dict[str, Any]], spec: DataSpec) -> dict[str, Any]:
    """The parts' counters summed and their samples joined in part order (so: the first in document
    order), cut to the spec's sample counts."""
    counts: Counter = Counter()
    removed: Counter = Counter()
    pii: Counter = Counter()
    samples: dict[str, list] = {}
    pii_samples: dict[str, list] = {}
    for m in metas:
        counts.update(m["counts"])
        removed.update(m["removed"])
        pii.update(m["pii"])
        for reason, s in m["samples"].items():
            samples.setdefault(reason, []).extend(s)
        for kind, s in m["pii_samples"].items():
            pii_samples.setdefault(kind, []).extend(s)
    return {
        "read": dict(counts),
        "removed": dict(removed),
        "pii": dict(pii),
        "removal_samples": {r: s[: spec.filters.samples_per_reason] for r, s in samples.items()},
        "pii_samples": {k: s[: spec.pii.samples_per_kind] for k, s in pii_samples.items()},
    }


def end_of_document_token(spec: DataSpec) -> str:
    """The token that ends each document: a given tokenizer's own (its tokenizer_config.json's
    `eos_token`, e.g. a Hugging Face model's), else runyard's."""
    return eos_token_beside(spec.tokenizer.path) if spec.tokenizer.path else EOS_TOKEN


def _tokenizer(spec: DataSpec, corpus: Corpus, dataset_dir: Path, budget: MemoryBudget, progress: bool | None):
    tok_path = dataset_dir / "tokenizer.json"
    if spec.tokenizer.path:
        eos_token = end_of_document_token(spec)
        tok, source = load_tokenizer(spec.tokenizer.path, eos_token), str(spec.tokenizer.path)
    elif tok_path.exists():  # trained by an interrupted earlier attempt with the same fingerprint
        tok, source = load_tokenizer(tok_path), "trained"
    else:
        with progress_bars(progress) as bars:
            bars.add_task("train BPE tokenizer", total=None, info=f"vocab {spec.tokenizer.vocab_size}")
            tok = train_bpe(
                training_texts(corpus, budget.text_block_bytes),
                spec.tokenizer.vocab_size,
                spec.tokenizer.min_frequency,
                spec.tokenizer.train_max_bytes,
            )
        source = "trained"
    if not tok_path.exists():
        tmp = tok_path.with_name(".tokenizer.json.tmp")
        with writing("the tokenizer", dataset_dir):
            tok.save(str(tmp))
            os.replace(tmp, tok_path)
    return tok, source


def build_dataset(
    spec: DataSpec,
    seed: int,
    part_dirs: list[Path],
    metas: list[dict[str, Any]],
    n_files: int,
    inputs: dict[str, str],
    fp: str,
    dataset_dir: Path,
    budget: MemoryBudget,
    executor,
    task_budget: tuple[int, int],
    progress: bool | None,
    timings: dict[str, float],
) -> None:
    """Write the dataset of `fp` into `dataset_dir` (see the module doc)."""
    totals = _merge_counters(metas, spec)
    if totals["read"].get("documents_read", 0) == 0:
        raise DataError(
            f"the data sources hold no documents ({totals['read'].get('files', 0)} files read); "
            "check data.sources and their encoding_errors policy"
        )
    work = dataset_dir / "work"
    for scratch in ("exact", "exact-dups", "lsh", "pairs", "edges.u64"):  # not resumable: redone
        path = work / scratch
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    corpus = Corpus.open(part_dirs, work / "flags.u8")

    # CPU seconds per step: the main process's for its own steps (time.process_time: every thread of it),
    # the tasks' as the executor reports them (summed over workers: the step's work, whatever the load)
    cpu: dict[str, float] = {}
    t, c = time.perf_counter(), time.process_time()
    dedup: dict[str, Any] = {"exact_removed": 0, "near_removed": 0, "threshold": spec.dedup.threshold}
    with progress_bars(progress) as bars:
        bars.add_task("deduplicate", total=None, info=f"{corpus.n_docs:,} documents")
        if spec.dedup.exact:
            dedup["exact_removed"] = exact_dedup(corpus, work, budget)
        if spec.dedup.near and corpus.n_docs:
            dedup.update(near_dedup(corpus, spec.dedup, work, budget))
    release_freed_memory()
    timings["dedup_s"] = time.perf_counter() - t
    cpu["dedup"] = time.process_time() - c
    kept = corpus.n_docs - dedup["exact_removed"] - dedup["near_removed"]
    if kept < 2:
        raise DataError(
            f"only {kept} document(s) left after filtering and deduplication; "
            "a train/held-out split needs at least 2"
        )
    held = split_corpus(corpus, seed, spec.heldout_fraction, dataset_dir / HELDOUT_IDS_FILE)
    atomic_write_json(dataset_dir / "split.json", {
        "method": SPLIT_METHOD, "seed": seed, "heldout_fraction": spec.heldout_fraction,
        "heldout_documents": held["documents"], "heldout_ids": HELDOUT_IDS_FILE,
        "heldout_ids_sha256": held["sha256"],
    })

    t, c = time.perf_counter(), time.process_time()
    tok, tok_source = _tokenizer(spec, corpus, dataset_dir, budget, progress)
    eos_token = end_of_document_token(spec)
    eos, vocab = eos_id(tok, eos_token), tok.get_vocab_size()
    release_freed_memory()  # the trainer's word and pair counts
    timings["tokenizer_s"] = time.perf_counter() - t
    cpu["tokenizer"] = time.process_time() - c

    t = time.perf_counter()
    tasks = [
        Task("tokenize", p, str(work / f"tok-p{p:05d}.json"), {
            "part_dir": str(part.path), "flags": str(corpus.flags.path), "first_doc": int(corpus.starts[p]),
            "tokenizer": str(dataset_dir / "tokenizer.json"), "work_dir": str(work), "part_index": p,
            "chunk_bytes": spec.chunk_bytes, "eos_token": eos_token,
        }, task_budget)
        for p, part in enumerate(corpus.parts)
    ]
    with progress_bars(progress) as bars:
        bar = bars.add_task("tokenize", total=len(tasks), completed=sum(t.done() for t in tasks),
                            info=f"{len(tasks)} parts on {executor.name}")
        executor.run("tokenize", tasks, lambda task: bars.advance(bar))
    timings["tokenize_s"] = time.perf_counter() - t

    t, c = time.perf_counter(), time.process_time()
    chunk_files = [work / name for task in tasks for name in _chunk_list(Path(task.output))]
    with progress_bars(progress) as bars:
        bar = bars.add_task("assemble shards", total=len(chunk_files), info=f"{len(chunk_files)} chunks")
        split_totals, counts = assemble_splits(
            chunk_files, dataset_dir, shard_tokens=spec.shard_tokens, vocab_size=vocab, eos=eos,
            on_chunk=lambda _: bars.advance(bar),
        )
    buf = io.BytesIO()
    np.save(buf, counts, allow_pickle=False)
    atomic_write_bytes(dataset_dir / COUNTS_FILE, buf.getvalue())
    write_held_out_list(corpus, dataset_dir, spec, seed)
    timings["assemble_s"] = time.perf_counter() - t
    cpu["assemble"] = time.process_time() - c
    cpu.update({f"{step}_tasks": v for step, v in executor.task_cpu_s.items()})

    stats = _stats(spec, seed, fp, n_files, totals, dedup, corpus, held, split_totals, tok_source, vocab, eos,
                   timings, cpu)
    stats["sources"] = source_tallies(spec, corpus, metas)
    traffic = traffic_summary(stats["sources"])
    if traffic is not None:
        stats["traffic"] = traffic
    meta = {
        "fingerprint": fp,
        "vocab_size": vocab,
        "eos_id": eos,
        "tokenizer_path": "tokenizer.json",
        "train_index": "train.json",
        "heldout_index": "heldout.json",
        "train_token_counts": COUNTS_FILE,
        # Files beside the shards that the indexes do not list, for publish/hydrate to copy and verify.
        "files": {
            name: {"sha256": sha256_file(dataset_dir / name), "bytes": (dataset_dir / name).stat().st_size}
            for name in (COUNTS_FILE, HELDOUT_IDS_FILE, HELD_OUT_LIST)
        },
        "stats": stats,
        "input_fingerprints": {
            **inputs,
            **{f"shards {n}.json": sha256_file(dataset_dir / f"{n}.json") for n in ("train", "heldout")},
        },
    }
    atomic_write_json(dataset_dir / "prepared.json", meta)  # last: its presence marks the dataset complete
    shutil.rmtree(work, ignore_errors=True)


def source_tallies(spec: DataSpec, corpus: Corpus, metas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per source: its documents read, removed by its filters (per reason, with samples when the source has
    its own filters), removed as exact or near duplicates, and used (train and held-out). Each part's files
    wrote their kept documents in order, so a part's documents map to sources by the files' counts."""
    out = [
        {"source": i, "path": s.path, "kind": s.kind, "own_filters": s.filters is not None,
         "filters": s.filters.model_dump(mode="json") if s.filters is not None else None,
         "read": 0, "removed": Counter(), "removal_samples": {}, "exact_duplicates": 0, "near_duplicates": 0,
         "train": 0, "heldout": 0}
        for i, s in enumerate(spec.sources)
    ]
    for p, meta in enumerate(metas):
        for i, c in meta.get("per_source", {}).items():
            row = out[int(i)]
            row["read"] += c["read"]
            row["removed"].update(c["removed"])
            own = spec.sources[int(i)].filters
            for reason, samples in c["samples"].items():
                kept = row["removal_samples"].setdefault(reason, [])
                kept.extend(samples[: max(0, (own.samples_per_reason if own else 0) - len(kept))])
        files = meta["files"]
        if not all("documents" in f for f in files):
            continue  # a part cleaned before per-file counts were kept
        owner = np.repeat(np.array([f["source"] for f in files], dtype=np.int64),
                          np.array([f["documents"] for f in files], dtype=np.int64))
        flags = corpus.flags_of(p, 0, corpus.parts[p].n_docs)
        if len(owner) != len(flags):
            continue
        for i in np.unique(owner):
            f = flags[owner == i]
            row = out[int(i)]
            row["exact_duplicates"] += int(((f & EXACT_DUP) != 0).sum())
            row["near_duplicates"] += int((((f & NEAR_DUP) != 0) & ((f & EXACT_DUP) == 0)).sum())
            kept = (f & REMOVED) == 0
            held = (f & HELDOUT) != 0
            row["train"] += int((kept & ~held).sum())
            row["heldout"] += int((kept & held).sum())
    for row in out:
        row["removed"] = dict(row["removed"])
        row["used"] = row["train"] + row["heldout"]
    return out


def traffic_summary(sources: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The logged requests' fate, over every `kind: traffic` source: records read, used (train + held-out)
    and removed, per reason (each filter rule, `exact_duplicate`, `near_duplicate`). None without one."""
    rows = [r for r in sources if r["kind"] == "traffic"]
    if not rows:
        return None
    removed: Counter = Counter()
    for r in rows:
        removed.update(r["removed"])
        removed["exact_duplicate"] += r["exact_duplicates"]
        removed["near_duplicate"] += r["near_duplicates"]
    return {
        "sources": [r["path"] for r in rows],
        "records_read": sum(r["read"] for r in rows),
        "records_used": sum(r["used"] for r in rows),
        "records_train": sum(r["train"] for r in rows),
        "records_heldout": sum(r["heldout"] for r in rows),
        "removed": {k: v for k, v in sorted(removed.items()) if v},
    }


def write_held_out_list(corpus: Corpus, dataset_dir: Path, spec: DataSpec, seed: int) -> None:
    """`held_out.txt`: each held-out document, one a line in document order: its bytes, its tokens (its
    end-of-document token not counted) and its source path or id (`path#L12` for a JSONL line, `path#3`
    for a Parquet row), tab-separated; an id holding a tab or a line break is written as a JSON string."""
    lengths = document_lengths(dataset_dir / "heldout.json")
    lines = [
        f"# the held-out documents: never trained on, scored by the held-out evaluation "
        f"(data.heldout_fraction {spec.heldout_fraction}, split seed {seed}, {len(lengths)} documents)",
        "# bytes\ttokens\tsource",
    ]
    n = 0
    for doc_id, nbytes in held_out_documents(corpus):
        if n == len(lengths):
            break
        shown = json.dumps(doc_id) if any(c in doc_id for c in "\t\n\r") else doc_id
        lines.append(f"{nbytes}\t{int(lengths[n]) - 1}\t{shown}")
        n += 1
    if n != len(lengths) or n != sum(1 for _ in held_out_documents(corpus)):
        raise DataError(f"the held-out split's shards hold {len(lengths)} documents; the flags disagree")
    atomic_write_bytes(dataset_dir / HELD_OUT_LIST, ("\n".join(lines) + "\n").encode())


def _chunk_list(output: Path) -> list[str]:
    return json.loads(output.read_text())["chunks"]


def _stats(spec: DataSpec, seed: int, fp: str, n_files: int, totals: dict[str, Any], dedup: dict[str, Any],
           corpus: Corpus, held: dict[str, Any], split_totals: dict[str, dict[str, int]], tok_source: str,
           vocab: int, eos: int, timings: dict[str, float], cpu: dict[str, float]) -> dict[str, Any]:
    figures = corpus_stats(corpus)
    tally = figures["tallies"]
    steps = [
        {"step": "read", "documents": totals["read"].get("documents_read", 0),
         "bytes": totals["read"].get("bytes_read", 0)},
        {"step": "filter", "documents": tally["filter"]["documents"], "bytes": tally["filter"]["bytes"]},
    ]
    if spec.dedup.exact:
        steps.append({"step": "exact_dedup", **{k: tally["exact_dedup"][k] for k in ("documents", "bytes")}})
    if spec.dedup.near and corpus.n_docs:
        steps.append({"step": "near_dedup", **{k: tally["near_dedup"][k] for k in ("documents", "bytes")}})
    splits = {}
    for name in ("train", "heldout"):
        result, t = split_totals[name], tally[name]
        splits[name] = {
            **result,
            "chars": t["chars"],
            "bytes": t["bytes"],
            "bytes_per_token": round(t["bytes"] / max(1, result["tokens"] - result["documents"]), 4),
        }
    return {
        "fingerprint": fp,
        "seed": seed,
        "input_files": n_files,
        "read": totals["read"],
        "steps": steps,
        "removed": totals["removed"],
        "removal_samples": totals["removal_samples"],
        "filters": spec.filters.model_dump(mode="json"),
        "pii": totals["pii"],
        "pii_samples": totals["pii_samples"],
        "dedup": dedup,
        "split": {
            "method": SPLIT_METHOD,
            "heldout_fraction": spec.heldout_fraction,
            "heldout_ids_sha256": held["sha256"],
            **splits,
        },
        "tokenizer": {
            "source": tok_source,
            "vocab_size": vocab,
            "requested_vocab_size": None if spec.tokenizer.path else spec.tokenizer.vocab_size,
            "eos_id": eos,
            "train_max_bytes": spec.tokenizer.train_max_bytes,
        },
        "doc_length_histogram": figures["doc_length_histogram"],
        "timings": {k: round(v, 3) for k, v in timings.items()},
        "cpu_seconds": {k: round(v, 3) for k, v in sorted(cpu.items())},
    }
