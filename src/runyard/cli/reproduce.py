"""Verbs of reproduction: `runyard env lock|bundle|build|prune`, `runyard reproduce`, `runyard compare`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from runyard.reproduce.archives import ArchiveFinder, ArchiveMemo, PipLocations, env_cache_root
from runyard.reproduce.build import build_environment
from runyard.reproduce.bundle import bundle_run, wheelhouse_of
from runyard.reproduce.compare import DEFAULT_TOLERANCE, compare_runs
from runyard.reproduce.env_cache import prune
from runyard.reproduce.lock import LOCK_DIR, capture_environment, read_lock, write_lock
from runyard.reproduce.report import VERDICT_TEXT, write_report
from runyard.reproduce.reproduce import REPORT_DIR, reproduce_run
from runyard.reproduce.rerun import BACKENDS


def _say(message: str) -> None:
    print(f"runyard: {message}", file=sys.stderr, flush=True)


def _nonnegative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _add_source_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--find-links", type=Path, action="append", default=[], metavar="DIR",
                   help="also look for wheels in DIR (repeatable)")
    p.add_argument("--offline", action="store_true",
                   help="use no package index: only the run's wheelhouse and --find-links folders")


def register(verbs: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    env = verbs.add_parser(
        "env",
        help="the environment lock of a run: write it, bundle its wheels, build it; prune the built ones",
        description="Every run writes RUN_DIR/env/requirements.txt (pip's hash-checking requirements: exact "
        "versions, sha256 of each archive proven to be the installed one) and RUN_DIR/env/environment.json "
        "(interpreter, torch build and device libraries, per-distribution content digests).",
    )
    sub = env.add_subparsers(dest="env_verb", metavar="ENV_VERB", required=True)

    p = sub.add_parser("lock", help="write or print the lock of this environment",
                       description="Lock the running Python environment (what a run would record).")
    p.add_argument("--out", type=Path, default=None, help="write requirements.txt and environment.json into this folder")
    p.add_argument("--json", action="store_true", help="print environment.json to standard output")
    p.add_argument("--no-archives", action="store_true", help="do not look for archives (no hashes; faster)")
    p.set_defaults(handler=cmd_env_lock)

    p = sub.add_parser(
        "bundle", help="add a wheelhouse to a run so its environment rebuilds with no package index",
        description="Fetch every wheel of RUN_DIR's lock into RUN_DIR/env/wheelhouse (each proven by its hash or "
        "by the digest of the files that were installed), build runyard's wheel from the recorded commit or the "
        "installed tree, and write wheelhouse/requirements.txt with every hash filled in. Needs a package index "
        "(or --find-links) once; after it, `runyard reproduce --offline` needs none.",
    )
    p.add_argument("run_dir", type=Path, help="the run directory")
    _add_source_options(p)
    p.set_defaults(handler=cmd_env_bundle)

    p = sub.add_parser(
        "build", help="build (or find in the cache) the virtual environment of a run's lock",
        description="Build a fresh venv from RUN_DIR's lock, cached by the lock's sha256 under $RUNYARD_ENV_CACHE "
        "(default ~/.cache/runyard/env), and print its python. Refuses, naming the packages, when the lock "
        "cannot be installed on this platform.",
    )
    p.add_argument("run_dir", type=Path, help="the run directory")
    _add_source_options(p)
    p.set_defaults(handler=cmd_env_build)

    p = sub.add_parser(
        "prune", help="remove built environments not used for a while",
        description="Remove the environments in the cache ($RUNYARD_ENV_CACHE, default ~/.cache/runyard/env) that "
        "no build, reproduction or lease job has used for --unused-for days, and builds a killed builder left "
        "unfinished that long. An environment being built is skipped. Prints each with its size.",
    )
    p.add_argument("--unused-for", type=_nonnegative_float, default=30.0, metavar="DAYS",
                   help="remove environments unused for this many days (default %(default)g; 0: every one not in use "
                   "by a builder)")
    p.add_argument("--cache", type=Path, default=None, help="the cache folder (default: $RUNYARD_ENV_CACHE or "
                   "~/.cache/runyard/env)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.set_defaults(handler=cmd_env_prune)

    p = verbs.add_parser(
        "reproduce",
        help="rebuild a run's environment, rerun its spec, and report whether the result held",
        description="Check the run's spec and data files against what it recorded (naming any file that changed), "
        "build its environment from the lock (cached), rerun the spec inside it into a new directory, and write "
        "INTO/reproduction/report.{md,json} and curves.png: per stage the loss curve against the original (max "
        "absolute difference, steps compared), the final held-out metrics, and a verdict: bitwise, within "
        "tolerance, or different (with the first step where the curves part and the differences in environment "
        "and hardware that could explain it). Exit 0 when the result held, 1 when it did not, 2 when refused "
        "before any work.",
    )
    p.add_argument("run_dir", type=Path, help="the run directory to reproduce")
    p.add_argument("--into", type=Path, default=None, help="new run directory (default RUN_DIR-repro1, -repro2, ...)")
    p.add_argument("--backend", choices=BACKENDS, default="local", help="run here (local) or as a Slurm job (slurm)")
    p.add_argument("--tolerance", type=_nonnegative_float, default=DEFAULT_TOLERANCE,
                   help=f"largest loss difference (nats/token) that still holds (default {DEFAULT_TOLERANCE})")
    p.add_argument("--allow-changed-inputs", action="store_true",
                   help="rerun even if the spec or data files changed since the run (they are named in the report)")
    p.add_argument("--cwd", type=Path, default=None,
                   help="folder the spec's relative data paths resolve from (default: the run's recorded working "
                   "directory, when it exists here, else the current one)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="extra sbatch argument for --backend slurm (repeatable), e.g. --sbatch-arg=--partition=debug")
    _add_source_options(p)
    p.set_defaults(handler=cmd_reproduce)

    p = verbs.add_parser(
        "compare",
        help="compare two run directories of the same spec",
        description="Compare OTHER against ORIGINAL: loss curves per stage, held-out metrics, exported weights, "
        "and the differences in inputs, environment and hardware; writes report.{md,json} and curves.png into "
        "--out (default OTHER/comparison). Exit 0 when bitwise or within tolerance, 1 when different.",
    )
    p.add_argument("original", type=Path, help="the original run directory")
    p.add_argument("other", type=Path, help="the run directory to compare with it")
    p.add_argument("--out", type=Path, default=None, help="report folder (default OTHER/comparison)")
    p.add_argument("--tolerance", type=_nonnegative_float, default=DEFAULT_TOLERANCE,
                   help=f"largest loss difference (nats/token) that still holds (default {DEFAULT_TOLERANCE})")
    p.set_defaults(handler=cmd_compare)


def cmd_env_lock(args) -> int:
    finder = ArchiveFinder(PipLocations(), memo=ArchiveMemo(None)) if args.no_archives else None
    lock = capture_environment(finder)
    if args.out is not None:
        write_lock(args.out, lock)
        _say(f"wrote {args.out}/requirements.txt (lock {lock.sha256[:16]}, {len(lock.unhashed())} without a hash)")
    if args.json:
        print(json.dumps(lock.to_json(), indent=1, sort_keys=True))
    elif args.out is None:
        print(lock.requirements_text(), end="")
    return 0


def cmd_env_bundle(args) -> int:
    bundle = bundle_run(args.run_dir, find_links=args.find_links, say=_say)
    print(f"wheelhouse {bundle.path}: {len(bundle.wheels)} wheels, {bundle.size_bytes / 1e6:.0f} MB, "
          f"{bundle.completed} hash(es) proven and filled in; runyard built from {bundle.runyard_origin}")
    if bundle.runyard_source_changes:
        print(f"note: runyard's source differs from the run's in: {', '.join(bundle.runyard_source_changes)}")
    return 0


def cmd_env_build(args) -> int:
    wheelhouse = wheelhouse_of(args.run_dir)
    links = [*args.find_links, *([wheelhouse] if wheelhouse else [])]
    built = build_environment(read_lock(args.run_dir / LOCK_DIR), find_links=links, offline=args.offline, say=_say)
    _say(f"environment {built.key[:16]} {'reused' if built.reused else f'built in {built.seconds:.0f} s'}")
    print(built.python)
    return 0


def cmd_env_prune(args) -> int:
    cache = args.cache if args.cache is not None else env_cache_root()
    pruned = prune(cache, args.unused_for * 86400.0, time.time(), dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for item in pruned:
        print(f"{verb} {cache / item.key} ({item.size_bytes / 1e6:.0f} MB{'' if item.ready else ', unfinished build'})")
    print(f"{verb} {len(pruned)} environment(s), {sum(p.size_bytes for p in pruned) / 1e6:.0f} MB, from {cache}")
    return 0


def _print_verdict(comparison, report_dir: Path) -> None:
    print(f"verdict: {VERDICT_TEXT.get(comparison.verdict, comparison.verdict)}")
    for s in comparison.stages:
        print(f"  stage {s.name}: {s.steps_compared} steps compared, max |diff| {s.max_abs_diff}, "
              f"first differing step {s.first_differing_step}, first step past tolerance {s.first_parting_step}")
    for heading, items in (("inputs", comparison.input_differences), ("environment", comparison.environment_differences),
                           ("hardware", comparison.hardware_differences)):
        for item in items:
            print(f"  {heading}: {item}")
    print(f"report: {report_dir / 'report.md'}")


def cmd_reproduce(args) -> int:
    result = reproduce_run(
        args.run_dir, into=args.into, backend=args.backend, tolerance=args.tolerance,
        allow_changed_inputs=args.allow_changed_inputs, find_links=args.find_links, offline=args.offline,
        sbatch_args=args.sbatch_arg, cwd=args.cwd, say=_say,
    )
    if result.rerun_exit_code != 0:
        print(f"the rerun exited {result.rerun_exit_code}: see {result.report_dir / 'rerun.log'}")
    _print_verdict(result.comparison, result.report_dir)
    return result.exit_code


def cmd_compare(args) -> int:
    comparison = compare_runs(args.original, args.other, args.tolerance)
    out = args.out or args.other / "comparison"
    write_report(out, comparison, f"Comparison of {args.other} with {args.original}")
    _print_verdict(comparison, out)
    return 1 if comparison.verdict == "different" else 0


__all__ = ["register", "REPORT_DIR"]
