"""`runyard reproduce` end to end, for real: a finished CPU run, its environment rebuilt from its lock in
a fresh venv (once per session, then from the cache), the spec rerun inside it here and under Slurm,
and the refusals that come before any work."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from runyard.reproduce.lock import KIND_WHEEL, LOCK_DIR, LockedDist, read_lock, write_lock

from .conftest import runyard

# One worker runs the reproduction tests: they share one finished run and its rebuilt environment
# (session fixtures in conftest.py, a minute or two to build).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("reproduce")]


def _report(into) -> dict:
    return json.loads((into / "reproduction" / "report.json").read_text())


def _copy_run(original, tmp_path):
    run_copy = tmp_path / "runs" / original.run_dir.name
    shutil.copytree(original.run_dir, run_copy)
    return run_copy


def test_reproduce_a_cpu_run_bitwise_in_a_rebuilt_environment(original, built_env, tmp_path):
    into = tmp_path / "repro"
    proc = runyard("reproduce", str(original.run_dir), "--into", str(into))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = _report(into)
    assert report["verdict"] == "bitwise" and report["expected"] == "bitwise"
    (stage,) = report["stages"]
    assert stage["steps_compared"] == 12 and stage["max_abs_diff"] == 0 and stage["first_differing_step"] is None
    assert report["weights"]["equal"] and report["metrics"]["heldout_loss"]["abs_diff"] == 0
    assert report["environment_differences"] == [] and report["input_differences"] == []
    ctx = report["context"]
    assert ctx["environment_reused"] and ctx["command"].startswith(str(built_env.python))  # built once, not again
    assert "BITWISE" in proc.stdout and (into / "reproduction" / "curves.png").is_file()
    assert (into / "reproduction" / "report.md").read_text().startswith("# Reproduction of tiny")

    # The rebuilt environment is the lock: the CPU torch that ran, and a rerun that proves every hash.
    cuda = subprocess.run([str(built_env.python), "-c", "import torch; print(torch.version.cuda)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert cuda == "None"
    first, again = read_lock(original.run_dir / LOCK_DIR), read_lock(into / LOCK_DIR)
    assert again.unhashed() == []
    assert again.by_name()["torch"].sha256 == first.by_name()["torch"].sha256 is not None
    assert {d.name: d.version for d in again.distributions} == {d.name: d.version for d in first.distributions}


@pytest.mark.slurm
def test_the_slurm_backend_reproduces_bitwise(original, built_env, tmp_path):
    if not os.environ.get("RUNYARD_TEST_SLURM"):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("RUNYARD_TEST_SLURM is not set, and CI=true: run .ci/setup_slurm.sh and source .ci/env")
        pytest.skip("RUNYARD_TEST_SLURM is not set (run .ci/setup_slurm.sh, then `source .ci/env`)")
    into = tmp_path / "repro-slurm"
    proc = runyard("reproduce", str(original.run_dir), "--into", str(into), "--backend", "slurm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = _report(into)
    assert report["verdict"] == "bitwise" and report["context"]["slurm_job"].isdigit()
    assert "#SBATCH --cpus-per-task=1" in (into / "reproduction" / "rerun.sbatch").read_text()


def test_a_changed_seed_is_refused_then_named_as_the_cause(original, built_env, tmp_path):
    run_copy = _copy_run(original, tmp_path)
    spec = yaml.safe_load((run_copy / "spec.yaml").read_text())
    spec["seed"] = 8
    (run_copy / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    into = tmp_path / "repro"
    refused = runyard("reproduce", str(run_copy), "--into", str(into))
    assert refused.returncode == 2 and "seed: the run used seed 7; spec.yaml now says 8" in refused.stderr
    assert not into.exists()  # refused before any work

    proc = runyard("reproduce", str(run_copy), "--into", str(into), "--allow-changed-inputs")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = _report(into)
    assert report["verdict"] == "different" and "seed: 7 vs 8" in report["input_differences"]
    assert report["stages"][0]["first_differing_step"] == 1
    assert "seed: 7 vs 8" in (into / "reproduction" / "report.md").read_text()


def test_a_changed_data_file_is_named_before_any_work(original, tmp_path):
    # The project moved (a copy of its folder), and one of its data files was edited since the run.
    moved = tmp_path / "moved"
    shutil.copytree(original.root, moved)
    target = sorted((moved / "data").glob("json_*.py"))[0]
    target.write_text(target.read_text() + "\n# edited after the run\n")
    into = tmp_path / "repro"
    proc = runyard("reproduce", str(moved / "runs" / "tiny"), "--into", str(into), "--cwd", str(moved))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data sources[0] data/*.py" in proc.stderr and f"content changed: {target.name}" in proc.stderr
    assert not into.exists()


def test_a_lock_that_cannot_install_is_refused_naming_the_packages(original, tmp_path, monkeypatch):
    cache = tmp_path / "env-cache"
    monkeypatch.setenv("RUNYARD_ENV_CACHE", str(cache))
    run_copy = _copy_run(original, tmp_path)
    lock = read_lock(run_copy / LOCK_DIR)
    lock.distributions.append(LockedDist("winonly", "1.0", KIND_WHEEL, tags=["cp311-cp311-win_amd64"],
                                         filename="winonly-1.0-cp311-cp311-win_amd64.whl"))
    lock.python = {**lock.python, "major_minor": "3.99", "version": "3.99.0", "interpreter_tag": "cp399"}
    write_lock(run_copy / LOCK_DIR, lock)
    into = tmp_path / "repro"
    proc = runyard("reproduce", str(run_copy), "--into", str(into))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "winonly==1.0: its wheel winonly-1.0-cp311-cp311-win_amd64.whl is built for cp311-cp311-win_amd64" in proc.stderr
    assert "python: the lock needs Python 3.99.0" in proc.stderr and "nothing was run" in proc.stderr
    assert not into.exists() and not any(p.is_dir() for p in cache.glob("*"))

    # Platform-clean, but a version no index has: refused by the fetch, before any venv or rerun.
    lock = read_lock(original.run_dir / LOCK_DIR)
    lock.distributions = [d for d in lock.distributions if d.name in ("cycler", "six")] + [
        LockedDist("runyard-no-such-distribution", "9.9.9", KIND_WHEEL, tags=["py3-none-any"])]
    write_lock(run_copy / LOCK_DIR, lock)
    proc = runyard("reproduce", str(run_copy), "--into", str(into))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "runyard-no-such-distribution==9.9.9: no archive of this version" in proc.stderr
    assert not into.exists() and not any(p.is_dir() for p in cache.glob("*"))


def test_bundle_makes_a_wheelhouse_that_installs_with_no_index(original, built_env, tmp_path):
    run_copy = _copy_run(original, tmp_path)
    proc = runyard("env", "bundle", str(run_copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheelhouse = run_copy / LOCK_DIR / "wheelhouse"
    record = json.loads((wheelhouse / "bundle.json").read_text())
    lock = read_lock(run_copy / LOCK_DIR)
    assert len(record["wheels"]) == len(lock.distributions)  # every wheel, and runyard's own
    assert record["runyard_source_changes"] == [] and set(record["completed_hashes"]) == {d.name for d in lock.unhashed()}
    requirements = (wheelhouse / "requirements.txt").read_text()
    assert requirements.count("--hash=sha256:") == len(lock.distributions) and "runyard==0.1.0 --hash" in requirements
    # Every archive is there and matches its hash with no index at all.
    check = subprocess.run([sys.executable, "-m", "pip", "download", "--no-index", "--no-deps", "--require-hashes",
                            "--find-links", str(wheelhouse), "-r", str(wheelhouse / "requirements.txt"),
                            "-d", str(tmp_path / "offline")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
