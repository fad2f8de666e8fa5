"""`runyard reproduce RUN_DIR`: rebuild the run's environment, check its inputs, rerun it, compare.

Order matters: everything that can refuse (a run directory without a lock, a spec or data file that
changed, a lock this platform cannot install) refuses before the rerun starts, and the environment
build's own refusals come before it installs anything (build.py). The report lands in
`INTO/reproduction/` (report.md, report.json, curves.png, rerun.log).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runyard.errors import EXIT_NOT_FIT, EXIT_OK
from runyard.reproduce.build import BuiltEnvironment, build_environment
from runyard.reproduce.bundle import wheelhouse_of
from runyard.reproduce.compare import DEFAULT_TOLERANCE, DIFFERENT, Comparison, compare_runs
from runyard.reproduce.datacheck import check_inputs
from runyard.reproduce.errors import InputsChanged, NotReproducible
from runyard.reproduce.lock import LOCK_DIR, read_lock
from runyard.reproduce.manifest import MANIFEST_FILE, read_manifest
from runyard.reproduce.report import write_report
from runyard.reproduce.rerun import rerun_command, rerun_environment, run_local, run_slurm
from runyard.spec.job import load_spec

SPEC_FILE = "spec.yaml"  # run.py's name for it; not imported so that this module needs no torch
REPORT_DIR = "reproduction"


@dataclass
class Reproduction:
    into: Path
    report_dir: Path
    comparison: Comparison
    environment: BuiltEnvironment
    rerun_exit_code: int

    @property
    def exit_code(self) -> int:
        """0 when the result held (bitwise or within tolerance), 1 when it did not or the rerun failed. A
        rerun that finished not fit to ship (exit 7) did not fail: the comparison says whether it matches."""
        failed = self.rerun_exit_code not in (EXIT_OK, EXIT_NOT_FIT)
        return 1 if failed or self.comparison.verdict == DIFFERENT else 0


def default_into(run_dir: Path) -> Path:
    """RUN_DIR-repro1, -repro2, ...: the first that does not exist."""
    n = 1
    while (candidate := run_dir.with_name(f"{run_dir.name}-repro{n}")).exists():
        n += 1
    return candidate


def reproduce_run(
    run_dir: Path,
    into: Path | None = None,
    backend: str = "local",
    tolerance: float = DEFAULT_TOLERANCE,
    allow_changed_inputs: bool = False,
    find_links: list[Path] | None = None,
    offline: bool = False,
    env_cache: Path | None = None,
    sbatch_args: list[str] | None = None,
    cwd: Path | None = None,
    say: Callable[[str], None] = lambda _msg: None,
) -> Reproduction:
    """Reproduce `run_dir` into `into` (default RUN_DIR-reproN) and write the reproduction report. Relative
    data paths resolve from `cwd`: by default the run's recorded working directory, when it exists here."""
    run_dir = run_dir.resolve()
    spec_path = run_dir / SPEC_FILE
    if not spec_path.is_file() or not (run_dir / MANIFEST_FILE).is_file():
        raise NotReproducible(f"{run_dir} is not a run directory: it needs {SPEC_FILE} and {MANIFEST_FILE}")
    spec, manifest = load_spec(spec_path), read_manifest(run_dir)
    lock = read_lock(run_dir / LOCK_DIR)
    into = (into or default_into(run_dir)).resolve()
    if into.exists() and any(into.iterdir()):
        raise NotReproducible(f"--into {into} exists and is not empty: a reproduction needs a new directory")
    if cwd is None:
        recorded = manifest.get("cwd")
        cwd = Path(recorded) if recorded and Path(recorded).is_dir() else Path.cwd()

    changes = check_inputs(spec, manifest, cwd)
    if changes and not allow_changed_inputs:
        raise InputsChanged(changes)
    wheelhouse = wheelhouse_of(run_dir)
    links = [*(find_links or []), *([wheelhouse] if wheelhouse else [])]
    say(f"environment {lock.sha256[:16]}: {len(lock.distributions)} distributions, python {lock.python['version']}"
        + (f", wheelhouse {wheelhouse}" if wheelhouse else ""))
    built = build_environment(lock, cache_root=env_cache, find_links=links, offline=offline, say=say)
    say(f"environment {'reused from the cache' if built.reused else f'built in {built.seconds:.0f} s'}: {built.python}")

    report_dir = into / REPORT_DIR
    report_dir.mkdir(parents=True, exist_ok=True)
    data_cache = Path(tempfile.mkdtemp(prefix="runyard-repro-data-"))
    argv = rerun_command(built.python, spec_path, into)
    env = rerun_environment(built.python, built.archives, data_cache)
    slurm_id = None
    say(f"rerunning {spec.name} ({backend}) into {into}")
    started = time.monotonic()
    try:
        if backend == "slurm":
            cpus = max(spec.resources.nproc, spec.resources.threads or 1)
            code, slurm_id = run_slurm(argv, cwd, env, report_dir / "rerun.log", report_dir, cpus, spec.name, sbatch_args)
        else:
            code = run_local(argv, cwd, env, report_dir / "rerun.log")
    finally:
        shutil.rmtree(data_cache, ignore_errors=True)
    rerun_s = time.monotonic() - started

    comparison = compare_runs(run_dir, into, tolerance)
    context = {
        "backend": backend,
        "slurm_job": slurm_id,
        "rerun_exit_code": code,
        "rerun_seconds": round(rerun_s, 1),
        "command": " ".join(argv),
        "working_directory": str(cwd),
        "environment_key": built.key,
        "environment": str(built.root),
        "environment_reused": built.reused,
        "environment_build_seconds": built.seconds,
        "runyard_built_from": built.runyard_origin,
        "runyard_source_changes": built.runyard_source_changes,
        "hashes_completed_from_proven_archives": len(built.completed_hashes),
        "inputs_changed": [f"{what}: {how}" for what, how in changes],
    }
    write_report(report_dir, comparison, f"Reproduction of {spec.name}", context)
    return Reproduction(into, report_dir, comparison, built, code)
