"""The Ray executor on a local Ray (started by the executor, no address given): the same dataset as the
local executor, its tasks' CPU seconds counted, and the Ray it started stopped with it. Needs the `ray`
extra; skipped without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from runyard.data.executors import ExecutorChoice
from runyard.data.pipeline import PreparedData, prepare_data
from runyard.data.shards import load_index
from tests.data.data_fixtures import spec_for, write_corpus

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'runyard[ray]')")

pytestmark = pytest.mark.slow


def shard_hashes(prepared: PreparedData) -> list[str]:
    return [s["sha256"] for idx in (prepared.train_index, prepared.heldout_index) for s in load_index(idx)["shards"]]


def test_a_local_ray_prepares_the_dataset_the_local_executor_does(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    corpus = write_corpus(tmp_path / "corpus", n_docs=30, words=(4000, 8000))  # several parts
    spec = spec_for(str(corpus / "*.txt"), workers=2, memory_limit=1 << 30)
    local = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "local", progress=False)
    on_ray = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "ray", progress=False,
                          executor=ExecutorChoice("ray"))
    assert not ray.is_initialized()  # the executor stopped the Ray it started
    assert on_ray.fingerprint == local.fingerprint
    assert shard_hashes(on_ray) == shard_hashes(local)
    assert on_ray.tokenizer_path.read_bytes() == local.tokenizer_path.read_bytes()
    cpu = on_ray.stats["cpu_seconds"]
    assert cpu["clean_tasks"] > 0 and cpu["tokenize_tasks"] > 0  # the tasks ran, on Ray, and said so
