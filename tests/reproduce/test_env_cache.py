"""Pruning the cache of built environments: by last use, never one being built, never what is not ours."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

from runyard.reproduce.env_cache import READY_FILE, exclusive_build, mark_used, prune

DAY = 86400.0


def _env(cache, key, age_days, ready=True):
    root = cache / key
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "venv" / "bin" / "python").write_bytes(b"x" * 4096)
    stamp = root / READY_FILE if ready else root
    if ready:
        stamp.write_text("{}")
    old = time.time() - age_days * DAY
    os.utime(stamp, (old, old))
    return root


def test_prune_removes_environments_unused_past_the_limit_and_old_unfinished_builds(tmp_path):
    cache = tmp_path / "env"
    stale = _env(cache, "a" * 24, 40)
    fresh = _env(cache, "b" * 24, 2)
    broken = _env(cache, "c" * 24, 40, ready=False)
    memo = cache / "archives-memo"  # not an environment folder: never touched
    memo.mkdir()
    os.utime(memo, (0, 0))
    dry = prune(cache, 30 * DAY, time.time(), dry_run=True)
    assert {p.key for p in dry} == {"a" * 24, "c" * 24} and stale.is_dir()
    done = prune(cache, 30 * DAY, time.time())
    assert sorted((p.key, p.ready) for p in done) == [("a" * 24, True), ("c" * 24, False)]
    assert all(p.size_bytes >= 4096 for p in done)
    assert not stale.exists() and not broken.exists() and fresh.is_dir() and memo.is_dir()


def test_a_use_restarts_the_clock_and_a_build_in_progress_is_skipped(tmp_path):
    cache = tmp_path / "env"
    used = _env(cache, "d" * 24, 40)
    building = _env(cache, "e" * 24, 40, ready=False)
    mark_used(used)
    with exclusive_build(cache, "e" * 24):
        assert prune(cache, 30 * DAY, time.time()) == []
    assert used.is_dir() and building.is_dir()
    with open(cache / f"{'e' * 24}.lock") as fh:  # the lock is free again after the builder left
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fh, fcntl.LOCK_UN)
    assert [p.key for p in prune(cache, 30 * DAY, time.time())] == ["e" * 24]


def test_the_prune_verb_reports_what_it_removed(tmp_path):
    cache = tmp_path / "env"
    _env(cache, "f" * 24, 10)
    out = subprocess.run([sys.executable, "-m", "runyard", "env", "prune", "--cache", str(cache), "--unused-for", "5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"removed {cache / ('f' * 24)}" in out.stdout and "removed 1 environment(s)" in out.stdout
    assert not (cache / ("f" * 24)).exists()
