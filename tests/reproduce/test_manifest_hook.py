"""What a run's start records for reproduction (manifest.record_environment): the lock in env/, the data
files' digests, the working directory; a later session in another environment keeps its own lock."""

from __future__ import annotations

import json

from runyard.reproduce.lock import read_lock
from runyard.reproduce.manifest import new_manifest, read_manifest, record_environment, write_manifest
from runyard.spec.job import parse_spec


def _spec(data_glob: str):
    return parse_spec({"name": "t", "seed": 3, "data": {"sources": [{"path": data_glob}]}})


def test_run_start_records_lock_data_files_and_cwd(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("alpha\n")
    (data / "b.txt").write_text("beta\n")
    spec = _spec(f"{data}/*.txt")
    run_dir = tmp_path / "run"
    write_manifest(run_dir, new_manifest(spec.fingerprint(), spec.seed, ["runyard", "run"]))
    monkeypatch.chdir(tmp_path)
    record_environment(run_dir, spec)

    manifest = read_manifest(run_dir)
    lock = read_lock(run_dir / "env")
    assert manifest["environment"]["lock_sha256"] == lock.sha256
    assert manifest["environment"]["unhashed"] == [d.name for d in lock.unhashed()]
    assert manifest["cwd"] == str(tmp_path)
    (source,) = manifest["data_files"].values()
    assert set(source["files"]) == {"a.txt", "b.txt"} and len(source["sha256"]) == 64

    # A later session whose environment differs keeps its own lock; the first stays the run's.
    manifest["environment"]["lock_sha256"] = "0" * 64
    manifest["sessions"] = [{}, {}]
    write_manifest(run_dir, manifest)
    record_environment(run_dir, spec)
    after = read_manifest(run_dir)["environment"]
    assert after["changed_in_sessions"] == {"2": lock.sha256}
    assert read_lock(run_dir / "env" / "sessions" / "2").sha256 == lock.sha256


def test_unreadable_data_is_recorded_not_fatal(tmp_path):
    spec = _spec(f"{tmp_path}/nothing-here/*.txt")
    run_dir = tmp_path / "run"
    write_manifest(run_dir, new_manifest(spec.fingerprint(), spec.seed, []))
    record_environment(run_dir, spec)  # the data stage itself reports the missing source, right after
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert "matched no files" in manifest["data_files"]["error"]
    assert (run_dir / "env" / "requirements.txt").is_file()
