"""Session fixtures for reproduction tests: one environment cache, one finished CPU run, and its
environment built once (the slow part, a minute or two) and reused by every test that reproduces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from runyard.reproduce.build import BuiltEnvironment, build_environment
from runyard.reproduce.lock import LOCK_DIR, read_lock

TINY_SPEC = {
    "name": "tiny",
    "seed": 7,
    "data": {"heldout_fraction": 0.1, "tokenizer": {"vocab_size": 512}, "shard_tokens": 16384, "workers": 1},
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "context_length": 64, "dropout": 0.1},
    "optim": {"lr": 0.02},
    "schedule": {"warmup_steps": 3},
    "train": {"steps": 12, "batch_size": 8},
    "stages": [{"name": "main", "gates": {"min_loss_drop": 0.05}}],
    # Not fit to ship (16 steps do not beat the unigram baseline by 10%), which would end `run` with exit
    # 7: reproduction is about the bytes, not the verdict, so the bound is off.
    "eval": {"interval": 4, "batches": 2, "final_batches": 4, "prompts": ["def "], "sample_tokens": 8,
             "must_beat_unigram": False},
    "checkpoint": {"interval": 4, "keep_last": 2},
    "resources": {"device": "cpu", "threads": 1},
}


@dataclass
class FinishedRun:
    root: Path  # the working directory it ran in
    run_dir: Path
    data_dir: Path


def runyard(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real command line, in a subprocess (it inherits RUNYARD_ENV_CACHE)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "runyard", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)


def finished_run(root: Path, name: str = "tiny") -> FinishedRun:
    """Copy a slice of the stdlib as the run's own data (so a test may change it), and run the tiny spec."""
    data = root / "data"
    data.mkdir(parents=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for source in sorted((stdlib / "json").glob("*.py")) + sorted((stdlib / "email").glob("*.py")):
        shutil.copy(source, data / f"{source.parent.name}_{source.name}")
    spec = {**TINY_SPEC, "name": name, "data": {**TINY_SPEC["data"], "sources": [{"path": "data/*.py"}]}}
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    proc = runyard("run", "spec.yaml", "--run-dir", f"runs/{name}", "--no-progress", cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return FinishedRun(root, root / "runs" / name, data)


@pytest.fixture(scope="session")
def env_cache(tmp_path_factory):
    """One environment cache for the session (set for subprocesses too)."""
    path = tmp_path_factory.mktemp("env-cache")
    previous = os.environ.get("RUNYARD_ENV_CACHE")
    os.environ["RUNYARD_ENV_CACHE"] = str(path)
    yield path  # left to pytest's own clean-up of old temporary folders: deleting a venv here takes a while
    if previous is None:
        os.environ.pop("RUNYARD_ENV_CACHE", None)
    else:
        os.environ["RUNYARD_ENV_CACHE"] = previous


@pytest.fixture(scope="session")
def original(env_cache, tmp_path_factory) -> FinishedRun:
    return finished_run(tmp_path_factory.mktemp("original"))


@pytest.fixture(scope="session")
def built_env(original, env_cache) -> BuiltEnvironment:
    """The original run's environment, built once per test session."""
    return build_environment(read_lock(original.run_dir / LOCK_DIR), cache_root=env_cache)
