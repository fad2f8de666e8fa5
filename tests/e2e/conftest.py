"""Fixtures for whole-run tests: a tiny but real spec over a slice of the stdlib sources, and one
finished reference run per test session (shared by every xdist worker) that tests copy and resume or
compare against instead of each training its own."""

from __future__ import annotations

import copy
import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from .corpus import write_learnable_corpus

TINY_SPEC = {
    "name": "tiny",
    "seed": 7,
    "data": {
        "sources": [{"path": "{stdlib}/json/*.py"}, {"path": "{stdlib}/email/*.py"}],
        "heldout_fraction": 0.1,
        "tokenizer": {"vocab_size": 512},
        "shard_tokens": 16384,
        "workers": 1,
    },
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "context_length": 64, "dropout": 0.1},
    "optim": {"lr": 0.02},
    "schedule": {"warmup_steps": 3},
    "train": {"steps": 16, "batch_size": 8},
    "stages": [{"name": "main", "gates": {"min_loss_drop": 0.05}}],
    # 16 steps do not beat the unigram baseline by 10% (nor can a few sft or dpo steps be counted on to
    # lower their held-out figures), so this run is not fit to ship and `runyard run` would exit 7: the tests
    # built on it are about the spine, not the verdict, so the bounds are off here (test_not_fit_to_ship.py
    # turns them on and expects exit 7).
    "eval": {"interval": 4, "batches": 2, "final_batches": 4, "prompts": ["def "], "sample_tokens": 8,
             "must_beat_unigram": False, "min_response_loss_drop": None, "min_reward_accuracy": None,
             "min_reward_margin": None, "min_task_score": 0.0},
    "checkpoint": {"interval": 4, "keep_last": 3},
    "resources": {"device": "cpu", "threads": 1},
}


def merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture
def write_spec(tmp_path):
    def _write(patch: dict | None = None, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(merge(TINY_SPEC, patch or {})))
        return path

    return _write


def runyard(*args: str, timeout: float = 300, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real command line in a subprocess."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "runyard", *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"runyard {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def shared_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `make(folder)` fills, made once per test session: under pytest-xdist the first worker
    to ask makes it (under a lock, the others wait) in the session's temporary root, and every worker
    reads the same folder. Tests must treat it as read-only (copy it to change it)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's root, above each worker's own folder
    root, done = base / f"shared-{name}", base / f"shared-{name}.done"
    with open(base / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # a worker that failed half-way
            root.mkdir()
            make(root)
            done.touch()
    return root


REFERENCE_STEPS = 60
# The reference run: the tiny spec for 60 steps on a corpus it learns decisively (tests/e2e/corpus.py).
REFERENCE_PATCH = {"train": {"steps": REFERENCE_STEPS}, "checkpoint": {"interval": 10}}


@dataclass(frozen=True)
class ReferenceRun:
    spec: Path  # the spec it ran (its data: the learnable corpus beside it)
    run_dir: Path  # the finished run: read it, or copy it to resume or damage it
    stdout: str  # what `runyard run` printed


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> ReferenceRun:
    """One uninterrupted run of the reference spec, trained once per session."""

    def make(root: Path) -> None:
        corpus = write_learnable_corpus(root / "corpus")
        spec = root / "spec.yaml"
        spec.write_text(yaml.safe_dump(merge(TINY_SPEC, {**REFERENCE_PATCH,
                                                         "data": {"sources": [{"path": f"{corpus}/*.txt"}],
                                                                  # its text supports ~440 tokens
                                                                  "tokenizer": {"vocab_size": 384}}})))
        proc = runyard("run", str(spec), "--run-dir", str(root / "run"), "--no-progress", check=True)
        (root / "stdout.txt").write_text(proc.stdout)

    root = shared_once(tmp_path_factory, "reference-run", make)
    return ReferenceRun(root / "spec.yaml", root / "run", (root / "stdout.txt").read_text())
