"""Verbs of the data stage: `runyard prepare SPEC` and `runyard hydrate SPEC`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown

from runyard.data.executors import ExecutorChoice
from runyard.data.hydrate import find_fingerprint, hydrate_dataset, publish_dataset
from runyard.data.pipeline import prepare_data
from runyard.data.report import markdown_report
from runyard.spec.job import load_spec
from runyard.system.progress import NO_PROGRESS_HELP


def register(subparsers: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    p = subparsers.add_parser(
        "prepare",
        help="run the data stage alone and print its report",
        description="Read, clean, deduplicate, split and tokenize the spec's data into token shards in the "
        "data cache (reused when inputs and settings are unchanged), and print the data report. "
        "Memory stays under data.memory_limit whatever the corpus size; the clean and tokenize steps run "
        "as tasks on the chosen executor, resumable task by task. "
        "With data.store set, the shards are also published to that store.",
    )
    p.add_argument("spec", help="job spec YAML file")
    p.add_argument("--report-dir", type=Path, default=None, help="write report.md/json/png here too")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="data cache (default: data.cache_dir, $RUNYARD_CACHE_DIR or ~/.cache/runyard/data)",
    )
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    p.add_argument(
        "--executor",
        choices=["local", "slurm", "ray"],
        default="local",
        help="where the clean and tokenize tasks run: local worker processes (default), a Slurm job array "
        "per step (sbatch; the data cache must be on storage every node sees), or Ray (the cluster at "
        "--ray-address, else $RAY_ADDRESS's, else a local Ray; needs runyard[ray]). The dataset is the same on each",
    )
    p.add_argument("--partition", default=None, help="Slurm partition for the array tasks")
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra sbatch argument for the array tasks (repeat for several, e.g. --sbatch-arg=--account=x)",
    )
    p.add_argument("--ray-address", default=None, help="Ray cluster address (ray://head:10001, or auto); none: $RAY_ADDRESS, else a local Ray")
    p.add_argument(
        "--retries", type=int, default=2, help="reruns of a failed Slurm or Ray task before giving up (default 2)"
    )
    p.set_defaults(handler=_prepare)

    h = subparsers.add_parser(
        "hydrate",
        help="copy a prepared dataset from its store into the local cache",
        description="Copy the spec's dataset from the cold store (data.store.url or --store) into the local "
        "cache: parallel, resumable, every shard checked against its sha256. Refused before any byte "
        "moves if the cache's region is outside data.residency.",
    )
    h.add_argument("spec", help="job spec YAML file")
    h.add_argument("--store", default=None, help="store URL or path (default: data.store.url)")
    h.add_argument(
        "--fingerprint",
        default=None,
        help="dataset to fetch (default: computed from the spec's sources, or the store's only one)",
    )
    h.add_argument("--cache-dir", type=Path, default=None, help="local cache directory")
    h.add_argument(
        "--max-cache-gb", type=float, default=None, help="evict least recently used datasets above this"
    )
    h.add_argument("--threads", type=int, default=4, help="parallel copies (default 4)")
    h.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    h.set_defaults(handler=_hydrate)


def _prepare(args: argparse.Namespace) -> int:

    spec = load_spec(args.spec)
    executor = ExecutorChoice(args.executor, args.partition, args.sbatch_arg, args.ray_address, args.retries)
    prepared = prepare_data(
        spec.data, spec.seed, args.report_dir, cache_dir=args.cache_dir, progress=not args.no_progress,
        executor=executor,
    )
    console = Console()
    console.print(Markdown(markdown_report(prepared.stats)))
    console.print(f"dataset: {prepared.dataset_dir}")
    if spec.data.store is not None:
        console.print(f"published to {publish_dataset(prepared, spec.data)}")
    return 0


def _hydrate(args: argparse.Namespace) -> int:

    spec = load_spec(args.spec)
    fingerprint = args.fingerprint or find_fingerprint(spec.data, spec.seed, args.store)
    max_bytes = int(args.max_cache_gb * 1e9) if args.max_cache_gb is not None else None
    result = hydrate_dataset(
        spec.data,
        fingerprint,
        store_url=args.store,
        cache_dir=args.cache_dir,
        max_cache_bytes=max_bytes,
        threads=args.threads,
        progress=not args.no_progress,
    )
    print(
        f"hydrated {result.prepared.dataset_dir}: {result.bytes_copied / 1e6:.1f} MB copied, "
        f"{result.bytes_reused / 1e6:.1f} MB reused, {result.mb_per_s:.1f} MB/s"
        + (f"; evicted {', '.join(result.evicted)}" if result.evicted else "")
    )
    return 0
