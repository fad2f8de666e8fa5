"""Publishing to a store and hydrating into a local cache: verified, resumable, evicting, residency."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runyard.data.hydrate import hydrate_dataset, publish_dataset
from runyard.data.pipeline import prepare_data
from runyard.data.shards import ShardCorrupt, load_index, verify_index
from runyard.errors import DataError, ResidencyError
from tests.data.data_fixtures import spec_for, write_corpus


@pytest.fixture
def published(tmp_path: Path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=60)
    spec = spec_for(str(corpus / "*.txt"), store={"url": str(tmp_path / "store"), "region": "eu"})
    prepared = prepare_data(spec, seed=0, report_dir=None, cache_dir=tmp_path / "prep", progress=False)
    publish_dataset(prepared, spec)
    return spec, prepared


def test_hydrate_copies_and_verifies(published, tmp_path: Path):
    spec, prepared = published
    result = hydrate_dataset(spec, prepared.fingerprint, cache_dir=tmp_path / "node", progress=False)
    assert result.prepared.fingerprint == prepared.fingerprint
    assert result.prepared.dataset_dir.is_relative_to(tmp_path / "node")
    assert result.bytes_copied > 0 and result.bytes_reused == 0 and result.mb_per_s > 0
    verify_index(result.prepared.train_index)
    again = hydrate_dataset(spec, prepared.fingerprint, cache_dir=tmp_path / "node", progress=False)
    assert again.bytes_copied == 0 and again.bytes_reused == result.bytes_copied


def test_hydrate_resumes_a_partial_copy(published, tmp_path: Path):
    spec, prepared = published
    shards = load_index(prepared.train_index)["shards"]
    dest = tmp_path / "node" / "datasets" / prepared.fingerprint[:32]
    dest.mkdir(parents=True)
    source = prepared.dataset_dir / shards[0]["file"]
    half = source.read_bytes()[: source.stat().st_size // 2]
    (dest / (shards[0]["file"] + ".partial")).write_bytes(half)
    result = hydrate_dataset(spec, prepared.fingerprint, cache_dir=tmp_path / "node", progress=False)
    assert result.bytes_reused == len(half)
    verify_index(result.prepared.train_index)


_INTERRUPTED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[4])
    import runyard.data.hydrate as h
    from data_fixtures import spec_for
    real = h._copy_resumable
    calls = 0
    def dying(fs, src, dest, size, sha):
        global calls
        calls += 1
        if calls == 3:  # half of this shard lands in .partial, then a hard kill
            with fs.open(src, "rb") as f, open(str(dest) + ".partial", "wb") as out:
                out.write(f.read(size // 2))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(fs, src, dest, size, sha)
    h._copy_resumable = dying
    spec = spec_for(sys.argv[1], store={"url": sys.argv[2]})
    h.hydrate_dataset(spec, sys.argv[3], cache_dir=sys.argv[5], threads=1, progress=False)
""")


def test_hydrate_resumes_after_a_kill(published, tmp_path: Path):
    spec, prepared = published
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            spec.sources[0].path,
            spec.store.url,
            prepared.fingerprint,
            str(Path(__file__).parent),
            str(tmp_path / "node"),
        ],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    dest = tmp_path / "node" / "datasets" / prepared.fingerprint[:32]
    assert not (dest / "prepared.json").exists()  # not usable half-way
    assert len(list(dest.glob("*.partial"))) == 1
    result = hydrate_dataset(spec, prepared.fingerprint, cache_dir=tmp_path / "node", progress=False)
    assert result.bytes_reused > 0
    verify_index(result.prepared.train_index)
    verify_index(result.prepared.heldout_index)


def test_corrupt_store_copy_is_refused(published, tmp_path: Path):
    spec, prepared = published
    shard = load_index(prepared.train_index)["shards"][0]["file"]
    stored = Path(spec.store.url) / prepared.fingerprint[:32] / shard
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0x01
    stored.write_bytes(bytes(data))
    with pytest.raises(ShardCorrupt, match="store copy is corrupt"):
        hydrate_dataset(spec, prepared.fingerprint, cache_dir=tmp_path / "node", progress=False)


def test_hydrate_refuses_paths_that_leave_the_cache(published, tmp_path: Path):
    spec, prepared = published
    with pytest.raises(DataError, match="not 32-64 lowercase hex"):
        hydrate_dataset(spec, "../../escape", cache_dir=tmp_path / "node", progress=False)
    index = Path(spec.store.url) / prepared.fingerprint[:32] / "train.json"
    index.write_text(index.read_text().replace('"file": "train', '"file": "../../../outside', 1))
    with pytest.raises(DataError, match="not a plain file name"):
        hydrate_dataset(spec, prepared.fingerprint, cache_dir=tmp_path / "node", progress=False)
    assert not list(tmp_path.glob("**/outside*"))


def test_eviction_keeps_the_cache_under_its_limit(published, tmp_path: Path):
    spec, prepared = published
    cache = tmp_path / "node"
    old = cache / "datasets" / "old-dataset"
    old.mkdir(parents=True)
    (old / "blob").write_bytes(b"x" * 200_000)
    size = sum(
        p.stat().st_size for p in prepared.dataset_dir.iterdir() if p.is_file() and not p.name.startswith(".")
    )
    result = hydrate_dataset(
        spec, prepared.fingerprint, cache_dir=cache, max_cache_bytes=size + 50_000, progress=False
    )
    assert result.evicted == ["old-dataset"] and not old.exists()
    with pytest.raises(DataError, match="cache limit"):
        hydrate_dataset(
            spec, prepared.fingerprint, cache_dir=tmp_path / "tiny", max_cache_bytes=1000, progress=False
        )


def test_residency_refuses_before_any_byte_moves(published, tmp_path: Path):
    spec, prepared = published
    eu_only = spec.model_copy(update={"residency": ["eu", "uk"], "cache_region": "us-east"})
    with pytest.raises(ResidencyError, match="region 'us-east'"):
        hydrate_dataset(eu_only, prepared.fingerprint, cache_dir=tmp_path / "us", progress=False)
    assert not (tmp_path / "us").exists()
    unlabelled = spec.model_copy(update={"residency": ["eu"], "cache_region": None})
    with pytest.raises(ResidencyError, match="no region label"):
        hydrate_dataset(unlabelled, prepared.fingerprint, cache_dir=tmp_path / "unknown", progress=False)
    # Publishing into a store in another region is refused too, and so is preparing into such a cache.
    us_store = spec.model_copy(
        update={"residency": ["eu"], "store": spec.store.model_copy(update={"region": "us"})}
    )
    with pytest.raises(ResidencyError, match="store"):
        publish_dataset(prepared, us_store)
    with pytest.raises(ResidencyError):
        prepare_data(eu_only, seed=0, report_dir=None, cache_dir=tmp_path / "us2", progress=False)
    assert not (tmp_path / "us2").exists()
    ok = spec.model_copy(update={"residency": ["EU"], "cache_region": "eu"})
    assert (
        hydrate_dataset(ok, prepared.fingerprint, cache_dir=tmp_path / "eu", progress=False).bytes_copied > 0
    )
