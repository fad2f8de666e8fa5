"""Issue 10.2 under the control plane: what an attempt leaves running is killed before the next starts,
an attempt killed by a signal is an `infra` failure (retried from the provider's budget), and a job
dies with its shim."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from runyard.control import procs
from runyard.control.backends.slurm import SlurmBackend
from tests.e2e.faults import ProcessTree, finish, wait_until

ORPHAN_JOB = str(Path(__file__).with_name("orphan_job.py"))


def test_leftovers_of_a_killed_attempt_are_killed_before_the_retry(daemon_factory, tmp_path):
    d = daemon_factory("--cpu-slots", "1", "--backoff", "0.1", "--infra-retries", "2")
    run_dir = tmp_path / "run"
    (job,) = d.client.submit([{"name": "leaves-one", "argv": [sys.executable, ORPHAN_JOB], "run_dir": str(run_dir)}])
    final = d.client.wait(job["id"], timeout_s=60)
    assert final["state"] == "succeeded", d.client.logs(job["id"])["text"][-2000:]
    assert json.loads((run_dir / "seen.json").read_text()) == {"orphan_alive": False}
    orphan = int((run_dir / "orphan.pid").read_text())
    assert not procs.is_alive(orphan, None)
    history = d.client.job(job["id"])["history"]
    assert any(h["to_state"] == "recovering" and h["reason"].startswith("infra") for h in history), history
    assert "left by an earlier attempt" in d.client.logs(job["id"])["text"]


def test_a_job_dies_with_its_shim(tmp_path):
    """The shim killed alone (SIGKILL) takes its job with it: nothing runs on unwatched."""
    tree = ProcessTree()
    pid_file = tmp_path / "job.pid"
    job = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"]
    shim = tree.start([sys.executable, "-m", "runyard.control.shim", str(tmp_path / "status.json"), "--", *job])
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text(), 60, "the job to start", proc=shim)
        shim.send_signal(signal.SIGKILL)
        finish(shim, 10)
        tree.assert_none_left(timeout=10)
    finally:
        tree.kill_all()


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_jobs_of_an_earlier_attempt_are_cancelled_before_the_next(tmp_path):
    if not os.environ.get("RUNYARD_TEST_SLURM"):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("RUNYARD_TEST_SLURM is not set, and CI=true: run .ci/setup_slurm.sh and source .ci/env")
        pytest.skip("RUNYARD_TEST_SLURM is not set (run .ci/setup_slurm.sh, then `source .ci/env`)")
    earlier = SimpleNamespace(id=900_000 + os.getpid() % 1000, name="leftover")
    name = f"runyard-{earlier.id}-{earlier.name}"
    out = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", f"--output={tmp_path / 'out.log'}",
                          "--wrap", "sleep 300"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    slurm_id = out.stdout.strip().split(";")[0]
    backend = SlurmBackend(gres=None)
    try:
        assert backend._slurm_ids(earlier) == [slurm_id]
        assert backend.kill_leftovers(earlier) == [slurm_id]
        assert backend._slurm_ids(earlier) == []
        assert backend.kill_leftovers(earlier) == []  # nothing left: nothing to do
    finally:
        subprocess.run(["scancel", slurm_id], capture_output=True, timeout=60)
