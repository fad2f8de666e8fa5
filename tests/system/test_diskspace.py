"""Disk space: needs checked before work with the figures, and a full disk at any write reported as
what was being written, where, how much it needed and how much was free. Real full filesystems (a
small tmpfs in a private mount namespace) where the machine allows mounting; injected failing writes
everywhere."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runyard import cli
from runyard.cli import spec as spec_cli
from runyard.errors import DiskFull, InsufficientDiskSpace
from runyard.system import files
from runyard.system.diskspace import (
    DiskNeed,
    check_disk,
    free_bytes,
    group_by_filesystem,
    is_disk_full,
    writing,
)

ROOT = Path(__file__).resolve().parents[2]


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


needs_mount = pytest.mark.skipif(not _can_mount(), reason="mounting a tmpfs needs root (CAP_SYS_ADMIN)")


def in_tmpfs(mount: Path, size: str, *command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `command` with a `size` tmpfs mounted on `mount`, in a private mount namespace."""
    mount.mkdir(parents=True, exist_ok=True)
    script = f'mount -t tmpfs -o size={size} tmpfs "{mount}" && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *command],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


# --- checks before work ------------------------------------------------------------------------------


def test_needs_on_one_filesystem_are_summed_and_refused_with_the_figures(tmp_path):
    free = free_bytes(tmp_path)
    half = free // 2 + 1
    needs = [DiskNeed("the data cache", tmp_path / "cache", half), DiskNeed("stage main checkpoints", tmp_path / "run", half)]
    (check,) = group_by_filesystem(needs)
    assert check.needed == 2 * half and not check.fits  # each fits alone, not both
    with pytest.raises(InsufficientDiskSpace) as info:
        check_disk(needs, hint="free some space")
    text = str(info.value)
    assert "the data cache" in text and str(tmp_path / "cache") in text and str(tmp_path / "run") in text
    assert "free" in text and "DOES NOT FIT" in text and "free some space" in text
    assert check_disk([DiskNeed("small", tmp_path / "x", 1024)])[0].fits


def test_a_nonexistent_path_is_measured_where_it_would_be_created(tmp_path):
    assert free_bytes(tmp_path / "not" / "yet" / "there") == free_bytes(tmp_path)


# --- a full disk at a write, injected -------------------------------------------------------------


def test_atomic_write_translates_enospc_and_leaves_no_temp_file(tmp_path, monkeypatch):
    real_fdopen = os.fdopen

    class FullFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fdopen", lambda fd, mode: FullFile(real_fdopen(fd, mode)))
    with pytest.raises(DiskFull) as info:
        files.atomic_write_bytes(tmp_path / "report.json", b"x" * 5000)
    text = str(info.value)
    assert str(tmp_path / "report.json") in text and "needed 4.9 KiB" in text and "free" in text
    assert list(tmp_path.iterdir()) == []


def test_library_wording_of_a_full_disk_is_recognised(tmp_path):
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert not is_disk_full(RuntimeError("shape mismatch"))
    with pytest.raises(DiskFull, match="writing the export"), writing("the export", tmp_path, needed=10):
        raise RuntimeError("I/O error: No space left on device (os error 28)")
    with pytest.raises(ValueError), writing("a small file", tmp_path, needed=10):
        raise ValueError("not about space")  # other errors pass through unchanged


def test_cli_reports_an_untranslated_enospc_plainly(monkeypatch, capsys):
    def full_disk(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/out.bin")

    monkeypatch.setattr(spec_cli, "cmd_init", full_disk)  # a verb whose write fails outside system/files.py
    assert cli.main(["spec", "init"]) == 1
    err = capsys.readouterr().err
    assert "no space left on the device writing /data/out.bin" in err and "free on" in err
    assert "Traceback" not in err


# --- a full disk at a write, for real --------------------------------------------------------------


@needs_mount
@pytest.mark.parametrize(
    "kind, what",
    [("atomic", "big.bin"), ("checkpoint", "checkpoint step_00000007"), ("export", "the export")],
)
def test_full_filesystem_write_is_a_clear_error_and_leaves_nothing_half_written(tmp_path, kind, what):
    proc = in_tmpfs(tmp_path / "mnt", "2m", sys.executable, str(ROOT / "tests" / "system" / "disk_probe.py"), kind,
                    str(tmp_path / "mnt"), str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["raised"] == "DiskFull", result
    assert what in result["message"] and "it needed" in result["message"] and "free" in result["message"]
    # Nothing that reads as good: no final file, no temporary one either.
    assert result["left"] == [], result["left"]


@needs_mount
def test_run_is_refused_before_work_when_checkpoints_will_not_fit(tmp_path):
    spec = {
        "name": "tiny-disk",
        "data": {"sources": [{"path": "{stdlib}/json/*.py"}], "tokenizer": {"vocab_size": 512}, "workers": 1},
        "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "context_length": 32},
        "train": {"steps": 4, "batch_size": 2},
        "schedule": {"warmup_steps": 1},
        "resources": {"device": "cpu", "threads": 1},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    mnt = tmp_path / "mnt"
    proc = in_tmpfs(mnt, "3m", sys.executable, "-m", "runyard", "run", str(path), "--run-dir", str(mnt / "run"),
                    "--no-progress", env={"RUNYARD_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "not enough free disk space to start" in proc.stderr
    assert "stage main checkpoints" in proc.stderr and str(mnt / "run" / "stages" / "main" / "checkpoints") in proc.stderr
    assert "DOES NOT FIT" in proc.stderr and "keep_last" in proc.stderr
    assert not (tmp_path / "cache").exists()  # refused before the data stage


@needs_mount
def test_data_preparation_is_refused_when_the_cache_will_not_fit(tmp_path):
    spec = {"name": "t", "data": {"sources": [{"path": "{stdlib}/email/**/*.py"}], "workers": 1}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    mnt = tmp_path / "mnt"
    proc = in_tmpfs(mnt, "1m", sys.executable, "-m", "runyard", "prepare", str(path), "--cache-dir", str(mnt),
                    "--no-progress")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "not enough free disk space to start" in proc.stderr and "the data cache" in proc.stderr
    assert "data.cache_dir" in proc.stderr
