"""A disk that fills during data preparation: a clear error naming what was being written, nothing
half-written that a later preparation would take as good, and a later preparation with room finishes
with the same dataset as one that never ran out."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runyard.data.pipeline import prepare_data
from tests.data.data_fixtures import spec_for, write_corpus

ROOT = Path(__file__).resolve().parents[2]


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount(), reason="mounting a tmpfs needs root (CAP_SYS_ADMIN)")
@pytest.mark.parametrize("size", ["300k", "1200k"])  # full while cleaning; full while tokenizing
def test_a_full_disk_mid_preparation_is_a_clear_error_and_nothing_reads_as_good(tmp_path: Path, size: str):
    corpus = write_corpus(tmp_path / "corpus", n_docs=120, words=(300, 900))
    reference = prepare_data(spec_for(str(corpus / "*.txt")), seed=0, report_dir=None,
                             cache_dir=tmp_path / "reference", progress=False)
    mount = tmp_path / "mnt"
    mount.mkdir()
    script = f'mount -t tmpfs -o size={size} tmpfs "{mount}" && exec "$@"'
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
         sys.executable, "-m", "tests.data.diskfull_probe", str(corpus), str(mount)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["raised"] == "DiskFull", result
    assert "no space left writing" in result["message"] and "free" in result["message"]
    left = result["left"]
    assert not any(name.endswith("prepared.json") for name in left)  # the dataset is not marked done
    assert not [name for name in left if ".tmp-" in name or name.endswith(".tmp")], left
    parts = {name.split("/")[2] for name in left if name.startswith("steps/clean/")}
    assert all(f"steps/clean/{p}/meta.json" in left for p in parts), "a part without its meta reads as done"
    assert result["fingerprint"] == reference.fingerprint
